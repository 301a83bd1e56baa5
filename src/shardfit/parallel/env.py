"""The distributed environment of this process, read from what torchrun sets (or a single process)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def under_launcher() -> bool:
    """True when torchrun (or another launcher) started this process as one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(timeout_s: int = 1800) -> DistEnv:
    """Join the process group torchrun prepared: nccl on GPUs, gloo on CPU; a plain process gets world 1."""
    if not under_launcher() or int(os.environ["WORLD_SIZE"]) == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return DistEnv(0, 1, 0, device, None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                **_restart_safe_store(rank, world, timeout))
    return DistEnv(rank, world, local_rank, device, backend)


def _restart_safe_store(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun the ranks share the agent's TCPStore, and it outlives a restart (`--max-restarts`). The
    group's address keys of the killed attempt are still in it, and a new rank that reads one before its peer
    has overwritten it connects to a dead process and waits out the whole timeout (gloo's full-mesh connect).
    Giving every attempt its own key prefix makes a restarted group start from an empty namespace."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # rank 0 hosts a fresh store per attempt: nothing stale to read
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"shardfit/attempt-{attempt}", store), "rank": rank, "world_size": world}


def barrier(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.barrier()


def shutdown(env: DistEnv, ok: bool = True) -> None:
    """Leave the group: after success with a barrier first (FSDP2 otherwise sometimes aborts at exit); after a
    failure without one, so this rank exits and torchrun stops the others instead of all waiting forever."""
    if env.distributed and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
