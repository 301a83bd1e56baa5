"""`compile: true`: torch.compile each decoder block, the way torchtitan and torchtune do it.

Blocks are compiled one by one (not the whole model) so the compiled region is the same code for every layer,
compiled once and reused, and so FSDP2 can still shard block by block around it. Inductor fuses the norms,
activations and autocast casts between the matmuls and, in backward, recomputes cheap elementwise results instead
of saving them, which is where the memory saving comes from. Shapes are kept static (rows padded to
`max_seq_len`) so a short last row never triggers a recompile.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from shardfit.errors import UserError
from shardfit.models.anatomy import transformer_blocks


def require_compiler(device: torch.device) -> None:
    """Inductor writes C++ for CPU kernels; without a compiler it would fail deep inside the first step."""
    if device.type != "cpu":
        return
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None and shutil.which("c++") is None:
        raise UserError(f"'compile: true' on CPU needs a C++ compiler for torch.compile's kernels and found none "
                        f"({cxx!r} is not on PATH). Install one (Debian/Ubuntu: apt install g++) or set "
                        "compile: false.")


def compile_blocks(model: nn.Module) -> None:
    """Compile every decoder block of `model` in place (call `require_compiler` first, before any slow work)."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise UserError(f"'compile: true' found no decoder blocks in {type(model).__name__}; set compile: false.")
    for block in blocks:
        block.compile(dynamic=False)
