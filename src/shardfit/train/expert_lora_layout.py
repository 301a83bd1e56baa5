"""One checkpoint layout for LoRA on fused experts, whatever the run's expert parallelism.

peft's adapter over a fused experts weight keeps B as `[out, r*E]` with the expert index fastest, so no slice of
experts is a block of B's columns: a rank's share under expert parallelism cannot be stored as a shard of it. In a
checkpoint every such B (and its AdamW moments) is therefore stored as `[E, out, r]`, experts along the first
dimension, as the expert stacks are: a share is then a shard (parallel/experts.py `as_shards`), and a checkpoint
saved with `expert_parallel: 2` resumes with 1 and back, DCP resharding the experts like any other tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfit.parallel.experts import map_states

# Wrapper modules whose attribute name is not part of the parameter names a state dict uses.
_WRAPPER_PARTS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def state_dict_name(name: str) -> str:
    """A module or parameter path as state dicts name it: without DDP's, compile's and checkpointing's wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def expert_lora_b(model: nn.Module) -> dict[str, int]:
    """State-dict name -> experts held, of every LoRA B over a fused experts weight (peft's `ParamWrapper` with
    more than one expert) in `model`; empty without LoRA on experts."""
    out = {}
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        lora_b = getattr(module, "lora_B", None)
        if not isinstance(experts, int) or experts <= 1 or not isinstance(lora_b, nn.ModuleDict):
            continue
        path = state_dict_name(name)
        for adapter in lora_b:
            out[f"{path}.lora_B.{adapter}.weight"] = experts
    return out


def _saved(t: Any, experts: int) -> Any:
    """peft's `[out, r*E]` as `[E, out, r]`."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        return t
    return t.reshape(t.shape[0], -1, experts).permute(2, 0, 1).contiguous()


def _loaded(t: Any) -> Any:
    """`[E, out, r]` back as peft's `[out, r*E]`."""
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        return t
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def to_saved(model_sd: dict[str, Any], optim_sd: dict[str, Any],
             names: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts with every expert LoRA B (`names`) in the checkpoint's layout."""
    return map_states(model_sd, optim_sd, names.get, _saved) if names else (model_sd, optim_sd)


def to_model(model_sd: dict[str, Any], optim_sd: dict[str, Any],
             names: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A loaded checkpoint's state dicts with every expert LoRA B back in peft's layout."""
    return map_states(model_sd, optim_sd, names.get, lambda t, _: _loaded(t)) if names else (model_sd, optim_sd)
