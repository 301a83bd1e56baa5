"""The launching process (`shardfit train --nproc N` before torchrun): torch-free, and the ranks' threads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.parallel import launch
from tests.helpers import ROOT, write_config

_LAUNCHER = """
import sys
import shardfit.parallel.launch as launch
def relaunch(cmd, env=None):
    print("torch imported:", "torch" in sys.modules, "command:", " ".join(cmd[1:5]))
    return 0
launch.relaunch = relaunch
from shardfit.cli.main import main
sys.argv = ["shardfit", "train", sys.argv[1], "--nproc", "2"]
main()
"""


def test_the_launching_process_never_imports_torch(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Only the ranks import torch: the process that starts torchrun reads the config and builds the command."""
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), output_dir=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _LAUNCHER, str(cfg)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch imported: False" in r.stdout and "torch.distributed.run --nproc-per-node=2" in r.stdout


def test_rank_threads_one_per_cpu_rank_more_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset by the user: one OpenMP thread per rank, raised to GPU_RANK_THREADS by a rank that has a GPU; a value
    the user set is never touched."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = launch.launch_env()
    assert env["OMP_NUM_THREADS"] == "1" and env[launch.OMP_DEFAULTED] == "1"
    monkeypatch.setenv(launch.OMP_DEFAULTED, "1")
    assert launch.gpu_rank_threads(cuda=True) == launch.GPU_RANK_THREADS
    assert launch.gpu_rank_threads(cuda=False) is None
    monkeypatch.delenv(launch.OMP_DEFAULTED)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.launch_env()["OMP_NUM_THREADS"] == "3" and launch.OMP_DEFAULTED not in launch.launch_env()
    assert launch.gpu_rank_threads(cuda=True) is None
