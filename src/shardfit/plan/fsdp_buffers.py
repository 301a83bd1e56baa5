"""The gathered weights and unsharded gradients a sharded strategy (FSDP2's zero2 and zero3, FSDP1 where a tool
runs it) holds on one rank beside its shards, at forward's start, the loss and backward: what `per_rank` adds to a
rank's model states (plan/estimate.py)."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from shardfit.plan.fsdp1_grads import fsdp1_backward_grad_bytes
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

if TYPE_CHECKING:
    from shardfit.plan.estimate import PerRank


def zero2_buffers(shape: ModelShape, w: Workload, n: int, r: PerRank, *, root_16: float, own_embedding_16: float,
                  layer_16: float, layer_grads: float) -> None:
    """zero2's buffers on `r` (bytes, in place). FSDP2 (reshard_after_forward=False; FSDP1's SHARD_GRAD_OP alike)
    stores the weights sharded as zero3 does, but keeps every unit's gathered copy, in the compute dtype, from its
    forward until its backward: from the loss into backward a rank holds its shards and the whole model gathered
    (measured with FSDPMemTracker, plan --simulate); each block's copy is freed after its backward, and the
    optimizer step sees the shards alone. One rank gathers nothing: its shard is the whole model (and it runs as
    single anyway, `not_applicable`)."""
    low = compute_bytes(w)
    if n > 1:
        # The units beside the blocks and the root stay gathered too: vision and audio towers, shared blocks,
        # per-layer embeddings, learned positions.
        outside = (shape.extra_params + shape.shared_params + shape.per_layer_model_params()
                   + shape.positions * shape.hidden) * low
        gathered_model = root_16 + shape.layers * layer_16 + outside
        # at the loss, the last block's all-gather buffer too, as under zero3; backward gathers nothing
        r.fwd_temp = gathered_model + layer_16
        # A full fine-tune's root unit (head, final norm) makes its unsharded 16-bit gradient first and holds it
        # through backward, as under zero3 (measured with plan --simulate).
        head_grad = root_16 - own_embedding_16 if w.method == "full" else 0.0
        r.bwd_temp = gathered_model + head_grad
        r.freed_by_end = shape.layers * layer_16
    r.bwd_temp += fsdp1_backward_grad_bytes(shape, w, layer_grads)  # FSDP1 flattens them as under zero3
    r.gathered = gathered_pool_bytes(w, root_16, own_embedding_16, layer_16)


def zero3_buffers(shape: ModelShape, w: Workload, r: PerRank, *, root_16: float, own_embedding_16: float,
                  layer_16: float, layer_grads: float, embedding_in_root: float) -> None:
    """zero3's buffers on `r` (bytes, in place). FSDP2 keeps the root unit (head, final norm) unsharded for the whole
    step, and the last block's all-gather buffer is still allocated at the loss (measured with FSDPMemTracker,
    plan --simulate). An untied input embedding is a unit of its own (parallel/parallelize.py), freed right after
    it runs."""
    r.fwd_temp = root_16 - own_embedding_16 + layer_16 + embedding_in_root
    r.gathered = gathered_pool_bytes(w, root_16, own_embedding_16, layer_16)
    if w.runs_fsdp1:  # the root's flat parameter once, the current block's and the prefetched one's
        r.bwd_temp = r.gathered + fsdp1_backward_grad_bytes(shape, w, layer_grads)
    else:
        # In backward a block's all-gather buffer coexists with its unsharded copy and its unsharded
        # gradients; an untied embedding once (FSDP2 gathers its unit again for its gradient).
        r.bwd_temp = 2 * (root_16 + layer_16) + layer_grads - own_embedding_16
        # Backward resharded every unit: forward's start gathers them again, the root first (kept to the end of
        # backward), then an untied embedding's unit, then the first block. FSDP2 frees an all-gather buffer only
        # at the next unit's copy-out (`all_gather_state`), so each copy-out holds the unit's buffer and copy
        # beside the previous unit's buffer (measured with plan --simulate).
        root_own = root_16 - own_embedding_16
        embedding_out = 2 * root_own + 2 * own_embedding_16 if own_embedding_16 else 0.0
        first_block_out = root_own + (own_embedding_16 or root_own) + 2 * layer_16
        r.start_temp = max(embedding_out, first_block_out)
        if w.trains_adapters and not w.lora_saved:
            # A frozen root (LoRA, QLoRA) makes no gradient: it stays gathered once through the step,
            # and the frozen input embedding, whose output needs no gradient, is not gathered again. A block's
            # backward holds its copy, its all-gather buffer (freed at the next copy-out) and the prefetched
            # block's buffer.
            r.bwd_temp = root_16 - own_embedding_16 + 3 * layer_16 + layer_grads


def gathered_pool_bytes(w: Workload, root: float, embedding: float, layer: float) -> float:
    """The most FULL_SHARD's gathered weights hold at once in the pool of the stream they are gathered under, in
    bytes, from `root` (the root unit's weights, an untied input `embedding` among them) and `layer` (one block's).

    FSDP1 (`runs_fsdp1`) gathers into its flat parameters under its unshard stream: `fsdp1_backward_weight_bytes`.
    FSDP2 allocates each unit's all-gather output under its copy-in stream (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py `foreach_all_gather`, in forward and backward: _fsdp_param_group.py
    `get_all_gather_streams`) and copies the parameters out on the compute stream; in forward a unit's output is
    freed only after the next unit's copy-out (`wait_for_unshard`), so two neighbours' outputs coexist. The units
    in forward order as shardfit wraps them (parallel/parallelize.py): the root's own weights, an untied input
    embedding's unit, the blocks."""
    if w.runs_fsdp1:
        return fsdp1_backward_weight_bytes(root, layer)
    units = [root - embedding, embedding, layer, layer] if embedding else [root, layer, layer]
    return max(a + b for a, b in pairwise(units))


def fsdp1_backward_weight_bytes(root: float, layer: float) -> float:
    """The gathered weights FSDP1 (`runs_fsdp1`, FULL_SHARD) holds at its backward's worst moment, in bytes, from
    `root`, the root unit's unsharded flat parameter (embedding, final norm, head), and `layer`, one block's.

    FSDP1 all-gathers a unit straight into its padded unsharded flat parameter, one buffer per unit, whose views
    the block computes with (torch/distributed/fsdp/_flat_param.py `unshard`: `_alloc_padded_unsharded_flat_param`,
    then `_all_gather_flat_param` into it); FSDP2 copies each gathered parameter out of its all-gather buffer. The
    root keeps its buffer from forward to its post-backward (`embedding_in_root`). A block's pre-backward hook
    gathers it and, under BACKWARD_PRE (the default), prefetches the unit before it in post-forward order
    (_runtime_utils.py `_pre_backward_hook` -> `_prefetch_handle`, _exec_order_utils.py
    `get_handle_to_backward_prefetch`): the previous block, or, with LoRA under flat parameters, the block's own
    last adapter, and the previous block from the block's first adapter near the end of its backward, while the
    block's frozen weights are still gathered (they are freed only when the gradient of the block's input is made,
    `_register_post_backward_reshard_only_hook`). Either way two blocks and the root, the root once: FSDP2's
    count of a second root buffer does not apply."""
    return root + 2 * layer
