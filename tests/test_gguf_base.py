"""An adapter trained on a `.gguf` file names a base that peft's AutoPeftModelForCausalLM can load: the repository
the GGUF's metadata names, else the run's `base/` folder (the GGUF's weights as a Hugging Face folder); summary.json
says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardfit.config import load_config
from shardfit.parallel.env import init_distributed
from shardfit.train.base_ref import base_for_adapter, hub_id_in_gguf
from shardfit.train.recipe import train
from tests.test_model_cache import make_tiny_gguf


@pytest.mark.parametrize("key, value, repo", [
    ("general.source.repo_url", "https://huggingface.co/HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
    ("general.source.url", "https://hf.co/Qwen/Qwen2.5-0.5B/tree/main", "Qwen/Qwen2.5-0.5B"),
    ("general.source.huggingface.repository", "org/model", "org/model"),
    ("general.source.url", "https://github.com/someone/weights", None),  # not a hub repository: not a base id
])
def test_the_repository_a_gguf_names(tmp_path: Path, key: str, value: str, repo: str | None) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", metadata={key: value})
    assert hub_id_in_gguf(path) == ((repo, key) if repo else None)
    ref = base_for_adapter(str(path), tmp_path / "run")
    assert (ref.name, ref.export_to) == ((repo, None) if repo else (str((tmp_path / "run" / "base").resolve()),
                                                                    (tmp_path / "run" / "base").resolve()))


def test_an_adapter_of_a_gguf_loads_with_auto_peft(tmp_path: Path, small_data: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDFIT_MODEL_CACHE", str(tmp_path / "cache"))
    model = make_tiny_gguf(tmp_path / "tiny.gguf")  # llama.cpp's keys, none naming a repository
    run = tmp_path / "run"
    cfg = load_config(overrides=[f"model={model}", f"data={small_data}", "method=lora", "precision=fp32",
                                 "max_seq_len=512", "micro_batch=1", "max_steps=2", "lr=1e-2", "eval_split=0",
                                 "report_to=[none]", f"output_dir={run}"])
    result = train(cfg, init_distributed(), quiet=True)
    adapter_cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str((run / "base").resolve())
    assert result.summary["base_model"] == {"name": str((run / "base").resolve()), "source": "exported"}

    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(run / "adapter")).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    trained = result.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)
