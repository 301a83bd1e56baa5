"""Whether every rank sees the same directory: rank 0 writes a marker, every rank looks for it."""

from __future__ import annotations

import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from shardfit.parallel.env import DistEnv, barrier


def ranks_seeing(directory: Path, env: DistEnv) -> list[bool]:
    """For each rank in order, whether it sees the marker file rank 0 created in `directory` (created if missing).
    Collective: every rank calls it. On one process the answer is [True]."""
    directory = Path(directory)
    if not env.distributed:
        return [True]
    token = [f".shared-{uuid.uuid4().hex}" if env.is_main else None]
    dist.broadcast_object_list(token)
    marker = directory / str(token[0])
    if env.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        marker.touch()
    barrier(env)
    # On the rank's own device: a process group of nccl alone has no backend for CPU tensors.
    seen = torch.tensor([1 if marker.exists() else 0], device=env.device)
    out = [torch.zeros_like(seen) for _ in range(env.world)]
    dist.all_gather(out, seen)
    barrier(env)
    if env.is_main:
        marker.unlink()
    return [bool(int(t.item())) for t in out]
