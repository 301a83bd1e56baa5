"""Nothing is lost: a run directory belongs to one run, damaged checkpoints are skipped, a diverging run stops at
the step it diverged, a second training into the same directory is refused, and killing `shardfit` stops its
ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardfit.config import load_config
from shardfit.errors import JobFailed, UserError
from shardfit.parallel.env import init_distributed
from shardfit.train import checkpoint as ckpt_module
from shardfit.train.diverge import DivergenceStop
from shardfit.train.recipe import train
from tests.helpers import read_jsonl, run_here, write_config

BASE = dict(method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=3,
            eval_steps=100, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0)


def _cfg(tmp: Path, model: Path, data: Path, name: str = "c.yaml", **over) -> Path:
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp / "run"))
    keys.update(over)
    return write_config(tmp / name, **keys)


def _train(cfg: Path, *overrides: str):
    return train(load_config(cfg, overrides), init_distributed(), quiet=True)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_stale_checkpoints_of_another_run_are_never_resumed(tmp_path: Path, tiny_llama: Path,
                                                            small_data: Path) -> None:
    run = tmp_path / "run"
    _train(_cfg(tmp_path, tiny_llama, small_data, max_steps=12))
    # The same output_dir, a shorter run: its checkpoints are not this config's.
    short = _cfg(tmp_path, tiny_llama, small_data, "short.yaml", max_steps=6)
    with pytest.raises(UserError, match=r"holds a different run \(max_steps: 12 -> 6\)"):
        _train(short)
    assert (run / "checkpoints" / "step-12").is_dir()  # refused, nothing touched
    # resume: never starts over: the old run's outputs go, the new run keeps its own checkpoints.
    result = _train(short, "resume=never")
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-3", "step-6"]
    assert result.summary["resumed_from_step"] is None and result.summary["steps"] == 6
    fresh = tmp_path / "fresh"
    _train(_cfg(tmp_path, tiny_llama, small_data, "fresh.yaml", max_steps=6, output_dir=str(fresh)))
    for k, v in _adapter(fresh).items():
        torch.testing.assert_close(_adapter(run)[k], v, rtol=0, atol=0)  # the shipped adapter is this run's


def test_finished_run_is_not_overwritten(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, max_steps=3)
    _train(cfg)
    summary = (tmp_path / "run" / "summary.json").read_text()
    result = train(load_config(cfg), init_distributed())
    out = capsys.readouterr().out
    assert "already finished" in out and "Raise max_steps or epochs to train it longer" in out
    assert (tmp_path / "run" / "summary.json").read_text() == summary and result.summary["train_loss"] is not None


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path, tiny_llama: Path,
                                                                small_data: Path, caplog) -> None:
    clean = tmp_path / "clean"
    _train(_cfg(tmp_path, tiny_llama, small_data, "clean.yaml", max_steps=6, output_dir=str(clean)))
    run = tmp_path / "run"
    cfg = _cfg(tmp_path, tiny_llama, small_data, max_steps=6)
    _train(cfg)
    # The last checkpoint gets damaged (a truncated shard) and the run is taken back to before its end.
    shard = next((run / "checkpoints" / "step-6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    (run / "summary.json").unlink()
    result = _train(cfg)
    assert "step-6 is damaged" in caplog.text and result.summary["resumed_from_step"] == 3
    for k, v in _adapter(clean).items():
        torch.testing.assert_close(_adapter(run)[k], v, rtol=0, atol=0)
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_diverging_run_stops_at_the_step_and_keeps_the_good_checkpoint(tmp_path: Path, tiny_llama: Path,
                                                                       small_data: Path) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, max_steps=12, save_steps=1, lr=1e30, max_grad_norm=1e30)
    with pytest.raises(JobFailed, match=r"training diverged at step (\d+)") as err:
        _train(cfg)
    step = int(err.value.args[0].split("step ")[1].split(":")[0])
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").iterdir()
                   if p.name.startswith("step-"))
    assert saved and max(saved) == step - 1 and str(tmp_path / "run" / "checkpoints" / f"step-{step - 1}") in str(
        err.value)
    assert not (tmp_path / "run" / "summary.json").exists()
    assert all(json.loads(line).get("loss") is None or json.loads(line)["loss"] == json.loads(line)["loss"]
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())  # no NaN written


def test_a_divergence_seen_on_the_device_stops_at_the_next_read_naming_the_first_bad_step(
        tmp_path: Path, tiny_llama: Path, small_data: Path, monkeypatch) -> None:
    """As on a GPU: the norm is not read at every step; the run stops where the host reads the device (here the
    checkpoint of step 6), naming the step of the first bad norm, and no checkpoint after it is written."""
    keys = dict(max_steps=12, save_steps=6, log_steps=12, lr=1e30, max_grad_norm=1e30)
    with pytest.raises(JobFailed, match=r"training diverged at step (\d+)") as every_step:
        _train(_cfg(tmp_path, tiny_llama, small_data, "a.yaml", output_dir=str(tmp_path / "a"), **keys))
    monkeypatch.setattr(DivergenceStop, "for_device",
                        classmethod(lambda cls, opt, device: cls(opt, device, on_device=True)))
    with pytest.raises(JobFailed, match=r"training diverged at step (\d+)") as on_device:
        _train(_cfg(tmp_path, tiny_llama, small_data, "b.yaml", output_dir=str(tmp_path / "b"), **keys))
    step = every_step.value.args[0].split(":")[0]
    assert on_device.value.args[0].split(":")[0] == step and int(step.split()[-1]) < 6
    assert not (tmp_path / "b" / "checkpoints").exists() or not any((tmp_path / "b" / "checkpoints").iterdir())


def test_a_checkpoint_that_cannot_be_written_fails_the_job_with_what_survives(tmp_path: Path, tiny_llama: Path,
                                                                              small_data: Path, monkeypatch) -> None:
    real_save = ckpt_module.torch.save
    calls = {"n": 0}

    def full_disk(obj, path, *a, **k):  # the second checkpoint meets a full disk
        if str(path).endswith("trainer.pt"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt_module.torch, "save", full_disk)
    with pytest.raises(JobFailed, match="No space left on device") as err:
        _train(_cfg(tmp_path, tiny_llama, small_data, max_steps=9))
    assert "step-3" in str(err.value) and "is intact" in str(err.value)
    assert ckpt_module.intact(tmp_path / "run" / "checkpoints" / "step-3") is None


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def _wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the processes through /proc")
def test_second_training_into_one_directory_is_refused_and_a_killed_one_leaves_no_ranks(
        tmp_path: Path, tiny_llama: Path, small_data: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, "long.yaml", max_steps=100000, save_steps=100000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "shardfit", "train", str(cfg), "--nproc", "2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_for(tmp_path / "run" / "metrics.jsonl")
        # The second command's refusal comes before it launches anything: run in this process, as the CLI's main
        code, _, err = run_here(capsys, "train", str(cfg))
        assert code == 2 and "shardfit: error: " in err and "in use by another training" in err
        assert len(_processes_with(str(cfg))) >= 3  # shardfit, torchrun, two ranks
        first.send_signal(signal.SIGKILL)  # the outer command dies without a chance to clean up
        first.wait()
        deadline = time.time() + 60
        while _processes_with(str(cfg)) and time.time() < deadline:
            time.sleep(0.2)
        assert _processes_with(str(cfg)) == [], "torchrun or a rank kept training after shardfit was killed"
    finally:
        for pid in _processes_with(str(cfg)):
            os.kill(pid, signal.SIGKILL)
    # The killed run's lock is stale (its pid is gone): the next run takes it over and resumes nothing it
    # should not (same config: its own run).
    code, _, err = run_here(capsys, "train", str(cfg), "--set", "max_steps=2", "--set", "resume=never")
    assert code == 0, err[-2000:]
