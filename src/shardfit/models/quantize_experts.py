"""QLoRA of a mixture of experts: the routed experts' fused 3-D weights stored in NF4 and dequantized, one expert
stack at a time and each a slice of experts at a time, when their module runs.

transformers 5 keeps a block's routed experts as fused 3-D parameters of one `experts` module (`gate_up_proj`,
`down_proj`; [experts, out, in] or transposed), which every experts implementation (eager, batched_mm, grouped_mm)
reads as a plain tensor. torchao's NF4Tensor holds at most 2 dimensions, so each stack is stored flattened to
[experts x rows, cols] (the same 64-element blocks in the same order as the 3-D tensor: NF4 quantizes the flat
elements) and a `torch.nn.utils.parametrize` parametrization gives the module back the dequantized 3-D tensor.
FSDP2 shards and all-gathers the NF4 tensor (the parametrization's `original`) like any NF4 linear weight.

peft's LoRA on parameters (`target_parameters`, its ParamWrapper) adds its low-rank term on top of that
dequantization for each forward (`lora_over_nf4`); the gradient reaches the adapters only (the NF4 original never
requires one).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from shardfit.models.experts import MoeParts, moe_parts
from shardfit.models.nf4 import is_nf4, to_nf4
from shardfit.plan.quant import experts_per_slice, quantizable

log = logging.getLogger(__name__)


class DequantizeExperts(nn.Module):
    """The parametrization of an NF4 expert stack: its values in the dtype it dequantizes to, as [experts, rows,
    cols]. `expert_shape` is also how models/experts.py recognises a fused expert weight under it.

    torchao's dequantization holds about seven times its result at once (int64 codes of both nibbles, their
    code-book values, the scaled halves: plan/quant.py `dequantize_peak_bytes`), which for a whole stack of 128
    experts is gigabytes; the stack is dequantized a slice of whole experts at a time into its result
    (`experts_per_slice`), the same values (a slice keeps its blocks' scales and factors)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.expert_shape = tuple(shape)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        experts, rows, cols = self.expert_shape
        per = experts_per_slice(self.expert_shape, w.scaler_block_size)
        if per >= experts:
            return w.get_original_weight().view(self.expert_shape)
        out = torch.empty(self.expert_shape, dtype=w.dtype, device=w.device)
        for i, part in enumerate(torch.split(w, per * rows)):
            out[i * per:(i + 1) * per] = part.get_original_weight().view(per, rows, cols)
        return out

    def extra_repr(self) -> str:
        return f"nf4 {list(self.expert_shape)}"


def quantize_experts(model: nn.Module, parts: MoeParts, dtype: torch.dtype) -> int:
    """Store every fused expert weight of `parts` in NF4 (dequantizing to `dtype`), one stack at a time; returns
    how many. A stack that is not a whole number of 64-element blocks stays as it is (check reports it)."""
    done = 0
    for path in parts.experts:
        module = model.get_submodule(path)
        # In the module's own order: peft nests its wrappers in the order it finds the weights, and the adapter's
        # key names (`experts.lora_A` / `experts.base_layer.lora_A`) must be those of the unquantized model.
        for name, p in list(module._parameters.items()):
            if p is None or p.dim() != 3 or name not in parts.expert_weights:
                continue
            experts, rows, cols = p.shape
            if not quantizable(experts * rows, cols):
                log.info("%s.%s: %s is not whole 64-element blocks; kept in %s", path, name, list(p.shape), p.dtype)
                continue
            flat = to_nf4(p.detach().reshape(experts * rows, cols), dtype)
            # Release the 16-bit stack before the next is quantized: only one is ever held twice.
            setattr(module, name, nn.Parameter(flat, requires_grad=False))
            # unsafe: the parametrization changes the shape (2-D storage, 3-D values); nothing is evaluated here,
            # so a meta-device model (check, simulate) registers it too.
            parametrize.register_parametrization(module, name, DequantizeExperts(p.shape), unsafe=True)
            done += 1
        if done and not getattr(module, "_shardfit_nf4_cached", False):
            _dequantize_once_per_call(module)
    return done


def quantize_experts_under_lora(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the expert stacks of a model that peft has wrapped in NF4, and make its parameter LoRA work on them
    (`lora_over_nf4`). After the wrapping, not before: peft nests the wrappers of a module's two stacks in the
    order it finds them, the module's own for plain parameters but sorted by name for parametrized ones, and the
    adapter's keys (`experts.lora_A`, `experts.base_layer.lora_A`) must be those of the unquantized model, which
    the adapter is loaded onto and merged into."""
    done = quantize_experts(model, moe_parts(model), dtype)
    lora_over_nf4(model)
    return done


def _dequantize_once_per_call(module: nn.Module) -> None:
    """Cache the dequantized stacks for the length of one call of the experts module: the eager implementation
    reads `gate_up_proj[i]` once per expert hit, which would dequantize the whole stack each time."""
    scopes: list[Any] = []

    def enter(_m: nn.Module, _args: Any) -> None:
        scope = parametrize.cached()
        scope.__enter__()
        scopes.append(scope)

    def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
        if scopes:
            scopes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # an exception in forward leaves no cache behind
    module._shardfit_nf4_cached = True


def quantized_experts(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(experts module path, weight name, NF4 storage) of every fused expert weight stored in NF4."""
    out = []
    for path, module in model.named_modules():
        plists = getattr(module, "parametrizations", None)
        if not isinstance(plists, nn.ModuleDict):
            continue
        for name, plist in plists.items():
            if isinstance(plist[0], DequantizeExperts) and is_nf4(plist.original):
                out.append((path, name, plist.original))
    return out


def dequantize_experts(model: nn.Module) -> int:
    """Replace every NF4 expert stack by its dequantized 3-D values (a plain frozen parameter again): the weights a
    QLoRA run trained against, which an adapter merges into. Returns how many were replaced."""
    n = 0
    for path, name, _ in quantized_experts(model):
        module = model.get_submodule(path)
        with torch.no_grad():
            values = getattr(module, name).detach().clone()
        parametrize.remove_parametrizations(module, name, leave_parametrized=False)
        setattr(module, name, nn.Parameter(values, requires_grad=False))
        n += 1
    return n


def lora_over_nf4(model: nn.Module) -> int:
    """Make peft's LoRA on parameters (ParamWrapper) work on NF4 expert stacks; returns how many wrappers.

    Per forward, peft 0.21 reads the wrapped parameter (`get_param`, for its dtype), registers its LoRA
    parametrization with a check that evaluates the stack, and removes it afterwards. On a stack whose
    dequantization is a parametrization already that goes wrong twice: a block's two wrappers are nested, so the
    inner one reads its stack while the outer one's parametrization cache is on, and the dequantized values
    without the adapter are cached for the whole call (the adapter of `down_proj` never reaches the output nor
    gets a gradient); and its removal finds only `_LoraParameterProxy`, not the `_LoraFactorsProxy` it registers
    for one adapter on several experts, so each forward would add the adapter once more. Each such wrapper
    instead reads a stand-in of the stack's shape and dtype (no dequantization) and appends its LoRA term on top
    of the dequantization for the length of its call."""
    n = 0
    for module in model.modules():
        if type(module).__name__ != "ParamWrapper" or not hasattr(module, "parameter_name"):
            continue
        base = module.get_base_layer()
        plists = getattr(base, "parametrizations", None)
        if plists is None or module.parameter_name not in plists or \
                not isinstance(plists[module.parameter_name][0], DequantizeExperts):
            continue
        module.get_param = functools.partial(_stand_in, plists[module.parameter_name])
        module._activate_lora = functools.partial(_activate_lora, module, plists[module.parameter_name])
        n += 1
    return n


def _stand_in(plist: Any) -> torch.Tensor:
    """A tensor with the stack's shape, dtype and device that holds one element (what peft reads it for)."""
    w = plist.original
    return torch.zeros((), dtype=w.dtype, device=w.device).expand(plist[0].expert_shape)


class LoraTerm(nn.Module):
    """A parametrization adding one adapter's low-rank term (`scaling * lhs @ rhs` per expert) to the dequantized
    stack, in the stack's dtype, as peft's own does."""

    def __init__(self, lhs: torch.Tensor, rhs: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.lhs, self.rhs, self.scaling = lhs, rhs, scaling

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=w.device.type, enabled=False):
            return torch.baddbmm(w, self.lhs, self.rhs, alpha=self.scaling)


@contextlib.contextmanager
def _activate_lora(wrapper: Any, plist: Any, active_adapters: list[str]) -> Iterator[None]:
    adapters = [a for a in active_adapters or [] if a in wrapper.lora_A]
    if not adapters:
        yield
        return
    for a in adapters:  # appended directly: no evaluation of the stack under an outer wrapper's cache
        plist.append(LoraTerm(*wrapper.get_delta_factors(a)))
    try:
        with parametrize.cached():
            yield
    finally:
        for _ in adapters:
            del plist[len(plist) - 1]
