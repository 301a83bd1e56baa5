"""Shared fixtures: tiny real transformers models (no download) that use the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

from shardfit.models.build import load_tokenizer
from shardfit.models.source import resolve_model
from tests.helpers import DEMO_DATA, make_tiny_model, make_tiny_vl, tiny_omni_config

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GGUF model cache for the whole session (the CLI runs inherit it): SmolLM2 is converted once per session,
    and never into the user's own ~/.cache. A SHARDFIT_MODEL_CACHE set by the caller is kept."""
    if "SHARDFIT_MODEL_CACHE" not in os.environ:
        os.environ["SHARDFIT_MODEL_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    return Path(os.environ["SHARDFIT_MODEL_CACHE"])


@pytest.fixture(scope="session", autouse=True)
def empty_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty Hugging Face hub cache for the whole session, in this process and the CLI runs it starts: `plan
    --model` reads a config.json an earlier download left there (plan/shapes.py `cached_config_path`), so a test
    must not see what this machine happens to hold."""
    import huggingface_hub.constants

    empty = tmp_path_factory.mktemp("hf-hub-cache")
    os.environ["HF_HUB_CACHE"] = str(empty)
    huggingface_hub.constants.HF_HUB_CACHE = str(empty)
    return empty


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 tokenizer (from the GGUF package) saved once as plain HF tokenizer files."""
    out = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir, "qwen2", tie=False)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 rows of the demo task in alpaca format."""
    out = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = DEMO_DATA.read_text().splitlines()[:64]
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A saved tiny Qwen2.5-Omni (thinker + talker + token2wav) with the tokenizer and a speaker map."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-omni")
    Qwen2_5OmniForConditionalGeneration(tiny_omni_config()).save_pretrained(out)
    torch.save({}, out / "spk_dict.pt")  # real Omni checkpoints ship spk_dict.pt; its loader requires one
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A saved tiny Qwen2-VL with the vision tokens in its tokenizer and a small-image processor."""
    return make_tiny_vl(tmp_path_factory.mktemp("tiny-vl"), tokenizer_dir, "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_vl25(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A saved tiny Qwen2.5-VL (windowed vision attention), otherwise as tiny_vl."""
    return make_tiny_vl(tmp_path_factory.mktemp("tiny-vl25"), tokenizer_dir, "qwen2_5_vl")
