"""The second copy of a unit's gradient that FSDP1's backward holds while it flattens the gradient.

FSDP1 (FullyShardedDataParallel, `Workload.runs_fsdp1`) runs a unit's forward through views of its flat parameter:
`torch.split(flat_param, numels)` reshaped to each weight (torch/distributed/fsdp/_flat_param.py
`_get_unflat_views_unaligned`, set in forward by `_use_unsharded_views`). Autograd therefore makes the flat
parameter's gradient in split's backward, which concatenates the per-weight gradients into one new flat tensor
(`split_with_sizes_backward`: `at::cat`): at that moment, at the end of the unit's backward, the per-weight gradients
(the node's inputs, buffered since each linear's backward made them) and the flat gradient are both alive, with the
unit and the one it prefetched still gathered. `.grad` then is that flat tensor, and the reduce-scatter reads it in
place (_runtime_utils.py `_get_reduce_scatter_tensors`: no padded copy when its size divides by the world size,
as a block's does). FSDP2 keeps each parameter's gradient as it is made and has no such flattening."""

from __future__ import annotations

from shardfit.plan.workload import Workload


def fsdp1_backward_grad_bytes(w: Workload, layer_grads: float) -> float:
    """The unsharded gradients FSDP1 (`runs_fsdp1`) holds at its backward's worst moment, in bytes, from
    `layer_grads`, one block's: those, and for a full fine-tune the flat gradient split's backward makes of them.

    The copy is counted for a full fine-tune, whose block is one flat parameter of trainable weights. With LoRA
    under flat parameters (`flat_params`) every adapter matrix is a unit of its own, so the copy is one adapter
    matrix's gradient (a few MiB), left out; with use_orig_params=True a block's frozen and trainable weights share
    one flat parameter, whose gradient then spans the frozen weights too, which the plan does not count at all."""
    if not w.runs_fsdp1 or w.method != "full":
        return layer_grads
    return 2 * layer_grads
