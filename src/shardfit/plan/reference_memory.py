"""What DPO's and KTO's reference forward holds (the policy with its adapters switched off, without gradients):
one block's tensors at a time and the log-probabilities of one chunk of labelled positions."""

from __future__ import annotations

from shardfit.config.support import LOSS_CHUNK_MAX_ROWS
from shardfit.plan.activations import largest_block_activation_bytes_per_token
from shardfit.plan.eager_scores import eager_no_grad_bytes_per_token
from shardfit.plan.precision import compute_bytes, residual_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload


def reference_activation_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What the reference's forward (DPO/KTO with the adapters switched off) holds at once: it runs without
    gradients, so nothing is saved for backward; one block's tensors exist at a time (at most what that block would
    save with gradients), beside its input in the residual stream and the last block's output, which the
    log-probabilities read (eager attention's scores at their peak without gradients, above their saved bytes).
    The policy's own forward starts after it, so the two never add up."""
    r = residual_bytes(w, strategy)
    scores = eager_no_grad_bytes_per_token(shape, w, strategy)
    return w.tokens * (largest_block_activation_bytes_per_token(shape, w, strategy) + scores + 2 * r * shape.hidden)


def reference_logits_bytes(shape: ModelShape, w: Workload) -> float:
    """The reference's log-probabilities: one chunk of labelled positions through the head at a time, its fp32
    logits and their 16-bit source (train/preference.py `sequence_logps`), nothing kept for backward."""
    c = compute_bytes(w)
    return min(w.loss_chunk or LOSS_CHUNK_MAX_ROWS, w.tokens) * shape.vocab * (4 + (c if c < 4 else 0))
