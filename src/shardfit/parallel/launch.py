"""Re-execute `shardfit train` under torchrun (torch.distributed.run): PyTorch's own launcher, never ours.

Torch-free unless the GPU count is needed: the process that only starts torchrun would otherwise spend a second
importing torch before the ranks, which import it again, even begin.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from shardfit.parallel import threads


def under_launcher() -> bool:
    """True when torchrun (or another launcher) started this process as one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """All visible GPUs; one process on a CPU-only machine unless asked."""
    import torch

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


def _die_with_parent() -> None:
    """In the child, before exec: its own process group (a terminal's Ctrl-C reaches shardfit, which passes it on
    once), and on Linux a SIGTERM when shardfit dies, even by SIGKILL, so torchrun stops its ranks instead of
    training on without anyone watching."""
    os.setpgid(0, 0)
    # Without prctl (not Linux, no libc.so.6) the forwarded signals still cover Ctrl-C and kill.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def launch_env(extra: dict[str, str] | None = None, nproc: int = 1) -> dict[str, str]:
    """The environment the ranks start with: this one, with each rank's share of the cores as its OpenMP threads
    (parallel/threads.py; the user's OMP_NUM_THREADS is kept), and `extra`."""
    choice, env = rank_threads(nproc)
    env = threads.child_env(choice, env)
    env.update(extra or {})
    return env


def rank_threads(nproc: int) -> tuple[threads.ThreadChoice, dict[str, str]]:
    """The threads each of `nproc` ranks on this node starts with, and the environment that choice was made in
    (this process's own choice, made for one process, left out)."""
    env = dict(os.environ)
    if env.get(threads.OMP_DEFAULTED) == "1":
        env.pop("OMP_NUM_THREADS", None)
        env.pop(threads.OMP_DEFAULTED)
    return threads.choose(threads.cpu_budget(), nproc, env), env


def launch_threads(nproc: int | None, nnodes: int) -> int | None:
    """The threads each rank of a launch of `nproc` ranks a node on `nnodes` nodes runs (what a CPU's matmul rate
    is measured at for the plan: `train` before it launches, `check` for the same flags), or None for a job that
    runs in this process with its own."""
    if (nproc or 1) * nnodes <= 1:
        return None
    return rank_threads(nproc or 1)[0].threads


def relaunch(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun and return its exit code. SIGINT, SIGTERM and SIGHUP sent to shardfit are passed on to
    torchrun, which stops its ranks; if shardfit itself is killed, the kernel stops torchrun (PDEATHSIG)."""
    child = subprocess.Popen(cmd, env=env,
                             preexec_fn=_die_with_parent if os.name == "posix" else None)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
