"""The launching process (`shardfit train --nproc N` before torchrun): it resolves the job once and hands it to the
ranks, and the ranks' threads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.parallel import launch, threads
from tests.helpers import ROOT, write_config

_LAUNCHER = """
import json
import sys
import shardfit.parallel.launch as launch
def relaunch(cmd, env=None):
    job = json.loads(env["SHARDFIT_RESOLVED"])
    print("job:", job["strategy"], job["nproc_per_node"], "command:", " ".join(cmd[1:5]))
    return 0
launch.relaunch = relaunch
from shardfit.cli.main import main
sys.argv = ["shardfit", "train", sys.argv[1], "--nproc", "2"]
main()
"""


def test_the_launching_process_hands_the_resolved_job_to_the_ranks(tmp_path: Path, tiny_llama: Path,
                                                                   small_data: Path) -> None:
    """The process that starts torchrun resolves the job (it looks at the devices: that needs torch) and the ranks
    receive it in their environment instead of deciding again."""
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), output_dir=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _LAUNCHER, str(cfg)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"job: (ddp|zero2|zero3) 2 ", r.stdout), r.stdout  # auto on 2 ranks: a multi-rank strategy
    assert "torch.distributed.run --nproc-per-node=2" in r.stdout


def test_ranks_share_the_cores_and_the_users_threads_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset by the user: each rank gets its share of the usable cores (marked as shardfit's choice, so the rank
    may read why); this process's own single-process choice is replaced; a value the user set is never touched."""
    monkeypatch.setattr(threads, "cpu_budget", lambda: threads.CpuBudget(8, None, 0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = launch.launch_env(nproc=2)
    assert env["OMP_NUM_THREADS"] == "4" and env[threads.OMP_DEFAULTED] == "1"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "2 ranks on the node" in env[threads.OMP_REASON]
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # chosen for one process by this one
    monkeypatch.setenv(threads.OMP_DEFAULTED, "1")
    assert launch.launch_env(nproc=8)["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv(threads.OMP_DEFAULTED)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = launch.launch_env(nproc=2)
    assert env["OMP_NUM_THREADS"] == "3" and threads.OMP_DEFAULTED not in env
