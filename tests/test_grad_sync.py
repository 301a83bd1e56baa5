"""Gradient communication across the micro-batches of one optimizer step, on 2 gloo ranks of the real engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests import dist_workers
from tests.helpers import free_port


def _grads(tmp_path: Path, strategy: str) -> list[dict]:
    mp.start_processes(dist_workers.grad_sync_rank, args=(2, free_port(), strategy, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", ["zero3", pytest.param("zero2", marks=pytest.mark.heavy)])
def test_sharded_strategies_reduce_scatter_every_micro_batch(tmp_path: Path, strategy: str) -> None:
    """Before the optimizer step's micro-batch, FSDP2 has already reduce-scattered: every rank holds a gradient
    shard of every parameter, and no unsharded gradient waits on the side (what the plan's memory counts)."""
    for grads in _grads(tmp_path, strategy):
        assert grads and all(g is not None for g in grads.values()), grads


@pytest.mark.heavy  # the strategy matrix holds DDP's result; this holds its communication pattern
def test_ddp_skips_the_all_reduce_until_the_last_micro_batch(tmp_path: Path) -> None:
    """DDP keeps each rank's own gradient (no all-reduce) until the step's last micro-batch: the ranks, fed
    different data, hold different gradients."""
    a, b = _grads(tmp_path, "ddp")
    assert a.keys() == b.keys() and all(a[k] is not None for k in a)
    assert any(a[k] != b[k] for k in a)
