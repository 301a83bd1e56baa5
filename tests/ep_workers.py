"""Gloo ranks spawned by tests/test_expert_parallel.py: a tiny mixture's forward and backward with its experts
shared over the ranks, against the whole model in every rank."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from shardfit.models.experts import use_experts
from shardfit.parallel.expert_dispatch import dispatch_combine
from shardfit.parallel.expert_grads import sync_expert_grads
from shardfit.parallel.experts import gather_experts, shard_experts
from tests.families import tiny_text_config
from tests.helpers import gloo_group


def block_rank(rank: int, world: int, port: int, families: list[str], out: str) -> None:
    """Each family once: `out`/rank-R.json gets this rank's largest errors (logits, expert and other gradients)."""
    with gloo_group(rank, world, port):
        results = {family: _case(rank, world, family) for family in families}
        results["empty"] = _no_rows_for_a_rank(rank, world)
        Path(out, f"rank-{rank}.json").write_text(json.dumps(results))


def _case(rank: int, world: int, family: str) -> dict:
    """Rank r forwards its own rows through the shared experts; the whole model forwards every rank's rows. The
    sum of the ranks' losses has the whole model's gradients: the others' after an all-reduce, the experts' on the
    rank holding them after `sync_expert_grads` (which divides by the world: multiplied back here)."""
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(tiny_text_config(family)).float()
    use_experts(whole, "eager")
    ids = torch.randint(0, 1000, (world, 2, 10), generator=torch.Generator().manual_seed(1))
    ref = torch.stack([whole(ids[r]).logits for r in range(world)])
    ref.square().mean(dim=(1, 2, 3)).sum().backward()
    model = copy.deepcopy(whole)
    model.zero_grad()
    shard = shard_experts(model, world, rank, dist.group.WORLD, world)
    got = model(ids[rank]).logits
    got.square().mean().backward()
    sync_expert_grads(shard)
    expert_ids = {id(p) for p in shard.params()}
    errors = {"logits": (got - ref[rank]).abs().max().item(), "scale": ref.abs().max().item()}
    other, expert = 0.0, 0.0
    lo, n = rank * shard.total // world, shard.local
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        if p.grad is None:
            continue
        if id(p) in expert_ids:
            expert = max(expert, (p.grad * world - q.grad[lo:lo + n]).abs().max().item())
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            other = max(other, (g - q.grad).abs().max().item())
    gather_experts(shard)
    same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), whole.state_dict().values(),
                                                strict=True))
    return {**errors, "expert_grad": expert, "other_grad": other, "gathered_equal": same,
            "grad_scale": max(q.grad.abs().max().item() for q in whole.parameters() if q.grad is not None)}


def _no_rows_for_a_rank(rank: int, world: int) -> dict:
    """Every token of every rank routed to rank 0's experts: rank 1 computes nothing (an eager-like computation
    returning fresh zeros), and backward still completes on both ranks (no all-to-all left waiting)."""
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    index = torch.tensor([[0, 1], [1, 0], [0, 1]])
    weights = torch.full((3, 2), 0.5, requires_grad=True)

    def compute(rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return rows * 2.0 if len(rows) else torch.zeros_like(rows)

    out = dispatch_combine(hidden, index, weights, 2, dist.group.WORLD, world, compute)
    out.sum().backward()
    return {"out": (out - 2.0 * hidden).abs().max().item(), "grad": (hidden.grad - 2.0).abs().max().item()}
