"""Re-execute `shardfit train` under torchrun (torch.distributed.run): PyTorch's own launcher, never ours."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import torch


def default_nproc() -> int:
    """All visible GPUs; one process on a CPU-only machine unless asked."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_command(args: Sequence[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int | None = None,
                     rdzv_endpoint: str | None = None, max_restarts: int = 0,
                     rdzv_timeout_s: int | None = None) -> list[str]:
    """The torchrun command line that runs `shardfit <args>` on `nproc` ranks per node. `rdzv_timeout_s` bounds
    the wait for the other nodes (torchrun's defaults: 600 s static, 600 s c10d)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and master_addr is None and rdzv_endpoint is None:
        cmd.append("--standalone")  # a free local port and a c10d rendezvous: nothing to configure on one node
        conf = "join_timeout"
    elif rdzv_endpoint is not None:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        conf = "join_timeout"
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr or '127.0.0.1'}",
                f"--master-port={master_port or 29500}"]
        conf = "timeout"  # the static rendezvous's TCPStore wait
    if rdzv_timeout_s is not None:
        cmd.append(f"--rdzv-conf={conf}={int(rdzv_timeout_s)}")
    return cmd + ["-m", "shardfit", *args]


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the ranks start with: this one, one OpenMP thread per CPU rank unless set, and `extra`."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1" if not torch.cuda.is_available() else env.get("OMP_NUM_THREADS", "4"))
    env.update(extra or {})
    return env


def relaunch(cmd: list[str]) -> int:
    """Run torchrun and return its exit code (Ctrl-C is passed on to the ranks by torchrun itself)."""
    return subprocess.call(cmd, env=launch_env())
