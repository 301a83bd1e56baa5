"""The host's side of the optimizer step itself: the ops launched once per step, after the last micro-batch's
backward and before the next forward (gradient clipping, the optimizer, zero_grad), and the wait some releases make
there.

A micro-batch's launches are plan/dispatch.py's. The step's own are counted by bench/optimizer_step_ops.py (a
TorchDispatchMode over a real step of tiny Llama models of 1 and 2 layers, the difference per parameter tensor; torch
2.13) into bench/results/optimizer_step_ops.json, and each launch costs the host what dispatch.py's costs
(DISPATCH_KERNEL_S, a view DISPATCH_VIEW_S; a compiled function's call what the bench timed). How many there
are depends on the implementation, which changed with the releases:
- the optimizer: its implementation's launches (plan/optimizer_launches.py, `implementation`, from the optimizer,
  its library and `Workload.optimizer_loop`). torch's AdamW walks the tensors one at a time (`for_loop`: 8 kernels
  a tensor with weight decay, torch's default before 2.0 and `foreach=False` since) or in multi-tensor ops
  (`foreach`: 11 launches a step whatever the tensors, torch's default on a GPU since 2.0), or runs one fused
  kernel (`fused`: 3). transformers' own AdamW (`transformers`: the HF Trainer's `adamw_hf`, its default before
  transformers 4.32, transformers#25109) loops in Python: 7 kernels and 2 views a tensor without weight decay.
  bitsandbytes launches one kernel per tensor and waits for the device after each (since 0.39), torchao calls a
  compiled function per tensor. torch's loops keep each tensor's step counter on the host: ops that launch no
  kernel, timed on the development machine's CPU at 1.8 and 0.1 us against a view's 0.6 us (`host_op_us`), so
  priced as views.
- gradient clipping (`Workload.grad_clip`; clip_grad_norm_): a norm and a multiply per gradient and 6 ops over the
  norms (`per_tensor`), or 8 multi-tensor ops (`foreach`, the default since torch 2.0, pytorch#91846). Before
  torch 1.10 (pytorch#61042) it read `clip_coef < 1` back before multiplying (`per_tensor_sync`): the host waits
  for the device to finish the backward and the norms, so the launches after it overlap nothing before it.
- zero_grad (`Workload.zero_grad_zeros`): one fill per gradient where it writes zeros (torch's default before 2.0,
  pytorch#92731), none where it drops them.
- the learning-rate scheduler launches nothing (LambdaLR counted).

The step's launches overlap the step's own kernels on the device (the optimizer's bytes, plan/comms.py), so the
step ends after the slower of the two; a wait adds HOST_SYNC_S. The launches are charged once per optimizer step,
whatever the gradient accumulation, and only on a GPU (on a CPU the ops run on the host, inside its measured
rates). The lower bound: the host's lead over the device at the end of backward could hide a part of them.
"""

from __future__ import annotations

from shardfit.plan.adapters import adapts
from shardfit.plan.cards import Card
from shardfit.plan.comms import param_tensors
from shardfit.plan.dispatch import DISPATCH_KERNEL_S, DISPATCH_VIEW_S, HOST_SYNC_S
from shardfit.plan.optimizer_launches import launches
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

# clip_grad_norm_'s kernels (per gradient, once) by path (`clip_per_tensor`, `clip_foreach`); the synchronising
# path of torch before 1.10 launches as many (a comparison where the clamp is now) and waits once.
CLIP_OPS: dict[str, tuple[float, float]] = {"none": (0.0, 0.0), "foreach": (0.0, 8.0), "per_tensor": (2.0, 6.0),
                                            "per_tensor_sync": (2.0, 6.0)}
CLIP_SYNCS = {"per_tensor_sync": 1}
# zero_grad's kernels per gradient: a fill where it writes zeros (`zero_grad_zeros`), none where it drops them.
ZERO_GRAD_KERNELS = {True: 1.0, False: 0.0}


def trainable_tensors(shape: ModelShape, w: Workload) -> float:
    """Parameter tensors the step walks: a full fine-tune's every tensor (plan/comms.py `param_tensors`, biases
    left out), the trained blocks' share of them under `freeze`, LoRA's two adapter matrices per adapted layer (a
    mixture's adapted expert weights as one pair per fused stack) and each module peft trains whole."""
    if w.method == "full":
        return float(param_tensors(shape))
    if w.method == "freeze":
        return param_tensors(shape) * len(w.trained_blocks(shape.layers)) / shape.layers
    if not w.trains_adapters:
        return 0.0

    def pairs(moe) -> float:  # noqa: ANN001  (a block kind, as ModelShape.over_blocks hands it)
        return 2.0 * len({n for n, _, _ in shape.named_linears(moe) if adapts(n, w)})

    return shape.over_blocks(pairs) + len(set(w.lora_saved))


def step_ops(shape: ModelShape, w: Workload) -> tuple[float, float, float]:
    """(kernels, views, host ops) the host dispatches once per optimizer step of `w`: clipping, the optimizer
    (plan/optimizer_launches.py, by the implementation that steps it), zero_grad."""
    n = trainable_tensors(shape, w)
    opt = launches(w)
    (pk, pv, ph), (fk, fv, fh) = opt.per_tensor, opt.fixed
    ck, cf = CLIP_OPS[w.grad_clip]
    kernels = n * (pk + ck + ZERO_GRAD_KERNELS[w.zero_grad_zeros]) + fk + cf
    return kernels, n * pv + fv, n * ph + fh


def step_host_s(shape: ModelShape, w: Workload, card: Card) -> float:
    """Seconds the host spends on one optimizer step's own launches (`step_ops`), each kernel at DISPATCH_KERNEL_S,
    each view and host op at DISPATCH_VIEW_S; 0 on a CPU, whose measured rates hold its ops."""
    if card.key == "cpu":
        return 0.0
    kernels, views, host = step_ops(shape, w)
    calls = trainable_tensors(shape, w) * launches(w).call_s_per_tensor
    return kernels * DISPATCH_KERNEL_S + (views + host) * DISPATCH_VIEW_S + calls


def step_sync_s(shape: ModelShape, w: Workload, card: Card) -> float:
    """Seconds the device idles at the step's own waits for it, each HOST_SYNC_S: clipping before torch 1.10
    (CLIP_SYNCS) and an optimizer that waits after each tensor (bitsandbytes'); 0 on a CPU."""
    if card.key == "cpu":
        return 0.0
    return (CLIP_SYNCS.get(w.grad_clip, 0) + trainable_tensors(shape, w) * launches(w).syncs_per_tensor) * HOST_SYNC_S
