"""What the host launches for one optimizer step, by the implementation that runs it: the one table the time model
reads (plan/step_ops.py), beside plan/optimizer_kinds.py's table of what each optimizer keeps in memory.

The memory model asks one thing of an implementation, whether it copies the param group at once
(`Workload.multi_tensor_step`; `fused_adamw` says "steps in place"). The time model asks another: how many ops the
host dispatches a step, per trainable tensor and once. Those differ among the in-place implementations: torch's
fused AdamW launches 3 kernels a step whatever the tensors, transformers' own AdamW and Adafactor loop over the
tensors in Python, bitsandbytes launches one kernel per tensor and waits for it, torchao calls a compiled function
per tensor. So the implementation is decided apart (`implementation`), from the optimizer, its library
(`bnb_optimizer`, `torchao_optimizer`) and the loop the job runs (`Workload.optimizer_loop`).

Sources of the counts:
- torch's AdamW, SGD, RMSprop, Adagrad and Adafactor, transformers' AdamW (of 4.2.2) and Adafactor: counted by
  bench/optimizer_step_ops.py (a TorchDispatchMode over a real step of tiny Llama models, the difference per
  tensor; torch 2.13, transformers 5.23) into bench/results/optimizer_step_ops.json, each as the HF Trainer builds
  it (torch's defaults: AdamW with weight decay, the others without; transformers' AdamW without, the Trainer's
  default weight_decay 0.0; Adafactor with `scale_parameter` and `relative_step` off). torch keeps each tensor's
  step counter on the host (host ops, priced as views). The Adafactors step a matrix (two factors) and a vector
  (one) differently: the count is the mean over a decoder block's 7 matrices and 2 norms, the fixed part left out
  (the slope's remainder over the 3 tensors outside the blocks, below one op).
- bitsandbytes' optimizers (8-bit and 32-bit, paged or not, Adam/AdamW/Lion/RMSprop/AdEMAMix): read from its
  source (bitsandbytes/optim/optimizer.py `Optimizer8bit.step`, `Optimizer2State.update_step`, 0.39-0.50): one
  kernel per tensor (`optimizer_update_32bit` or `optimizer_update_8bit_blockwise`), its step counter a Python
  int, and since 0.39 (June 2023, with the paged optimizers) a device synchronize after every tensor's update
  (`torch.cuda.synchronize()`, `sync_gpu(p)` since 0.47): the host waits for each kernel before it launches the
  next, so the device idles once per tensor (`syncs_per_tensor`). A bitsandbytes older than 0.39 did not wait:
  counted as the newer one, an upper bound for such a job.
- torchao's low-bit AdamW (torchao/optim/adam.py `_AdamBase.step`, 0.18): per tensor it increments the step
  counter (a 0-dim CPU tensor: a host op) and calls `torch.compile(single_param_adam)`, whose graph inductor fuses
  into one kernel (counted from the code it generates on the CPU; a GPU's triton may split the 8-bit states'
  block reductions off, which is not counted). The compiled call's own host work (guards, wrappers) is timed by
  the bench (`host_op_us` `torchao_call_per_tensor`, a tiny tensor whose kernel does next to nothing): 215-450 us
  on the shared development machine's CPU, 265-360 times a view timed beside it; priced as TORCHAO_CALL_VIEWS
  views (DISPATCH_VIEW_S each), `call_s_per_tensor`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.plan.dispatch import DISPATCH_VIEW_S
from shardfit.plan.workload import Workload

Ops = tuple[float, float, float]  # kernels, views, host ops


@dataclass(frozen=True)
class StepLaunches:
    """What one implementation's step dispatches: `per_tensor` and `fixed` (kernels, views, host ops) per trainable
    tensor and once a step; `syncs_per_tensor`: waits for the device per tensor; `call_s_per_tensor`: the host's
    seconds per tensor beyond its launches (a compiled function's call)."""

    label: str
    per_tensor: Ops
    fixed: Ops
    syncs_per_tensor: float = 0.0
    call_s_per_tensor: float = 0.0


# torchao's compiled call per tensor in views' host time (the bench's ratio, 265-360 over runs of a loaded machine).
TORCHAO_CALL_VIEWS = 300.0
STEP_LAUNCHES: dict[str, StepLaunches] = {
    "adamw_for_loop": StepLaunches("torch's AdamW, one tensor at a time", (8.0, 0.0, 2.0), (2.0, 0.0, 0.0)),
    "adamw_foreach": StepLaunches("torch's AdamW, multi-tensor ops", (0.0, 0.0, 2.0), (11.0, 1.0, 0.0)),
    "adamw_fused": StepLaunches("torch's fused AdamW", (0.0, 0.0, 0.0), (3.0, 0.0, 1.0)),
    "transformers_adamw": StepLaunches("transformers' AdamW (adamw_hf)", (7.0, 2.0, 0.0), (2.0, 0.0, 0.0)),
    "sgd_for_loop": StepLaunches("torch's SGD, one tensor at a time", (1.0, 0.0, 0.0), (2.0, 0.0, 0.0)),
    "sgd_foreach": StepLaunches("torch's SGD, multi-tensor ops", (0.0, 0.0, 0.0), (3.0, 0.0, 0.0)),
    "rmsprop_for_loop": StepLaunches("torch's RMSprop, one tensor at a time", (5.0, 0.0, 1.0), (2.0, 0.0, 0.0)),
    "rmsprop_foreach": StepLaunches("torch's RMSprop, multi-tensor ops", (0.0, 0.0, 0.0), (8.0, 1.0, 0.0)),
    "adagrad_for_loop": StepLaunches("torch's Adagrad, one tensor at a time", (4.0, 0.0, 2.0), (2.0, 0.0, 0.0)),
    "adagrad_foreach": StepLaunches("torch's Adagrad, multi-tensor ops", (0.0, 0.0, 1.0), (8.0, 1.0, 0.0)),
    "transformers_adafactor": StepLaunches("transformers' Adafactor", (22.2, 1.6, 0.0), (0.0, 0.0, 0.0)),
    "torch_adafactor": StepLaunches("torch's Adafactor", (18.0, 0.0, 2.0), (0.0, 0.0, 0.0)),
    "bitsandbytes": StepLaunches("bitsandbytes' optimizer", (1.0, 0.0, 0.0), (0.0, 0.0, 0.0), syncs_per_tensor=1.0),
    "torchao": StepLaunches("torchao's low-bit AdamW", (1.0, 0.0, 1.0), (0.0, 0.0, 0.0),
                           call_s_per_tensor=TORCHAO_CALL_VIEWS * DISPATCH_VIEW_S),
}
# The loops a job's torch optimizer runs (`Workload.optimizer_loop`): `auto` lets the optimizer decide
# (`implementation`); `transformers` is transformers' own AdamW.
OPTIMIZER_LOOPS = ("auto", "foreach", "for_loop", "fused", "transformers")
# The torch optimizers counted by loop, by the planner's optimizer (plan/optimizer_kinds.py); the others step as
# AdamW does (schedulefree's run torch's multi-tensor ops as AdamW's; LAMB's and Lion's fused kernels as AdamW's).
FAMILIES = {"sgd": "sgd", "sgd_momentum": "sgd", "rmsprop": "rmsprop", "rmsprop_momentum": "rmsprop",
            "rmsprop_centered": "rmsprop", "rmsprop_centered_momentum": "rmsprop", "adagrad": "adagrad"}
# Optimizers that loop over the tensors in Python whatever the job says: torchdistx's AnyPrecisionAdamW (its step
# is torch's for-loop AdamW's ops, not counted apart).
PYTHON_LOOPS = ("adamw_anyprecision", "adamw_anyprecision_kahan")


def implementation(w: Workload) -> str:
    """The STEP_LAUNCHES key of the implementation that steps `w`: bitsandbytes' or torchao's kernels where the
    workload names that library, an Adafactor's own, else the planner's optimizer by its loop. `optimizer_loop`
    `auto` takes the fused kernel where `fused_adamw` says the step runs in place, else torch's multi-tensor ops
    (its default on a GPU since 2.0)."""
    if w.bnb_optimizer:
        return "bitsandbytes"
    if w.torchao_optimizer:
        return "torchao"
    if w.optimizer in ("adafactor", "adafactor_beta1"):
        return "transformers_adafactor"
    if w.optimizer == "adafactor_torch":
        return "torch_adafactor"
    loop = w.optimizer_loop
    if loop == "auto":
        loop = "for_loop" if w.optimizer in PYTHON_LOOPS else "fused" if w.fused_adamw else "foreach"
    if loop == "transformers":
        return "transformers_adamw"
    if loop == "fused":
        return "adamw_fused"
    return f"{FAMILIES.get(w.optimizer, 'adamw')}_{loop}"


def launches(w: Workload) -> StepLaunches:
    """STEP_LAUNCHES' row for the implementation that steps `w`."""
    return STEP_LAUNCHES[implementation(w)]
