"""The ten-minute GPU check (bench/gpu_check.py): it stops at once without CUDA, and its rehearsal (`--tiny`)
runs its steps end to end on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT


def _check(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "check", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_cuda_the_check_stops_at_once_with_a_message(tmp_path: Path) -> None:
    r = _check("--out", str(tmp_path / "c.json"), "--work-dir", str(tmp_path / "w"), timeout=120)
    assert r.returncode == 1 and "no CUDA GPU here" in r.stderr and "--tiny" in r.stderr
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "w").exists()  # nothing built or exported


@pytest.mark.slow
@pytest.mark.heavy
def test_the_rehearsal_trains_measures_and_writes_one_json(tmp_path: Path) -> None:
    """A LoRA (with the memory against its plan), the full run's profiled step, and the speed comparison with the
    Trainer, as the GPU check runs them, with tiny models on this CPU."""
    out = tmp_path / "check.json"
    r = _check("--tiny", "--only", "full", "speed-lora", "--out", str(out), "--work-dir", str(tmp_path / "w"),
               timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tiny"] is True and report["machine"] and report["gpu"] is None
    full = report["methods"]["full"]
    assert full["ok"] and len(full["losses"]) == full["steps"] == 3 and full["weight_files"]
    assert full["memory"]["measured_gib"] > 0 and full["memory"]["planned_gib"] > 0
    assert full["profile"]["ops_table_top"][0].startswith("steps 2-2")
    speed = report["speed"]["lora"]
    assert speed["shardfit"]["ok"] and speed["hf_trainer_bf16"]["train_tokens_per_s"] > 0
    assert speed["speedup"] > 0 and speed["memory_ratio"] > 0 and "mfu" not in speed  # no GPU peak on a CPU


def test_the_experts_dtype_timing_rehearses_and_writes_its_json(tmp_path: Path) -> None:
    """bench/gpu_experts.py (the planner's fp32-experts term, to be timed on a GPU): without CUDA it stops at once;
    its rehearsal builds the block through the model (transformers' default experts implementation), times bf16 and
    fp32 stacks under autocast and writes the ratios it printed."""
    script = str(ROOT / "bench" / "gpu_experts.py")
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "x.json")], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "no CUDA GPU" in r.stderr and not (tmp_path / "x.json").exists()
    out = tmp_path / "experts.json"
    r = subprocess.run([sys.executable, script, "--tiny", "--steps", "2", "--out", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["tiny"] and got["widths"]["num_experts"] == 8 and got["bf16_s"] > 0 and got["fp32_s"] > 0
    assert got["fp32_over_bf16"] == round(got["fp32_s"] / got["bf16_s"], 2)
    assert f"{got['fp32_over_bf16']}x the bf16 step" in r.stdout
