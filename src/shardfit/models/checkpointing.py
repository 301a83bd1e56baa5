"""transformers' own activation checkpointing switch, non-reentrant, under whichever name the version has."""

from __future__ import annotations

from torch import nn

NON_REENTRANT = {"use_reentrant": False}


def enable_hf_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder block through transformers' API.

    transformers 5 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` and warns that the
    old name goes in v6; the new name is used where it exists, so neither a warning nor v6 breaks the call.

    transformers also hooks the input embedding to make its output require grad, which only reentrant checkpointing
    needs (its blocks get no gradient otherwise). With frozen embeddings (LoRA) that output is a leaf, so every
    backward would store a gradient for it that nothing reads, alive as long as the step's graph: the hook is
    removed again."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=dict(NON_REENTRANT))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(NON_REENTRANT))
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()
