"""What the installed torch can run, for the decisions and the planner that depend on it (no device needed)."""

from __future__ import annotations

import functools


@functools.cache
def widening_matmul_in_torch() -> bool:
    """Whether this torch has `addmm` into a wider result dtype (aten::addmm.dtype_out: 16-bit operands, fp32
    result, accumulated in place), the kernel the loss's head gradient uses on CUDA (train/loss.py
    `widening_matmul` tries it on the device). torch releases before the overload have no such op."""
    import torch

    return "dtype_out" in torch.ops.aten.addmm.overloads()
