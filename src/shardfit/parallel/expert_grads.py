"""The experts' gradients under expert parallelism: the strategy (DDP) averages every other parameter over all data
ranks and is told to leave the experts alone; `sync_expert_grads` divides theirs by the world (the loss is
normalised for an average) and sums them over the ranks holding the same share. `clip_grad_norm` counts every
expert once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardfit.parallel.experts import ExpertShard


def sync_expert_grads(shard: ExpertShard) -> None:
    """Expert gradients as one process's: the step's loss is scaled for DDP's average over the world, which these
    skip, and the ranks holding the same share (other expert groups) each saw their own rows."""
    grads = [p.grad for p in shard.params() if p.grad is not None]
    for g in grads:
        g.div_(shard.world)
        if shard.rep_group is not None:
            dist.all_reduce(g, group=shard.rep_group)


def clip_grad_norm(params: list[nn.Parameter], shard: ExpertShard, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over the whole model: the replicated parameters' norm on this rank, the experts'
    summed over the expert group (each share counted once)."""
    mine = {id(p) for p in shard.params()}
    with_grad = [p for p in params if p.grad is not None]
    own = torch.zeros((), dtype=torch.float32, device=with_grad[0].grad.device if with_grad else None)
    expert = own.clone()
    for p in with_grad:
        nrm = torch.linalg.vector_norm(p.grad.detach().float())
        if hasattr(nrm, "full_tensor"):  # an FSDP2 shard's: the norm over every rank's shard
            nrm = nrm.full_tensor()
        if id(p) in mine:
            expert = expert + nrm.square()
        else:
            own = own + nrm.square()
    if shard.group is not None:
        dist.all_reduce(expert, group=shard.group)
    total = (own + expert).sqrt()
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for p in with_grad:
        p.grad.mul_(coef)
    return total


def _clip_16bit(params: list[nn.Parameter], grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for 16-bit gradients (`lora.dtype: bf16`), their norm taken in fp32: torch's would round
    each tensor's norm, and so the clipping factor and the logged norm, to bf16's 3 significant digits."""
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def step_grad_norm(params: list[nn.Parameter], shard: ExpertShard | None, max_norm: float) -> torch.Tensor:
    """The optimizer step's gradient clipping (after the last backward), with the experts' gradients made whole
    first where they are shared."""
    if shard is None:
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.dtype != torch.float32 for g in grads):
            return _clip_16bit(params, grads, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    sync_expert_grads(shard)
    return clip_grad_norm(params, shard, max_norm)
