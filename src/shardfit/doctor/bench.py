"""Timed all_reduce and all_gather at a few sizes: over all ranks, within a host, across hosts.

Each link class is timed on its own subgroup while the other ranks wait, so a slow cross-host link is not hidden
in the all-ranks number. Every rank calls `new_group` for every subgroup (torch requires it) in the same order.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardfit.doctor.facts import RankFacts
from shardfit.doctor.report import Timing
from shardfit.doctor.rules import hosts_of

MAX_HOSTS = 8  # per link class; beyond that the numbers repeat and the groups cost time
DEFAULT_SIZES = {"gloo": [64 * 2**10, 2**20, 16 * 2**20], "nccl": [2**20, 64 * 2**20, 256 * 2**20]}


def link_groups(facts: list[RankFacts]) -> list[tuple[str, list[int]]]:
    """(link class, ranks) to time: all ranks; the first two ranks of each host; rank 0 with the first rank of
    each other host. Pairs equal to the all-ranks group are not repeated."""
    everyone = sorted(f.rank for f in facts)
    out: list[tuple[str, list[int]]] = [("all ranks", everyone)] if len(everyone) > 1 else []
    hosts = list(hosts_of(facts).values())
    for ranks in hosts[:MAX_HOSTS]:
        if len(ranks) > 1:
            out.append(("same host", [ranks[0].rank, ranks[1].rank]))
    for ranks in hosts[1:MAX_HOSTS + 1]:
        out.append(("cross host", [hosts[0][0].rank, ranks[0].rank]))
    seen, unique = set(), []
    for link, ranks in out:
        if tuple(ranks) in seen:
            continue
        seen.add(tuple(ranks))
        unique.append((link, ranks))
    return unique


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(op: str, size: int, group: dist.ProcessGroup, n: int, iters: int, device: torch.device) -> float:
    """Median seconds of `op` on `size` bytes of fp32, the slowest member's median."""
    numel = -(-size // 4 // n) * n  # whole fp32 elements, divisible by n: at least `size` bytes
    if op == "all_reduce":
        x = torch.ones(numel, device=device)

        def once() -> None:
            dist.all_reduce(x, group=group)
    else:
        part, whole = torch.ones(numel // n, device=device), torch.empty(numel, device=device)

        def once() -> None:
            dist.all_gather_into_tensor(whole, part, group=group)

    once()  # warm-up: connections and buffers are set up on first use
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def run(facts: list[RankFacts], rank: int, sizes: list[int], iters: int, backend: str,
        device: torch.device) -> list[Timing]:
    """Time every link group; returns the rows this rank measured as its group's first member."""
    by_rank = {f.rank: f for f in facts}
    out = []
    for link, members in link_groups(facts):
        group = dist.new_group(members, backend=backend)
        if rank in members:
            n = len(members)
            for op in ("all_reduce", "all_gather"):
                for size in sizes:
                    s = _time_op(op, size, group, n, iters, device)
                    real = -(-size // 4 // n) * n * 4
                    algbw = real / s / 1e9
                    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
                    if rank == members[0]:
                        out.append(Timing(op, link, members, [by_rank[r].host for r in members], backend, size,
                                          round(s, 6), round(algbw, 4), round(algbw * factor, 4)))
        dist.barrier()  # one link at a time: the next group's traffic must not overlap this one's
    return out
