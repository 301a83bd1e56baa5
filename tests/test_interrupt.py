"""Ctrl-C during `shardfit train`: exit 130 with the checkpoint that survives (or that none does) and the exact
command that continues, which does continue."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardfit.train.interrupt import interrupted_message
from tests.helpers import run_cli, write_config


def _wait_for(path: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_ctrl_c_names_the_surviving_checkpoint_and_the_command_that_resumes(tmp_path: Path, tiny_llama: Path,
                                                                           small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=128, micro_batch=2, max_steps=6, save_steps=2, eval_steps=100,
                       report_to=["none"], output_dir=str(tmp_path / "run"))
    # Step 4 stalls (the test-only fault switch), so Ctrl-C lands after step 2's checkpoint and before step 4's.
    env = {**os.environ, "SHARDFIT_TEST_FAULT": "stall:rank=0:step=4:seconds=120"}
    # As from a terminal: Ctrl-C's default disposition. Something earlier in a pytest process can leave SIGINT
    # ignored, which a child inherits, and Python then never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "train", str(cfg), "--set", "lr=2e-3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(tmp_path / "run" / "checkpoints" / "step-2" / "trainer.pt")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "unexpected" not in err, err[-2000:]
    line = err[err.index("shardfit: interrupted"):]
    assert f"The checkpoint of step 2 survives ({tmp_path / 'run' / 'checkpoints' / 'step-2'})" in line, line
    command = line.split("with: ", 1)[1].strip()
    assert command == f"shardfit train {cfg} --set lr=2e-3", command

    r = run_cli(*shlex.split(command)[1:], timeout=300)  # the printed command, as the user would paste it
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stderr and "(step 2)" in r.stderr, r.stderr[-2000:]


def test_what_is_said_when_no_checkpoint_survives(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step-5").mkdir(parents=True)  # a save cut short by the Ctrl-C itself
    text = interrupted_message(run, "auto", ["shardfit", "train", "my job.yaml"])
    assert text.startswith("No checkpoint of this run survives") and "step-5 was cut short" in text, text
    assert text.endswith("Start again with: shardfit train 'my job.yaml'"), text
