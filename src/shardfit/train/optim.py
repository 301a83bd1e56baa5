"""AdamW and the cosine schedule with linear warmup."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                    fused_shards: bool = True) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with the fused kernel: one pass over each parameter's weight, gradient
    and moments, no multi-tensor temporaries, and `found_inf` to skip an update on the device (train/diverge.py).
    FSDP2's DTensor shards take it too (torch 2.13 runs `_fused_adamw_` on their local shards, tested against the
    unfused update on 2 ranks); `fused_shards=False` gives them the multi-tensor (foreach) kernel instead, what
    torch picks by default and other tools run (the planner's `fused_adamw`; plan --simulate builds either).
    A torch or a device without the fused kernel falls back to torch's default."""
    plain = all(not isinstance(p, DTensor) for p in params)
    sharded = [p for p in params if isinstance(p, DTensor)]
    # Expert parallelism under FSDP2 keeps the experts plain beside the shards: a group each, since one fused or
    # foreach kernel cannot take both kinds.
    groups: list[Any] = params if plain or len(sharded) == len(params) else [
        {"params": sharded}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
    fused = plain or fused_shards
    try:
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8,
                                 fused=fused, foreach=not fused)
    except RuntimeError:
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                       min_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup to the peak lr over `warmup_steps`, then cosine decay to `min_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
