"""Activation checkpointing of every decoder block: full (only the block's input is kept) or selective (the
outputs of the attention kernel and of every other matmul are kept too, so backward recomputes the cheap ops
only), non-reentrant: through transformers' own switch under whichever name the version has, or torch's wrapper
for remote code that still implements the pre-4.35 API."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PreTrainedModel

from shardfit.models.anatomy import base_model, transformer_blocks

NON_REENTRANT = {"use_reentrant": False}


def _attention_kernels() -> set[Any]:
    """The fused attention ops whose outputs (output and log-sum-exp) selective checkpointing keeps: SDPA's
    kernels on every backend, and flash-attention 2's own ops where the installed flash_attn registers them."""
    aten = torch.ops.aten
    ops = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_cudnn_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        with contextlib.suppress(AttributeError, RuntimeError):  # flash-attn not installed: its ops do not exist
            ops.add(getattr(torch.ops.flash_attn, name).default)
    return ops


def selective_context() -> Any:
    """Fresh checkpoint contexts for one block call: torchtitan's op-level policy, which keeps the outputs of the
    attention kernel and of every other matmul (the first, third, ...; a matmul with a bias counts too) and
    recomputes the rest (norms, activations, RoPE, the other matmuls) in backward. Counting restarts for each
    call, and the recomputation counts separately, so both pick the same matmuls."""
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    attention = _attention_kernels()
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in attention
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(selective: bool) -> dict[str, Any]:
    """Keyword arguments for torch.utils.checkpoint.checkpoint: non-reentrant, with the selective policy."""
    return {**NON_REENTRANT, "context_fn": selective_context} if selective else dict(NON_REENTRANT)


def enable_hf_checkpointing(model: nn.Module, selective: bool = False) -> None:
    """Non-reentrant checkpointing of every decoder block through transformers' API (`selective`: keep what
    `selective_context` keeps).

    transformers 5 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` and warns that the
    old name goes in v6; the new name is used where it exists, so neither a warning nor v6 breaks the call.

    transformers also hooks the input embedding to make its output require grad, which only reentrant checkpointing
    needs (its blocks get no gradient otherwise). With frozen embeddings (LoRA) that output is a leaf, so every
    backward would store a gradient for it that nothing reads, alive as long as the step's graph: the hook is
    removed again."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=checkpoint_kwargs(selective))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(selective))
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def old_gc_api(model: nn.Module) -> bool:
    """True when the model's code overrides `_set_gradient_checkpointing(module, value)` (pre-4.35 API), which
    transformers' own switch cannot drive ('got an unexpected keyword argument enable')."""
    own = getattr(type(base_model(model)), "_set_gradient_checkpointing", None)
    if own is None or own is getattr(PreTrainedModel, "_set_gradient_checkpointing", None):
        return False
    params = list(inspect.signature(own).parameters)
    return "value" in params or ("module" in params and "enable" not in params)


def enable_checkpointing(model: nn.Module, selective: bool = False) -> None:
    """Non-reentrant activation checkpointing of every decoder block, full or `selective`: transformers' switch
    when the model supports it, else torch's checkpoint wrapper around its blocks."""
    if not old_gc_api(model):
        enable_hf_checkpointing(model, selective)
        return
    blocks = set(map(id, transformer_blocks(model)))
    # The wrapper is non-reentrant by default and sets use_reentrant itself: only the policy is passed on.
    wrapper = functools.partial(checkpoint_wrapper, context_fn=selective_context) if selective else checkpoint_wrapper
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in blocks)
