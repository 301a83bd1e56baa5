"""Functions that run as gloo ranks spawned by a test (torch.multiprocessing). Kept apart from the test modules so
a spawned rank imports torch and the shardfit pieces it exercises, not transformers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardfit.data.packing import PackedRow
from shardfit.data.tokenize import IGNORE
from shardfit.errors import UserError
from shardfit.parallel.agree import require_same
from shardfit.parallel.env import DistEnv
from shardfit.parallel.parallelize import micro_batch_sync, parallelize
from shardfit.strategy import get as strategy_of
from shardfit.train.evaluate import evaluate
from tests.helpers import gloo_group


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


@contextlib.contextmanager
def _rank(rank: int, world: int, port: int) -> Iterator[DistEnv]:
    with gloo_group(rank, world, port, timeout_s=20):
        yield DistEnv(rank, world, 0, torch.device("cpu"), "gloo")


def uneven_work_rank(rank: int, world: int, port: int, n_rows: int, micro_batch: int, out: str) -> None:
    """Two checks on one group. Agreement: the last rank has fewer training rows than the others (as with different
    data files per node) and every rank must refuse. Evaluation: `n_rows` rows on this rank's share, with a
    collective per forward; write the loss (identical on every rank) and the refusal."""
    with _rank(rank, world, port) as env:
        try:
            require_same(env, {"train_rows": 60 if rank == world - 1 else 64, "steps": 8}, "the training work",
                         "Put the same data on every node.")
            said = None
        except UserError as e:
            said = str(e)
        loss = evaluate(CollectiveLoss(), eval_rows(n_rows), micro_batch, 0, env, contextlib.nullcontext())
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"loss": loss, "refused": said}))


class TinyLM(nn.Module):
    """A causal LM in the shape shardfit shards: a decoder with two blocks, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def get_decoder(self) -> nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class TinyLoss(nn.Module):
    """A loss module holding its model as `.model`, as parallelize expects."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).float().pow(2).sum()


def grad_sync_rank(rank: int, world: int, port: int, strategy: str, out: str) -> None:
    """One micro-batch that is not the optimizer step's, under `strategy` in bf16, on data that differs by rank;
    write each trainable parameter's local gradient after its backward (None where the rank holds none)."""
    with _rank(rank, world, port) as env:
        torch.manual_seed(0)
        module = parallelize(TinyLoss(), strategy_of(strategy), device=env.device, world=world, precision="bf16")
        with micro_batch_sync(module, False):
            module(torch.full((3, 8), float(rank + 1))).backward()
        grads = {}
        for name, p in module.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "to_local"):
                g = g.to_local()
            grads[name] = None if g is None else g.float().flatten().tolist()
        Path(out, f"rank-{rank}.json").write_text(json.dumps(grads))
