"""torchao's NF4 weights: making them (on a device or the meta device), recognising them, measuring them.
Shared by models/quantize.py (the decoder's linear layers) and models/quantize_experts.py (a mixture's fused expert
stacks), with exactly the block sizes plan/quant.py counts."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from shardfit.config.support import TORCHAO_HINT
from shardfit.errors import UserError
from shardfit.plan.quant import BLOCK, scaler_block_size


def torchao_available() -> bool:
    """torchao is installed (found, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("torchao") is not None


def _nf4() -> Any:
    """torchao's NF4 module, imported where it is used: an optional dependency (peft imports it too when it is
    installed; the CLI quiets what its import logs)."""
    if not torchao_available():
        raise UserError(f"'method: qlora' needs torchao for its 4-bit weights: {TORCHAO_HINT}.")
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def is_nf4(t: Any) -> bool:
    """`t` is a torchao NF4 weight (without importing torchao when no such weight can exist)."""
    return type(t).__name__ == "NF4Tensor" and type(t).__module__.startswith("torchao.")


def is_bnb_quantized(t: Any) -> bool:
    """`t` is a bitsandbytes 4/8-bit weight (packed storage with its quant_state beside it)."""
    return type(t).__name__ in ("Params4bit", "Int8Params") and type(t).__module__.startswith("bitsandbytes")


def _meta_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An NF4 weight on the meta device with the inner tensors `to_nf4` would make (no values, no memory): what
    `check` and `plan --simulate` build."""
    mod = _nf4()
    n = weight.numel()
    n_blocks, sbs = n // BLOCK, scaler_block_size(n)

    def empty(size: Any, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dt, device="meta")

    meta = mod.SubclassTensorArgs(weight.size(), weight.stride(), 0, dtype, weight.device, False)
    return mod.NF4Tensor(meta, BLOCK, n_blocks, sbs, empty(n_blocks, torch.int8), empty(n_blocks // sbs, dtype),
                         empty((), dtype), empty(n // 2, torch.uint8), empty(16, dtype))


def to_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` as an NF4 weight that dequantizes to `dtype` (meta in, meta out)."""
    if weight.is_meta:
        return _meta_nf4(weight, dtype)
    w = weight.detach().to(dtype).contiguous()
    return _nf4().to_nf4(w, block_size=BLOCK, scaler_block_size=scaler_block_size(w.numel()))


def nf4_storage_bytes(t: torch.Tensor) -> int:
    """Bytes an NF4 weight keeps (its inner tensors)."""
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
