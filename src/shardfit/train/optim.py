"""AdamW and the cosine schedule with linear warmup."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR


class MasterAdamW(torch.optim.AdamW):
    """AdamW that updates 16-bit parameters (`lora.dtype: bf16`) through fp32 master copies kept in its state
    (`master`, beside the fp32 moments): each step casts the gradient to fp32, runs torch's AdamW kernel on the
    master and rounds the result into the parameter. A bf16 weight updated in place would lose every change below
    2^-8 of its size: lr 2e-4 moves a weight by about 2e-4 of itself, which rounds away. The masters are in the
    state dict, so a checkpoint resumes them exactly; fp32 parameters are updated as plain AdamW does."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype == torch.float32:
                    continue
                # Stored after the first update: AdamW creates its moments while a parameter's state is empty.
                master = self.state[p].get("master")
                master = p.detach().float() if master is None else master.float()  # fp32 whatever was loaded
                # The parameter stands for its master during the update (the moments are created in its dtype).
                low, grad = p.data, p.grad
                p.grad = None
                p.data = master
                p.grad = grad.float()
                swapped.append((p, low, grad))
        try:
            return super().step(closure)
        finally:
            for p, low, grad in swapped:
                master = p.data
                self.state[p]["master"] = master
                p.grad = None
                p.data = low
                low.copy_(master)
                p.grad = grad

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts every floating state to its parameter's dtype, then the fp32 states (masters
        and moments) put back as saved."""
        exact = {i: {k: v for k, v in s.items() if torch.is_tensor(v) and v.is_floating_point() and k != "step"}
                 for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        own = chain.from_iterable(g["params"] for g in self.param_groups)
        for i, p in zip(saved, own, strict=True):
            for k, v in exact.get(i, {}).items():
                self.state[p][k] = v.to(device=p.device, dtype=torch.float32)


def build_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float, fused_shards: bool = True,
                    masters: bool = True, fused_plain: bool = True) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with the fused kernel: one pass over each parameter's weight, gradient
    and moments, no multi-tensor temporaries, and `found_inf` to skip an update on the device (train/diverge.py).
    FSDP2's DTensor shards take it too (torch 2.13 runs `_fused_adamw_` on their local shards, tested against the
    unfused update on 2 ranks); `fused_shards=False` gives them the multi-tensor (foreach) kernel instead, what
    torch picks by default and other tools run (the planner's `fused_adamw`; plan --simulate builds either), and
    `fused_plain=False` gives plain tensors that kernel too (the HF Trainer's `adamw_torch` on one GPU or DDP).
    A torch or a device without the fused kernel falls back to torch's default. 16-bit parameters (bf16 adapters)
    are updated through fp32 masters (`MasterAdamW`); `masters=False` keeps their states in 16 bits, as stacks
    without masters ran (peft < 0.12's 16-bit adapters, which plan --simulate measures)."""
    plain = all(not isinstance(p, DTensor) for p in params)
    sharded = [p for p in params if isinstance(p, DTensor)]
    # Expert parallelism under FSDP2 keeps the experts plain beside the shards: a group each, since one fused or
    # foreach kernel cannot take both kinds.
    groups: list[Any] = params if plain or len(sharded) == len(params) else [
        {"params": sharded}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
    fused = fused_plain if plain else fused_shards
    adamw = MasterAdamW if masters and any(p.dtype != torch.float32 for p in params) else torch.optim.AdamW
    try:
        return adamw(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, fused=fused,
                     foreach=not fused)
    except RuntimeError:
        return adamw(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                       min_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup to the peak lr over `warmup_steps`, then cosine decay to `min_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
