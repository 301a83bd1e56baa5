"""A sum over a process group that autograd follows: each rank gets the group's total, and in backward each
rank's piece gets the total of every rank's gradient of it (every rank's loss read the total). What makes a
statistic of the whole batch out of the pieces the ranks of a sequence-parallel group hold (train/loss.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def group_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` summed over `group` (every rank calls it, and runs its backward where `x` needs a gradient)."""
    if x.requires_grad:
        return _GroupSum.apply(x, group)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out
