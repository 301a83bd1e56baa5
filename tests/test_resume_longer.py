"""A finished run trained longer: raising max_steps (or epochs) continues from its last checkpoint and says so;
any change that alters what was trained stays refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.train.rundir import longer_schedule
from tests.helpers import ROOT, read_jsonl, run_cli, write_config

BASE = dict(method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=100,
            eval_steps=100, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, report_to="none")


def _own_threads_env() -> dict[str, str]:
    """The environment of a user who set no thread count (the test session sets OMP_NUM_THREADS=1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "SHARDFIT_OMP"))}
    return {**env, "PYTHONPATH": str(ROOT / "src")}


@pytest.mark.heavy  # test_training holds resume equality; this, a finished run taken further
def test_raising_max_steps_continues_a_finished_run(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", **BASE, model=str(tiny_llama), data=str(small_data), output_dir=str(run),
                       max_steps=3)
    first = subprocess.run([sys.executable, "-m", "shardfit", "train", str(cfg)], capture_output=True, text=True,
                           timeout=300, env=_own_threads_env(), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    # No OMP_NUM_THREADS: the start line says how many threads shardfit chose, and from what.
    assert "thread" in first.stdout and "per rank (from " in first.stdout and "affinity" in first.stdout
    adapter_before = (run / "adapter" / "adapter_model.safetensors").read_bytes()

    r = run_cli("train", str(cfg), "--set", "max_steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step-3 (step 3): a longer schedule of the same run (max_steps: 3 -> 5)" \
        in r.stderr
    assert "5 steps (continuing from step 3)" in r.stdout and "done: 5 steps" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed_from_step"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3", "step-5"]
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() != adapter_before
    # metrics.jsonl reads as one run: every step once, in order, the continued steps training at a real lr.
    train_lines = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in train_lines] == [1, 2, 3, 4, 5]
    assert train_lines[3]["lr"] > 0

    # What alters the trained result stays refused, with the message of a different run (a shorter run too:
    # test_longer_schedule_rules).
    refused = run_cli("train", str(cfg), "--set", "lr=0.02", "--set", "max_steps=7")
    assert refused.returncode == 2 and "holds a different run" in refused.stderr
    assert "lr: 0.01 -> 0.02" in refused.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 5


def test_longer_schedule_rules(tmp_path: Path) -> None:
    """Only the length keys changed, and the new length is at least the old one; epochs count through the run's
    steps per epoch (run.json, else summary.json)."""
    old = {"lr": 1e-4, "epochs": 1, "max_steps": None, "seed": 1}
    prev = {"fingerprint": old, "steps": 120, "steps_per_epoch": 120}
    assert "to step 360 (was 120)" in longer_schedule(tmp_path, prev, {**old, "epochs": 3})
    assert "to step 200 (was 120)" in longer_schedule(tmp_path, prev, {**old, "max_steps": 200})
    assert "the same 120 steps" in longer_schedule(tmp_path, prev, {**old, "max_steps": 120})
    assert longer_schedule(tmp_path, prev, {**old, "max_steps": 100}) is None  # shorter: a different run
    assert longer_schedule(tmp_path, prev, {**old, "epochs": 2, "lr": 1e-3}) is None  # lr changed too
    bare = {"fingerprint": old}  # an older run.json: the length from summary.json
    assert longer_schedule(tmp_path, bare, {**old, "epochs": 2}) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 120, "steps_per_epoch": 120}))
    assert "to step 240 (was 120)" in longer_schedule(tmp_path, bare, {**old, "epochs": 2})
