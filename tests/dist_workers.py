"""Functions that run as gloo ranks spawned by a test (torch.multiprocessing). Kept apart from the test modules so
a spawned rank imports torch and the shardfit pieces it exercises, not transformers."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardfit.data.packing import PackedRow
from shardfit.data.tokenize import IGNORE
from shardfit.errors import UserError
from shardfit.parallel.agree import require_same
from shardfit.parallel.env import DistEnv
from shardfit.train.evaluate import evaluate


class CollectiveLoss(nn.Module):
    """A loss module that, like an FSDP unit, takes part in a collective at every forward: ranks that ran
    different numbers of forwards would wait for each other until the group's timeout."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))
        mask = targets != IGNORE
        return (input_ids.float() * mask).sum(), int(mask.sum())


def eval_rows(n: int) -> list[PackedRow]:
    return [PackedRow([i + 1, i + 2, i + 3][: 1 + i % 3], [i + 2, i + 3, IGNORE][: 1 + i % 3], [0, 1, 2][: 1 + i % 3])
            for i in range(n)]


def _join(rank: int, world: int, port: int) -> DistEnv:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    return DistEnv(rank, world, 0, torch.device("cpu"), "gloo")


def uneven_work_rank(rank: int, world: int, port: int, n_rows: int, micro_batch: int, out: str) -> None:
    """Two checks on one group. Agreement: the last rank has fewer training rows than the others (as with different
    data files per node) and every rank must refuse. Evaluation: `n_rows` rows on this rank's share, with a
    collective per forward; write the loss (identical on every rank) and the refusal."""
    env = _join(rank, world, port)
    try:
        try:
            require_same(env, {"train_rows": 60 if rank == world - 1 else 64, "steps": 8}, "the training work",
                         "Put the same data on every node.")
            said = None
        except UserError as e:
            said = str(e)
        loss = evaluate(CollectiveLoss(), eval_rows(n_rows), micro_batch, 0, env, contextlib.nullcontext())
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"loss": loss, "refused": said}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
