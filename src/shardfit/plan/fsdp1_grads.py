"""FSDP1's flat gradients: the second copy of a unit's gradient its backward holds while it flattens the gradient,
and, with LoRA under use_orig_params=True, the frozen weights' share of every block's flat gradient.

FSDP1 (FullyShardedDataParallel, `Workload.runs_fsdp1`) runs a unit's forward through views of its flat parameter:
`torch.split(flat_param, numels)` reshaped to each weight (torch/distributed/fsdp/_flat_param.py
`_get_unflat_views_unaligned`, set in forward by `_use_unsharded_views`). Autograd therefore makes the flat
parameter's gradient in split's backward, which concatenates the per-weight gradients into one new flat tensor
(`split_with_sizes_backward`: `at::cat`): at that moment, at the end of the unit's backward, the per-weight gradients
(the node's inputs, buffered since each linear's backward made them) and the flat gradient are both alive, with the
unit and the one it prefetched still gathered. `.grad` then is that flat tensor, and the reduce-scatter reads it in
place (_runtime_utils.py `_get_reduce_scatter_tensors`: no padded copy when its size divides by the world size,
as a block's does). FSDP2 keeps each parameter's gradient as it is made and has no such flattening.

With use_orig_params=True one flat parameter may mix frozen and trainable weights (`_flat_param.py`
`_validate_tensors_to_flatten`: "For `use_orig_params=True`, permit non-uniform `requires_grad`"), and it requires
a gradient when any of them does. The views every weight computes through are split's outputs, so they require a
gradient whatever the original parameter says: each frozen linear's backward computes its weight's gradient, a real
one, and the flat gradient, its reduce-scatter and the shard kept as `.grad` span the frozen weights too.
`_use_sharded_grad_views` only hides them (a frozen parameter's `.grad` is None); the shard stays on the flat
parameter until every original gradient is None again (`_reset_flat_param_grad_info_if_needed`, after
`zero_grad`). torch's FSDP docstring warns of it ("higher than expected gradient memory usage")."""

from __future__ import annotations

from shardfit.plan.adapters import lora_params
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.precision import compute_bytes
from shardfit.plan.weight_bytes import linear_weight_bytes
from shardfit.plan.workload import Workload


def mixes_frozen_and_adapters(w: Workload) -> bool:
    """Whether each FSDP1 block unit flattens its frozen weights and its LoRA adapters into one flat parameter
    (`fsdp1_mixed_units`, with use_orig_params=True: not `flat_params`) under LoRA, as Lightning Fabric's
    FSDPStrategy wraps a Block. `fsdp1` alone does not say it: the tools on transformers' Trainer wrap each adapter
    matrix as a unit of its own (peft's fsdp_auto_wrap_policy). QLoRA is left out: bitsandbytes' 4-bit matmul
    returns no gradient for its weight, so split's backward would fill that share with zeros of the packed
    storage's size, a case no trace here has run."""
    return w.runs_fsdp1 and w.fsdp1_mixed_units and not w.flat_params and w.method == "lora"


def block_flat_grad_bytes(shape: ModelShape, w: Workload) -> float:
    """The unsharded gradients of every block's flat parameter when a block's frozen weights and adapters share it
    (use_orig_params=True): the whole block, its linear weights, norms and adapters, in the compute dtype."""
    low = compute_bytes(w)
    blocks = shape.over_blocks(lambda moe: linear_weight_bytes(shape, w, moe) + 2 * shape.hidden * low)
    return float(blocks + lora_params(shape, w) * low)


def fsdp1_backward_grad_bytes(shape: ModelShape, w: Workload, layer_grads: float) -> float:
    """The unsharded gradients FSDP1 (`runs_fsdp1`) holds at its backward's worst moment, in bytes, from
    `layer_grads`, one block's trainable weights' gradients: those, and for a full fine-tune the flat gradient
    split's backward makes of them; with LoRA in a block unit of frozen weights and adapters
    (`mixes_frozen_and_adapters`) the whole block's gradient twice, frozen weights included.

    With LoRA under flat parameters (`flat_params`) every adapter matrix is a unit of its own, so the copy is one
    adapter matrix's gradient (a few MiB), left out."""
    if not w.runs_fsdp1:
        return layer_grads
    if mixes_frozen_and_adapters(w):
        return 2 * block_flat_grad_bytes(shape, w) / shape.layers
    return 2 * layer_grads if w.method == "full" else layer_grads
