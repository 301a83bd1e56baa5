"""What the installed torch can run, for the decisions and the planner that depend on it. Torch-free: `plan` and
`diagnose` start without importing torch (tests/test_architecture.py), so the answers come from torch's installed
version, not from torch itself."""

from __future__ import annotations

import functools
import importlib.util
import re
from importlib import metadata

# The first release known here to have aten::addmm.dtype_out (16-bit operands into an fp32 result): the pinned one.
# Earlier releases are counted as without it, so the plan errs on the slow side for them.
WIDENING_MATMUL_SINCE = (2, 13)


def _torch_version() -> tuple[int, int] | None:
    try:
        found = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None
    return (int(found[1]), int(found[2])) if found else None


@functools.cache
def widening_matmul_in_torch() -> bool:
    """Whether this torch has `addmm` into a wider result dtype (aten::addmm.dtype_out: 16-bit operands, fp32
    result, accumulated in place), the kernel the loss's head gradient uses on CUDA (train/loss.py
    `widening_matmul` tries it on the device)."""
    version = _torch_version()
    return version is not None and version >= WIDENING_MATMUL_SINCE


# The first flash-linear-attention transformers calls (transformers' is_flash_linear_attention_available).
FLA_SINCE = (0, 2, 2)


@functools.cache
def delta_rule_kernel() -> str:
    """Which Gated DeltaNet kernel transformers runs here on a GPU (Qwen3.5's and Qwen3-Next's linear-attention
    blocks): `fla` where flash-linear-attention (the `fla` package, 0.2.2 or later) is installed, its fused
    chunk_gated_delta_rule; else `torch`, transformers' torch_chunk_gated_delta_rule, a Python loop over the
    sequence's chunks. Read as transformers reads it (the package and its version), without importing torch."""
    if importlib.util.find_spec("fla") is None:
        return "torch"
    try:
        found = re.match(r"(\d+)\.(\d+)\.(\d+)", metadata.version("flash-linear-attention"))
    except metadata.PackageNotFoundError:
        return "fla"  # a source checkout without package metadata
    return "fla" if found is None or tuple(int(x) for x in found.groups()) >= FLA_SINCE else "torch"


@functools.cache
def mamba_kernel() -> str:
    """Which Mamba-2 scan transformers runs here in training (Nemotron-H's mixer): `mamba_ssm`, its fused
    mamba_split_conv1d_scan_combined, where transformers would call it; else `torch`, transformers' reference
    chunked scan in PyTorch. transformers imports mamba_ssm's ops.triton.ssd_combined and falls back to the torch
    scan on any error (a build for another torch or CUDA, a host without CUDA), and the fused kernel's convolution
    needs causal_conv1d, so both packages must be installed and the import must succeed. The import (which loads
    torch) happens only where both are installed; elsewhere the answer costs two spec look-ups."""
    if importlib.util.find_spec("mamba_ssm") is None or importlib.util.find_spec("causal_conv1d") is None:
        return "torch"
    try:
        module = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except Exception:  # transformers' fallback catches every import error the same way
        return "torch"
    return "mamba_ssm" if callable(getattr(module, "mamba_split_conv1d_scan_combined", None)) else "torch"
