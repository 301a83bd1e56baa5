"""QLoRA's frozen base: every linear layer of the decoder blocks stored as a 4-bit NF4 weight (torchao's
NF4Tensor, double-quantized block scales), dequantized one layer at a time for its matmul in forward and backward.

torchao's NF4Tensor is a tensor subclass that FSDP2 shards and all-gathers as packed 4-bit storage (its
fsdp_pre/post_all_gather hooks), so the same model runs on one process, under DDP and sharded by zero3; peft wraps
its layers as plain `nn.Linear`, so the saved adapter is a standard one for the unquantized base. Embeddings,
norms and the output head stay in the compute dtype (as the QLoRA recipe leaves them).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardfit.errors import UserError
from shardfit.models.anatomy import transformer_blocks
from shardfit.models.experts import moe_parts
from shardfit.models.nf4 import _nf4, is_bnb_quantized, is_nf4, nf4_storage_bytes, to_nf4
from shardfit.models.quantize_experts import dequantize_experts, quantize_experts, quantized_experts
from shardfit.plan.quant import quantizable

# Names other modules and tests import from here: QLoRA's storage as one place.
__all__ = ["as_qlora_trained", "dequantize_all", "is_bnb_quantized", "is_nf4", "nf4_storage_bytes", "nf4_to_empty",
           "quantize_blocks", "quantized_experts", "quantized_linears", "to_nf4"]

log = logging.getLogger(__name__)


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer whose weight is stored in NF4."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_nf4(m.weight)]


@torch.no_grad()
def quantize_blocks(model: nn.Module, dtype: torch.dtype, experts: bool = True) -> int:
    """Store the weight of every linear layer inside the decoder blocks (routers aside) and every fused expert stack
    of a mixture in NF4 (dequantizing to `dtype`), one weight at a time, each 16-bit weight released as its 4-bit
    one replaces it; returns how many were quantized. A weight that is not a whole number of 64-element blocks
    stays as it is. `experts` False: the expert stacks are left for `quantize_experts_under_lora` (after the
    adapters wrap them, so that peft nests its wrappers as on the unquantized model)."""
    done = 0
    parts = moe_parts(model)
    # A router that is a linear layer (Llama 4's) stays as it is: in 4 bits it would send tokens elsewhere. (A
    # router that is a bare parameter, gpt-oss's, is never a linear layer nor an expert stack.)
    routers = {id(model.get_submodule(r)) for r in parts.routers}
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
    done += quantize_experts(model, parts, dtype) if experts else sum(
        p.dim() == 3 for e in parts.experts for p in model.get_submodule(e).parameters(recurse=False))
    if done == 0:
        raise UserError("'method: qlora': the model's decoder blocks have no linear layer to store in 4 bits; use "
                        "method: lora.")
    return done


def nf4_to_empty(model: nn.Module, device: str | torch.device) -> None:
    """Give every NF4 weight (a linear layer's, an expert stack's) uninitialised storage on `device`, all five inner
    tensors (`Module.to_empty` moves only the three that FSDP shards, and leaves the scale mean and the code book on
    the meta device)."""
    mod = _nf4()
    for module in model.modules():
        for name, w in list(module._parameters.items()):
            if w is None or not is_nf4(w):
                continue
            names, _ = w.__tensor_flatten__()
            inner = {n: torch.empty_like(getattr(w, n), device=device) for n in names}
            args = mod.construct_nf4_args(w, {**inner, "device": torch.device(device)})
            setattr(module, name, nn.Parameter(mod.NF4Tensor(*args), requires_grad=False))


def dequantize_all(model: nn.Module) -> int:
    """Replace every NF4 weight by its dequantized values (in the dtype it dequantizes to): the weights a QLoRA run
    trained against, which an adapter merges into. Returns how many were replaced."""
    n = 0
    for _, module in quantized_linears(model):
        module.weight = nn.Parameter(module.weight.get_original_weight(), requires_grad=False)
        n += 1
    return n + dequantize_experts(model)


def as_qlora_trained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The dense base a QLoRA adapter was trained against: each decoder linear weight and expert stack stored in NF4 and
    dequantized back to `dtype`, the numbers the run computed with (what its adapter merges into, and what chat and
    eval apply it to); a plain model that generates without dequantizing every weight per token."""
    quantize_blocks(model, dtype)
    dequantize_all(model)
    return model


