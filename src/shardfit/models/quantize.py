"""QLoRA's frozen base: every linear layer of the decoder blocks stored as a 4-bit NF4 weight (torchao's
NF4Tensor, double-quantized block scales), dequantized one layer at a time for its matmul in forward and backward.

torchao's NF4Tensor is a tensor subclass that FSDP2 shards and all-gathers as packed 4-bit storage (its
fsdp_pre/post_all_gather hooks), so the same model runs on one process, under DDP and sharded by zero3; peft wraps
its layers as plain `nn.Linear`, so the saved adapter is a standard one for the unquantized base. Embeddings,
norms and the output head stay in the compute dtype (as the QLoRA recipe leaves them).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from torch import nn

from shardfit.config.support import TORCHAO_HINT
from shardfit.errors import UserError
from shardfit.models.anatomy import transformer_blocks
from shardfit.models.experts import moe_parts
from shardfit.plan.quant import BLOCK, quantizable, scaler_block_size

log = logging.getLogger(__name__)

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


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer whose weight is stored in NF4."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_nf4(m.weight)]


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


@torch.no_grad()
def quantize_blocks(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the weight of every linear layer inside the decoder blocks (routers aside) in NF4 (dequantizing to
    `dtype`), one layer at a time, each 16-bit weight released as its 4-bit one replaces it; returns how many were
    quantized. A weight that is not a whole number of 64-element blocks stays as it is."""
    done = 0
    # A router that is a linear layer (Llama 4's) stays as it is: in 4 bits it would send tokens elsewhere.
    routers = {id(model.get_submodule(r)) for r in moe_parts(model).routers}
    for block in transformer_blocks(model):
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear) or is_nf4(module.weight) or id(module) in routers:
                continue
            if is_bnb_quantized(module.weight) or not module.weight.is_floating_point():
                raise UserError(f"'method: qlora': {name} is already quantized ({type(module.weight).__name__}, "
                                f"{module.weight.dtype}); point 'model' at the unquantized base checkpoint, which "
                                "shardfit stores in 4 bits itself.")
            rows, cols = module.weight.shape
            if not quantizable(rows, cols):
                log.info("%s: %dx%d weight is not whole 64-element blocks; kept in %s", name, rows, cols,
                         module.weight.dtype)
                continue
            module.weight = nn.Parameter(to_nf4(module.weight, dtype), requires_grad=False)
            done += 1
    if done == 0:
        raise UserError("'method: qlora': the model's decoder blocks have no linear layer to store in 4 bits; use "
                        "method: lora.")
    return done


def nf4_to_empty(model: nn.Module, device: str | torch.device) -> None:
    """Give every NF4 weight uninitialised storage on `device`, all five inner tensors (`Module.to_empty` moves
    only the three that FSDP shards, and leaves the scale mean and the code book on the meta device)."""
    mod = _nf4()
    for _, module in quantized_linears(model):
        w = module.weight
        names, _ = w.__tensor_flatten__()
        inner = {n: torch.empty_like(getattr(w, n), device=device) for n in names}
        module.weight = nn.Parameter(mod.NF4Tensor(*mod.construct_nf4_args(w, {**inner, "device": torch.device(
            device)})), requires_grad=False)


def dequantize_all(model: nn.Module) -> int:
    """Replace every NF4 weight by its dequantized values (in the dtype it dequantizes to): the weights a QLoRA run
    trained against, which an adapter merges into. Returns how many were replaced."""
    n = 0
    for _, module in quantized_linears(model):
        module.weight = nn.Parameter(module.weight.get_original_weight(), requires_grad=False)
        n += 1
    return n


def as_qlora_trained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The dense base a QLoRA adapter was trained against: each decoder linear weight stored in NF4 and
    dequantized back to `dtype`, the numbers the run computed with (what its adapter merges into, and what chat and
    eval apply it to); a plain model that generates without dequantizing every weight per token."""
    quantize_blocks(model, dtype)
    dequantize_all(model)
    return model


def nf4_storage_bytes(t: torch.Tensor) -> int:
    """Bytes an NF4 weight keeps (its inner tensors)."""
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
