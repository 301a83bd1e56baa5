"""The optimizers the planner models, by what their step keeps and allocates: the one table every count of optimizer
states reads (plan/optimizer_states.py), keyed by the planner's names (`Workload.optimizer`, `plan --optimizer`).

Each entry was read from the class the tools build for it (torch/optim, transformers' Adafactor and Trainer's
`get_optimizer_cls_and_kwargs`, bitsandbytes/optim, schedulefree): the states it creates per parameter on its first
step and the tensors its default step path allocates on a GPU. The counters torch keeps per parameter (`step`, a
0-dim tensor on the host unless capturable or fused; transformers' Adafactor `RMS`) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

# bitsandbytes' blockwise 8-bit states: one fp32 absmax per block of this many elements, for each state
# (bitsandbytes/optim/optimizer.py `Optimizer2State.init_state` and `Optimizer1State.init_state`: blocksize 256).
BNB_STATE_BLOCK = 256
# Bytes of an element of each dtype an optimizer takes by torch's name (transformers' Trainer builds AnyPrecision
# AdamW's with `getattr(torch, name)`): the floating-point ones a state can be kept in.
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


@dataclass(frozen=True)
class OptimizerKind:
    """What one optimizer keeps per trained weight and allocates while it steps.

    `states`: full-size states per trained weight. `width`: their dtype: "weight" (torch's `zeros_like(p)`, the
    dtype of the weights stepped; fp32 under bitsandbytes' 32-bit kernels or an engine's fp32 masters), "fp32"
    (whatever the weights: transformers' Adafactor upcasts each gradient first), "8bit" (bitsandbytes' blockwise
    states: one byte and an fp32 absmax per BNB_STATE_BLOCK). `factored`: Adafactor's second moment kept as one row
    and one column factor per matrix (the whole vector for a 1-D tensor), in `width`. `group_copies`: copies of the
    param group, in the states' dtype, that torch's multi-tensor (foreach) step allocates at once (its default on
    a GPU). `tensor_copies`: copies of one tensor, in the states' dtype, a step that loops over tensors allocates
    (the largest trained tensor's bound it); `flat_copies`: what the same loop allocates for a 1-D tensor (ZeRO's
    flat partitions, FSDP1's flat parameters), where Adafactor does not factor; `upcasts`: it also copies a 16-bit
    weight and its gradient to fp32 first. `previous_copies`: copies of the tensor stepped just before, in the
    states' dtype, that such a loop still holds while it makes the next one's (a local bound until the next
    iteration rebinds it), and `previous_weight_copies` in the weights' dtype. `weight_clones`: copies of the
    tensor stepped, in the weights' dtype, that such a loop makes once all but one of its `tensor_copies` are
    freed, beside the previous tensor's `previous_weight_copies` still bound. `dtypes`: each state's own dtype
    where the optimizer takes them as settings (torch's names, DTYPE_BYTES), as the tool builds it by default; a
    workload's `optimizer_dtypes` gives the job's own; its step's copies are in the dtype of state
    `copied_state`. `eight_bit`: bitsandbytes' 8-bit form of it, where the table models one (the recommender's
    offer, plan/plan.py `alternatives`)."""

    label: str
    states: int
    width: str = "weight"
    factored: bool = False
    group_copies: int = 0
    tensor_copies: int = 0
    flat_copies: int = 0
    several_flat_copies: int = 0
    upcasts: bool = False
    previous_copies: int = 0
    previous_weight_copies: int = 0
    weight_clones: int = 0
    dtypes: tuple[str, ...] = ()
    copied_state: int = 0
    eight_bit: str | None = None


OPTIMIZER_KINDS: dict[str, OptimizerKind] = {
    # torch's Adam/AdamW: exp_avg, exp_avg_sq; foreach: `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`
    # (torch/optim/adam.py `_multi_tensor_adam`). bitsandbytes' 32-bit AdamW and torch's fused kernel: in place.
    "adamw": OptimizerKind("AdamW", 2, group_copies=1, eight_bit="adamw8bit"),
    # bitsandbytes' AdamW8bit (or torchao's): state1, state2 in uint8, absmax1, absmax2; one kernel per tensor.
    "adamw8bit": OptimizerKind("8-bit AdamW", 2, "8bit"),
    # transformers' Adafactor as the Trainer's `optim: adafactor` builds it (beta1 None, scale_parameter and
    # relative_step False): exp_avg_sq_row and exp_avg_sq_col (`exp_avg_sq` for a vector) `.to(grad)` of the
    # gradient already cast to fp32; one tensor at a time: `update = grad**2 + eps` and `_approx_sq_grad`'s
    # full-size product exist together, beside fp32 copies of a 16-bit gradient and weight (`p_data_fp32`). A
    # vector: `grad**2` and `update = grad**2 + eps`, then `exp_avg_sq.rsqrt()` beside that `update`; the last
    # `update` stays bound into the next tensor's step, a matrix's too (measured on a tiny Qwen2: 3.0 fp32 copies
    # of its equal MLP weights stepped one after another, 2.0 of a tensor between small ones).
    "adafactor": OptimizerKind("transformers' Adafactor", 0, "fp32", factored=True, tensor_copies=2, flat_copies=2,
                               several_flat_copies=3, upcasts=True, previous_copies=1),
    # ... with `beta1` set: `exp_avg`, a full fp32 first moment, too; `update = exp_avg` at the end, so nothing of a
    # tensor's step outlives it.
    "adafactor_beta1": OptimizerKind("transformers' Adafactor with beta1", 1, "fp32", factored=True,
                                     tensor_copies=2, flat_copies=2, several_flat_copies=2, upcasts=True),
    # torch.optim.Adafactor: row_var and col_var (`variance` for a vector) as `p.grad.new_zeros`; foreach off by
    # default (torch/optim/_adafactor.py passes foreach=None through), so one tensor at a time:
    # `var_estimate = row_var @ col_var`; a vector: `grad_squared = grad * grad` and `var_estimate =
    # variance.clone()`, both alive until the update, and that `update` (`var_estimate`) until the next tensor's is
    # made, a matrix's too (measured: 2.0 copies of a tiny Qwen2's equal MLP weights stepped one after another, 1.5
    # of a tensor followed by one half its size, 1.0 of one between small ones).
    "adafactor_torch": OptimizerKind("torch's Adafactor", 0, factored=True, tensor_copies=1, flat_copies=2,
                                     several_flat_copies=3, previous_copies=1),
    # torch.optim.SGD: no state without momentum; `momentum_buffer` (a clone of the first gradient) with it. Its
    # foreach step adds the scaled gradients in place. With weight decay it (and RMSprop's) first makes
    # `grads = torch._foreach_add(grads, params, alpha=weight_decay)`, one more copy of the group: not counted,
    # the Workload carries no weight decay (`WEIGHT_DECAY_COPIES` names them; the readers' note says it).
    "sgd": OptimizerKind("SGD", 0),
    "sgd_momentum": OptimizerKind("SGD with momentum", 1),
    # torch.optim.Adagrad: `sum`; foreach: `std = torch._foreach_sqrt(state_sums)` and
    # `numerator = torch._foreach_mul(grads, minus_clr)` (torch/optim/adagrad.py `_multi_tensor_adagrad`).
    # bitsandbytes' Adagrad8bit is not in the table, so no 8-bit form is offered: no tool's Trainer `optim` names it
    # (an offer must be a setting of the job's own), and its one 8-bit state would be 8-bit RMSprop's count. Its
    # Adam8bit neither: torch's Adam is planned as AdamW, a stand-in that gets no offer (Workload.no_8bit_form).
    "adagrad": OptimizerKind("Adagrad", 1, group_copies=2),
    # torch.optim.RMSprop (momentum 0, not centered, the Trainer's defaults): `square_avg`; foreach:
    # `avg = torch._foreach_sqrt(grouped_square_avgs)`. bitsandbytes' 32-bit RMSprop: one fp32 state, in place.
    "rmsprop": OptimizerKind("RMSprop", 1, group_copies=1, eight_bit="rmsprop8bit"),
    # ... with momentum: `momentum_buffer` too; centered: `grad_avg` too, and its foreach step's one copy is
    # `avg = torch._foreach_addcmul(grouped_square_avgs, grouped_grad_avgs, grouped_grad_avgs, value=-1)`.
    "rmsprop_momentum": OptimizerKind("RMSprop with momentum", 2, group_copies=1),
    "rmsprop_centered": OptimizerKind("centered RMSprop", 2, group_copies=1),
    "rmsprop_centered_momentum": OptimizerKind("centered RMSprop with momentum", 3, group_copies=1),
    "rmsprop8bit": OptimizerKind("8-bit RMSprop", 1, "8bit"),
    # bitsandbytes' Lion (Optimizer1State: state1), DeepSpeed's FusedLion (exp_avg): one state, in place.
    "lion": OptimizerKind("Lion", 1, eight_bit="lion8bit"),
    "lion8bit": OptimizerKind("8-bit Lion", 1, "8bit"),
    # bitsandbytes' AdEMAMix: state1 a double buffer (m1, m2), state2 (nu); 8-bit: absmax1 of (2, blocks) too.
    "ademamix": OptimizerKind("AdEMAMix", 3, eight_bit="ademamix8bit"),
    "ademamix8bit": OptimizerKind("8-bit AdEMAMix", 3, "8bit"),
    # torchdistx's AnyPrecisionAdamW (transformers' `adamw_anyprecision`): exp_avg in `momentum_dtype`, exp_avg_sq in
    # `variance_dtype`, both float32 as the Trainer builds it (`_get_adamw_anyprecision` reads optim_args;
    # torchdistx's own default variance is bfloat16); one tensor at a time: `exp_avg_sq.sqrt()` and its quotient by
    # the bias correction exist together, in the variance's dtype, and that `centered_variance` stays bound into the
    # next tensor's step. On a flat partition, DeepSpeed's `step_copies` counts its two copies in fp32.
    "adamw_anyprecision": OptimizerKind("AnyPrecision AdamW", 2, dtypes=("float32", "float32"), copied_state=1,
                                        tensor_copies=2, flat_copies=2, several_flat_copies=3, previous_copies=1),
    # ... with `use_kahan_summation`: `compensation` too, in `compensation_buffer_dtype` (the Trainer's default
    # bfloat16); its `temp_buffer = p.detach().clone()`, a copy of the weight, is made beside this tensor's
    # `centered_variance` and the previous tensor's `temp_buffer`, which stays bound into the next tensor's step:
    # the most where the variance is narrower than the weights (measured, fp32 weights and bf16 states: 6 bytes
    # an element of a 2048x256 tensor and 4 of the 256x256 one stepped before it, where the two variance copies
    # made 4 and 6).
    "adamw_anyprecision_kahan": OptimizerKind("AnyPrecision AdamW with Kahan summation", 3,
                                              dtypes=("float32", "float32", "bfloat16"), copied_state=1,
                                              tensor_copies=2, flat_copies=2, several_flat_copies=3,
                                              previous_copies=1, previous_weight_copies=1, weight_clones=1),
    # DeepSpeed's FusedLamb: exp_avg and exp_avg_sq, in place.
    "lamb": OptimizerKind("LAMB", 2),
    # schedulefree's AdamWScheduleFree and RAdamScheduleFree: `z` (a clone of the weight) and `exp_avg_sq`;
    # foreach by default: `denom = torch._foreach_div(exp_avg_sq, bias_correction2)`. SGDScheduleFree: `z`, in place.
    "schedule_free_adamw": OptimizerKind("schedule-free AdamW", 2, group_copies=1),
    "schedule_free_radam": OptimizerKind("schedule-free RAdam", 2, group_copies=1),
    "schedule_free_sgd": OptimizerKind("schedule-free SGD", 1),
}
OPTIMIZERS = tuple(OPTIMIZER_KINDS)
# The kinds whose multi-tensor step copies the group once more under weight decay (torch/optim/sgd.py
# `_multi_tensor_sgd`, rmsprop.py `_multi_tensor_rmsprop`: `torch._foreach_add(grads, params, alpha=...)`); Adagrad's
# copy of that kind is freed before its two copies are made (measured: two either way), AdamW decays in place.
WEIGHT_DECAY_COPIES = ("sgd", "sgd_momentum", "rmsprop", "rmsprop_momentum", "rmsprop_centered",
                       "rmsprop_centered_momentum")


def rmsprop_kind(momentum: bool, centered: bool) -> str:
    """The planner's optimizer for torch.optim.RMSprop built with a non-zero `momentum` and/or `centered`: each
    adds a full state (`momentum_buffer`, `grad_avg`)."""
    return "rmsprop" + ("_centered" if centered else "") + ("_momentum" if momentum else "")


def anyprecision_kind(kahan: bool) -> str:
    """The planner's optimizer for torchdistx's AnyPrecisionAdamW, with `use_kahan_summation` on (`kahan`): its
    compensation buffer is a third state."""
    return "adamw_anyprecision_kahan" if kahan else "adamw_anyprecision"


def eight_bit_form(optimizer: str, no_8bit_form: bool = False) -> str | None:
    """The key of bitsandbytes' 8-bit form of `optimizer`; None where the table models none, or where the job
    cannot switch (`no_8bit_form`: a stand-in, or an optimizer DeepSpeed builds from its JSON)."""
    kind = OPTIMIZER_KINDS.get(optimizer)
    return None if no_8bit_form or kind is None else kind.eight_bit
