"""`attn_implementation: auto` where the faster attention kernel depends on the micro-batch's row width.

On a CPU in bf16, uncompiled, the plain matmul-mask-softmax attention (`eager`) ran faster than SDPA for short rows
and slower for wide ones (resolve/defaults.py has the measurements), and it keeps the probabilities of every
(query, key) pair for backward: memory that grows with the square of the width, which SDPA's kernel never holds.
A run whose rows vary in width (packing, a long-tailed length mix) therefore picks per micro-batch: eager up to
the measured width, the model's own kernel above it. Transformers reads the choice at every forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from shardfit.models.build import use_attention


@dataclass
class AttentionByWidth:
    """Switches `model` to eager attention for micro-batches up to `eager_max_width` tokens per row and to `wide`
    (the kernel it was loaded with) above; `used` counts the micro-batches each kernel ran."""

    model: nn.Module
    eager_max_width: int
    wide: str
    used: Counter[str] = field(default_factory=Counter)

    @classmethod
    def for_model(cls, model: nn.Module, eager_max_width: int) -> AttentionByWidth | None:
        """The switch for `model` (None when `eager_max_width` is 0: one kernel for the whole run)."""
        if eager_max_width <= 0:
            return None
        return cls(model, eager_max_width, getattr(model.config, "_attn_implementation", None) or "sdpa")

    def kernel_for(self, width: int) -> str:
        """The attention kernel a micro-batch of rows `width` tokens wide runs."""
        return "eager" if width <= self.eager_max_width else self.wide

    def before(self, width: int) -> None:
        """Set the kernel for the micro-batch about to run."""
        name = self.kernel_for(width)
        use_attention(self.model, name)
        self.used[name] += 1
