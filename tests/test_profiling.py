"""`profile_steps`: torch.profiler over a run's steps, written to the run directory; the CLI's run of it."""

from __future__ import annotations

import json
from pathlib import Path

from shardfit.train.profiling import StepProfiler
from tests.helpers import run_cli, write_config

KEYS = dict(method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-3, log_steps=1, save_steps=100,
            lora={"rank": 4, "alpha": 8}, resume="never")


def _run(tmp_path: Path, model: Path, data: Path, **over) -> tuple[int, str, Path]:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", **dict(KEYS, model=str(model), data=str(data), output_dir=str(out), **over))
    done = run_cli("train", str(cfg))
    return done.returncode, done.stdout + done.stderr, out


def test_a_profiled_run_writes_each_ranks_ops_and_trace(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Steps 2 and 3 of 4 (the first is warm-up): a table of the ops a step ran and a trace a viewer opens; the
    run's own outputs are those of any run."""
    code, text, run = _run(tmp_path, tiny_llama, small_data, max_steps=4, profile_steps=2)
    assert code == 0, text
    ops = (run / "profile" / "ops-rank0.txt").read_text()
    assert ops.startswith("steps 2-3\n") and "aten::mm" in ops and "Self CPU" in ops
    trace = json.loads((run / "profile" / "trace-rank0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert f"profile: {run / 'profile'}" in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["cudnn_attention"] is None  # a GPU run's decision; none on a CPU


def test_a_profile_longer_than_the_run_ends_with_it(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    code, text, run = _run(tmp_path, tiny_llama, small_data, max_steps=3, profile_steps=10)
    assert code == 0, text
    assert (run / "profile" / "ops-rank0.txt").read_text().startswith("steps 2-3\n")


def test_no_profile_unless_asked_and_a_bad_count_is_refused(tmp_path: Path, tiny_llama: Path,
                                                           small_data: Path) -> None:
    code, text, run = _run(tmp_path, tiny_llama, small_data, max_steps=2)
    assert code == 0 and not (run / "profile").exists() and "profile:" not in text
    code, text, _ = _run(tmp_path, tiny_llama, small_data, max_steps=2, profile_steps=-1)
    assert code == 2 and "profile_steps" in text and "Traceback" not in text


def test_a_profile_cut_short_by_a_failure_is_stopped_and_not_written(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, steps=3, start_step=0, rank=0, device_type="cpu")
    prof.before(1)
    assert prof.active is None  # the first step is warm-up
    prof.before(2)
    assert prof.active is not None
    prof.close()
    assert prof.active is None and not (tmp_path / "profile").exists()
