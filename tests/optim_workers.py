"""Gloo ranks spawned by tests/test_fused_adamw.py: a tiny dense model under zero3 (FSDP2, DTensor shards) trained
a few steps with the fused AdamW and with the multi-tensor one, from the same start on the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from shardfit.parallel.parallelize import parallelize
from shardfit.strategy import get as strategy_of
from shardfit.train.diverge import DivergenceStop
from shardfit.train.loss import CausalLMLoss
from shardfit.train.optim import build_optimizer
from tests.families import tiny_text_config
from tests.helpers import gloo_group

STEPS = 4


def _run(rank: int, world: int, fused: bool, bad_step: int = 0) -> dict:
    """Losses of STEPS steps (the mean over the ranks' rows) and the optimizer's kernel; with `bad_step` (after
    STEPS), one more step whose gradients are made non-finite, whose update the stop on the device must skip."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_text_config("Qwen3 (dense)")).float()
    mesh = init_device_mesh("cpu", (world,))
    module = parallelize(CausalLMLoss(model, chunk=64), strategy_of("zero3"), device=torch.device("cpu"),
                         world=world, precision="fp32", mesh=mesh)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, 1e-3, 0.01, fused_shards=fused)
    stop = DivergenceStop(optimizer, torch.device("cpu"), on_device=True)
    vocab = model.config.vocab_size
    losses, kept = [], None
    for step in range(1, max(STEPS, bad_step) + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, vocab, (2, 32), generator=g)
        positions = torch.arange(32).expand(2, 32)
        loss, n = module(ids, positions, ids.roll(-1, 1), n_targets=64, restarts=False)
        (loss / n).backward()
        if step == bad_step:
            params[0].grad.mul_(float("nan"))
            kept = [p.detach().to_local().clone() for p in params]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        stop.observe(step, norm.full_tensor() if isinstance(norm, DTensor) else norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach() / n
        dist.all_reduce(total)
        losses.append(float(total) / world)
    out = {"losses": losses, "fused": bool(optimizer.defaults.get("fused")),
           "sharded": all(isinstance(p, DTensor) for p in params), "on_device": stop.on_device}
    if bad_step:
        diverged = stop.check()
        out["stopped_at"] = diverged.step if diverged else None
        out["losses"] = losses[:STEPS]
        out["unchanged"] = all(torch.equal(a, p.detach().to_local()) for a, p in zip(kept, params, strict=True))
    return out


def adamw_rank(rank: int, world: int, port: int, out: str) -> None:
    """`out`/rank-R.json: the fused run (diverging at one step after STEPS) and the multi-tensor run."""
    with gloo_group(rank, world, port):
        result = {"fused": _run(rank, world, True, bad_step=STEPS + 1), "foreach": _run(rank, world, False)}
        Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
