"""Ranks must agree on how much work there is before the first collective: a rank that runs out of data (or of
evaluation batches) earlier than the others leaves them waiting in a collective until the timeout."""

from __future__ import annotations

import socket
from collections import defaultdict
from typing import Any

import torch.distributed as dist

from shardfit.errors import UserError
from shardfit.parallel.env import DistEnv
from shardfit.parallel.ranks import ranks_phrase


def require_same(env: DistEnv, values: dict[str, Any], what: str, fix: str) -> None:
    """Every rank passes its `values`; a UserError on every rank, naming the ranks and hosts that differ, when
    they are not all equal. Collective: every rank calls it at the same point."""
    if not env.distributed:
        return
    mine = (socket.gethostname(), sorted(values.items()))
    everyone: list[Any] = [None] * env.world
    dist.all_gather_object(everyone, mine)
    groups: dict[str, list[int]] = defaultdict(list)
    hosts: dict[str, set[str]] = defaultdict(set)
    for rank, (host, items) in enumerate(everyone):
        key = ", ".join(f"{k}={v}" for k, v in items)
        groups[key].append(rank)
        hosts[key].add(host)
    if len(groups) < 2:
        return
    detail = "; ".join(f"{ranks_phrase(rs)} on {', '.join(sorted(hosts[k]))}: {k}" for k, rs in groups.items())
    raise UserError(f"the ranks disagree on {what} ({detail}); they would run out of work at different steps and "
                    f"the others would wait in a collective until the timeout. {fix}")
