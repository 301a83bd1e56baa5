"""Refusals that a random sweep of `shardfit check` configs over the catalog found naming the wrong key or no fix:
each now names the key that asked for it and what to set instead, with exit 2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import ROOT, write_config

DATA = str(ROOT / "examples" / "data" / "train.jsonl")


def _check(tmp_path: Path, capsys: pytest.CaptureFixture, **keys) -> tuple[int, str]:
    cfg = write_config(tmp_path / "c.yaml", model="Qwen/Qwen3-0.6B", data=DATA, output_dir=str(tmp_path / "run"),
                       **keys)
    code = main(["check", str(cfg), "--gpus", "8xH100"])
    out = capsys.readouterr()
    return code, out.err + out.out


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_its_package_names_attn_implementation(tmp_path: Path, capsys) -> None:
    """It read as "'model': its config.json does not build a model" (transformers' ImportError), blaming a good
    config for a package the key asked for."""
    code, text = _check(tmp_path, capsys, attn_implementation="flash_attention_2")
    assert code == 2 and "'attn_implementation': flash_attention_2 needs the flash-attn package" in text
    assert "set attn_implementation: auto" in text and "config.json does not build" not in text


def test_expert_parallel_on_a_dense_model_says_what_to_set(tmp_path: Path, capsys) -> None:
    """It ended "(no routed experts to share out): or set expert_parallel: 1", an "or" with nothing before it."""
    code, text = _check(tmp_path, capsys, strategy="zero3", expert_parallel=2)
    assert code == 2 and "is a dense model (no routed experts to share out): set expert_parallel: 1." in text
