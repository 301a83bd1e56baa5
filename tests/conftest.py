"""Shared fixtures: tiny real transformers models (no download) that use the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "src" / "shardfit" / "demo" / "train.jsonl"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 tokenizer (from the GGUF package) saved once as plain HF tokenizer files."""
    from shardfit.models.load import load_tokenizer
    from shardfit.models.source import resolve_model

    out = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def make_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", tie: bool = True, seed: int = 0) -> Path:
    """A randomly initialised tiny model of a real architecture, saved as an HF folder with the tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


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


def write_config(path: Path, **keys) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m shardfit ...` in a subprocess, as a user runs it."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_omni_config():
    """A Qwen2.5-Omni config shrunk in every part (thinker text/vision/audio, talker, token2wav)."""
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    audio = dict(encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32)
    talker = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, embedding_size=32, head_dim=8, rope_parameters=rope)
    dit = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16, head_dim=16,
               enc_emb_dim=16, enc_dim=32, enc_channels=[32, 32, 32, 32, 64], enc_attention_channels=16,
               enc_se_channels=16, num_embeds=64, mel_dim=16, repeats=2)
    bigvgan = dict(mel_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                   resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])
    return Qwen2_5OmniConfig(thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio),
                             talker_config=talker, token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A saved tiny Qwen2.5-Omni (thinker + talker + token2wav) with the tokenizer and a speaker map."""
    import shutil

    from transformers import Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-omni")
    Qwen2_5OmniForConditionalGeneration(tiny_omni_config()).save_pretrained(out)
    torch.save({}, out / "spk_dict.pt")  # real Omni checkpoints ship spk_dict.pt; its loader requires one
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out
