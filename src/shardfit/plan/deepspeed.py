"""DeepSpeed ZeRO's per-rank memory for a model shape and workload: what `shardfit plan --from ...` predicts for
a job configured with a DeepSpeed JSON.

The model states follow DeepSpeed's own layout (runtime/zero/stage_1_and_2.py and stage3.py of DeepSpeed 0.19),
with its buffers, which matter more than they look (DeepSpeed's default buckets are 5e8 elements, 1 GB each
in bf16):
- ZeRO-1/2: the 16-bit model stays whole on every rank (trainable weights flattened into one buffer per group);
  each rank owns 1/N of the fp32 master weights and of AdamW's two fp32 moments; gradients are reduced through
  the contiguous reduce bucket (`reduce_bucket_size` elements, twice with `overlap_comm`) into a 16-bit
  partition of 1/N; the optimizer step makes the fp32 gradient of the partition.
- ZeRO-3: every parameter is a 1/N 16-bit partition, except those at or under
  `stage3_param_persistence_threshold` elements, which stay gathered once used; a module's parameters are
  all-gathered for its forward and backward, and up to `stage3_prefetch_bucket_size` elements ahead of it; the
  fp32 masters, moments and the 16-bit gradient partition are 1/N; the reduce bucket as above. The optimizer step
  walks the partition one sub-group (`sub_group_size` of its elements) at a time, making that sub-group's fp32
  gradient and freeing it before the next (stage3.py `step`: `_prepare_fp32_grad_for_sub_group`, then
  `_release_sub_group` sets the fp32 partition's `.grad` to None).
- Offload (`offload_optimizer: cpu`): masters, moments and the fp32 gradient partition live in host RAM (pinned
  when `pin_memory`); ZeRO-3's `offload_param` keeps the 16-bit partitions there too, gathered to the GPU per
  module.
Activations and the loss are the planner's (`activations.py`), with DeepSpeed's 16-bit weights: no autocast, as
under FSDP's mixed precision.

Checked against real DeepSpeed 0.19 steps on gloo ranks (bench/deepspeed_memory.py, tests/test_foreign_deepspeed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.plan.estimate import (
    GIB,
    Breakdown,
    Candidate,
    GradientTimeline,
    PerRank,
    add_runtime_overhead,
    in_gib,
    planned_shape,
    planned_workload,
    state_bytes,
    step_moments,
    trainable_params,
    trainable_weight_bytes,
    with_loss_chunk,
)
from shardfit.plan.evaluation import eval_note
from shardfit.plan.hardware import Hardware
from shardfit.plan.optimizer_states import kind_of, largest_trainable, optimizer_state_bytes
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

# DeepSpeed's defaults (runtime/zero/config.py), in elements.
REDUCE_BUCKET = 500_000_000
ALLGATHER_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000
PERSISTENCE_THRESHOLD = 100_000
MAX_LIVE_PARAMETERS = 1_000_000_000
MAX_REUSE_DISTANCE = 1_000_000_000
# ZeRO-3 updates each rank's partition in sub-groups of about this many of its elements (deepspeed/runtime/zero/
# config.py `sub_group_size`, 1e9 by default; stage3.py `_create_fp16_sub_groups` closes a sub-group once its
# partition elements reach it).
SUB_GROUP = 1_000_000_000


@dataclass(frozen=True)
class ZeroSettings:
    """The parts of a DeepSpeed JSON that decide memory (sizes in elements, as DeepSpeed counts them)."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False
    reduce_bucket_size: int = REDUCE_BUCKET
    allgather_bucket_size: int = ALLGATHER_BUCKET
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = PREFETCH_BUCKET
    param_persistence_threshold: int = PERSISTENCE_THRESHOLD
    max_live_parameters: int = MAX_LIVE_PARAMETERS
    max_reuse_distance: int = MAX_REUSE_DISTANCE
    sub_group_size: int = SUB_GROUP
    # The JSON has an optimizer section: DeepSpeed builds its own (FusedAdam on the GPU, DeepSpeedCPUAdam under
    # offload), whose step allocates nothing. Without one the tool's optimizer steps the partitions (the HF
    # Trainer's torch AdamW), with torch's temporaries (`step_bytes`).
    ds_optimizer: bool = False
    # The section's Adam/AdamW has `torch_adam: true`: DeepSpeed builds torch's AdamW instead of FusedAdam
    # (runtime/engine.py `_configure_basic_optimizer`), multi-tensor on a GPU, whatever the tool's `optim` says.
    torch_adam: bool = False

    @property
    def strategy(self) -> str:
        """shardfit's strategy with the same sharding: ZeRO-0/1 shard nothing or only the optimizer (closest:
        ddp), ZeRO-2 zero2, ZeRO-3 zero3 (zero3_offload when parameters are offloaded)."""
        if self.stage == 3:
            return "zero3_offload" if self.offload_param else "zero3"
        return "zero2" if self.stage == 2 else "ddp"

    def describe(self) -> str:
        """E.g. 'DeepSpeed ZeRO-3 (offload optimizer + params)'."""
        off = [what for what, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        return f"DeepSpeed ZeRO-{self.stage}" + (f" (offload {' + '.join(off)})" if off else "")


def _persistent(shape: ModelShape, threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole once gathered (each at or under `threshold` elements): norms,
    and on small models whole projections."""
    def per_layer(moe: bool) -> int:
        sizes = [i * o for i, o in shape.linear_shapes(moe)] + [shape.hidden, shape.hidden]
        return sum(s for s in sizes if s <= threshold)

    root = shape.hidden if shape.hidden <= threshold else 0
    emb = shape.vocab * shape.hidden
    root += sum(emb for _ in range(1 if shape.tied else 2) if emb <= threshold)
    return int(shape.over_blocks(per_layer)) + root


def _kept_at_loss(shape: ModelShape, z: ZeroSettings) -> int:
    """Elements ZeRO-3 still holds gathered when the loss runs: walking back from the head, each module stays
    whole while backward will reuse it within `stage3_max_reuse_distance` elements (those fetched after it in the
    forward and before it in the backward, about twice what runs after it), within `stage3_max_live_parameters`.
    DeepSpeed's default distance (1e9) keeps a small model whole, and the last block or two of a 7B one."""
    head = shape.vocab * shape.hidden
    blocks = [shape.layer_params(moe) for n, moe in reversed(shape.block_kinds()) for _ in range(n)]
    order = ([head] if not shape.tied else []) + blocks + [head]
    kept = after = 0
    for size in reversed(order):
        if 2 * after <= z.max_reuse_distance:
            kept += size
        after += size
    return min(kept, max(z.max_live_parameters, head))


@dataclass
class ZeroMemory:
    """What one rank of a DeepSpeed ZeRO job holds, in bytes: the 16-bit model as it is partitioned, the
    temporaries of forward and backward (gathered parameters, a block's unreduced gradients), the optimizer
    states with their gradient partitions, and what lives in host RAM instead."""

    weights: float
    fwd_temp: float
    bwd_temp: float
    states: float = 0.0  # fp32 masters and moments
    grad_part: float = 0.0  # the reduced 16-bit gradient partition
    staging: float = 0.0  # ZeRO-1/2 offload's GPU staging buffer, allocated once
    host: float = 0.0
    host_optimizer: float = 0.0


def as_deepspeed_runs(w: Workload) -> Workload:
    """`w` as DeepSpeed's engine holds its weights: with bf16 or fp16 on, `deepspeed.initialize` casts every
    floating-point parameter to that dtype (runtime/engine.py `_configure_distributed_model` ->
    `_cast_module_mixed_precision`, 0.19.8: fp16, bf16, fp32 and fp64 alike; only integer storage such as
    bitsandbytes' packed Params4bit is left), so what peft's prepare_model_for_kbit_training upcast to fp32 (norms,
    embedding, the routed expert stacks bitsandbytes leaves unquantized) is 16-bit again: no `frozen_fp32`. Under
    ZeRO-3's zero.Init the engine skips that cast, but the parameters were built partitioned in the config's 16-bit
    dtype and peft's upcast reaches only their empty placeholders; and transformers loads a quantized model without
    zero.Init (modeling_utils.py: `if not is_quantized`), so a QLoRA takes the cast at every stage. An fp32 run
    keeps them as they are. `w` itself where it has no `frozen_fp32` or is not 16-bit. The one rule DeepSpeed's
    memory (`estimate_deepspeed`, which applies it) and a DeepSpeed job's workload (foreign/read.py, which the
    time model reads) both follow. A model loaded in fp32 (`loaded_fp32`) is cast the same way."""
    if (w.frozen_fp32 or w.loaded_fp32) and compute_bytes(w) == 2:
        return replace(w, frozen_fp32=False, loaded_fp32=False)
    return w


def estimate_deepspeed(shape: ModelShape, w: Workload, hw: Hardware, z: ZeroSettings) -> Candidate:
    """Per-rank GPU peak of a DeepSpeed ZeRO job (and its host RAM per rank), at the moments `estimate.estimate`
    weighs, built by the same `step_candidates` from what the engine holds (`zero_rank`), with the weights as the
    engine casts them (`as_deepspeed_runs`)."""
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, as_deepspeed_runs(w)), hw)
    strategy = "zero3" if z.stage == 3 else "zero2"  # activations: 16-bit weights, no autocast
    m = zero_memory(shape, w, hw.world, z)
    rank = zero_rank(shape, w, hw.world, z, m)
    moments_by_phase = step_moments(shape, w, strategy, rank)
    step_gib = _tensors(moments_by_phase["optimizer"]) / GIB
    phase = max(moments_by_phase, key=lambda k: _tensors(moments_by_phase[k]))
    b = in_gib(moments_by_phase[phase])
    add_runtime_overhead(b, hw, strategy)
    fits = b.total <= hw.gpu_mem_gib
    host_gib = m.host / GIB
    said = eval_note(shape, w, hw.world, phase == "eval")
    notes = f"{z.describe()}: " + (f"{said}; " if said else "") + (
        f"{hw.gpu_mem_gib - b.total:.1f} GiB headroom" if fits else f"{b.total:.1f} GiB > {hw.gpu_mem_gib:.0f} GiB")
    if hw.cpu_mem_gib is not None and host_gib * hw.gpus_per_node > hw.cpu_mem_gib:
        fits = False
        notes += f"; host RAM too small for the offloaded states: {host_gib * hw.gpus_per_node:.0f} GiB per node"
    # Between steps (what a memory probe sees after engine.step()): the model, the states, what ZeRO-3 holds.
    steady = (m.weights + m.states + rank.timeline.forward) / GIB
    return Candidate(z.strategy, fits, b, host_gib, estimator="analytic", notes=notes, peak_phase=phase,
                     extra={"between_steps_gib": steady, "host_optimizer_gib": m.host_optimizer / GIB,
                            "optimizer_step_gib": step_gib})


def zero_rank(shape: ModelShape, w: Workload, n: int, z: ZeroSettings, m: ZeroMemory) -> PerRank:
    """What one of `n` ranks holds under `z` as `step_candidates` weighs it: the model, the optimizer states and
    the engine's temporaries (`zero_memory`), and its gradient buffers at each moment of the step.

    ZeRO-3 allocates its reduce bucket and 16-bit gradient partition once, at start-up; ZeRO-1/2 make the bucket
    when backward begins and free it after the step, and keep the partition through accumulation. A full
    fine-tune's head makes its whole 16-bit gradient while the loss's gradient is still alive (larger than the
    reduce bucket, so DeepSpeed reduces it on its own; under ZeRO-1/2 offload the staging buffer takes it)."""
    low = compute_bytes(w)
    bucket = z.reduce_bucket_size * low * (2 if z.overlap_comm else 1) if z.contiguous_gradients else 0
    held = m.grad_part + bucket if z.stage == 3 else (m.grad_part if w.grad_accum > 1 else 0.0) + m.staging
    rest = m.grad_part + bucket + m.staging
    grads_at_step, step_temp = step_bytes(shape, w, n, z, m, rest)
    between = m.grad_part + bucket if z.stage == 3 else m.staging
    head_grad = shape.vocab * shape.hidden * low if w.method == "full" and not (
        z.offload_optimizer and z.stage < 3) else 0.0
    timeline = GradientTimeline(forward=held, loss=held + (bucket if z.stage < 3 else 0.0), blocks=rest, end=rest,
                                step=grads_at_step, between=between)
    return PerRank(m.weights, grads_at_step, m.states, cpu=m.host, layers=shape.layers, foreach=step_temp,
                   fwd_temp=m.fwd_temp, bwd_temp=m.bwd_temp, ranks=n, timeline=timeline, loss_grad_temp=head_grad)


def zero_memory(shape: ModelShape, w: Workload, n: int, z: ZeroSettings) -> ZeroMemory:
    """The model, its temporaries and the optimizer states one of `n` ranks holds under `z` (module docstring), for
    `w` as the engine runs it (`estimate_deepspeed` casts it with `as_deepspeed_runs` first)."""
    low = compute_bytes(w)
    p, t = shape.params(), trainable_params(shape, w)
    full = w.method == "full"
    # The model as DeepSpeed holds it: trainable weights in 16 bits (the fp32 masters are the optimizer's), frozen
    # ones as the method stores them (4-bit NF4 for QLoRA; peft's fp32 upcast only in an fp32 run: `as_deepspeed_runs`).
    model_bytes = low * p if full else state_bytes(shape, w)[0] - trainable_weight_bytes(shape, w) + low * t
    layer_params = shape.layer_params()
    block_grads = (layer_params if full else t / shape.layers) * low  # a block's unreduced gradients
    if z.stage == 3:
        persistent = _persistent(shape, z.param_persistence_threshold)
        sharded = model_bytes - low * persistent
        # A module's gathered parameters plus the prefetched ones ahead of it; and at the loss, every module DeepSpeed
        # did not release after its forward because backward reuses it within max_reuse_distance elements.
        per_element = model_bytes / p
        gathered = min(layer_params + min(z.prefetch_bucket_size, layer_params), z.max_live_parameters) * low
        kept = _kept_at_loss(shape, z) * per_element
        m = ZeroMemory(sharded / n + low * persistent, max(kept, shape.vocab * shape.hidden * low + gathered),
                       max(kept, gathered) + block_grads)
        if z.offload_param:
            m.host += sharded / n
            m.weights = low * persistent
    else:
        m = ZeroMemory(model_bytes, 0.0, block_grads)  # the whole model on every rank
    master = 4 * t / n  # fp32 masters of the trainable partition (DeepSpeed keeps them even for fp32 runs)
    # the optimizer steps those masters: flat partitions, so no 8-bit optimizer's small-tensor or per-parameter
    # override rule applies (optimizer_states.py `fp32_state_params` is not added here), and Adafactor sees vectors:
    # its second moment is whole
    moments = optimizer_state_bytes(w, fp32_masters=True, flat=True) * t / n
    m.states, m.grad_part = master + moments, low * t / n
    if z.offload_optimizer:
        _offload_optimizer(shape, w, n, z, m, master + moments)
    return m


def step_partition(shape: ModelShape, w: Workload, n: int, z: ZeroSettings) -> float:
    """Elements of the flat fp32 partition one optimizer.step() updates on one of `n` ranks. ZeRO-1/2 step each
    param group's flat partition (stage_1_and_2.py `step`: `single_partition_of_fp32_groups[i]`), nearly the whole
    rank's share (the HF Trainer's no-decay group holds only norms and biases). ZeRO-3 steps one sub-group at a time
    (stage3.py `_optimizer_step`); `_create_fp16_sub_groups` closes a sub-group once its parameters' partitions
    reach `sub_group_size` elements, so the largest is under that plus the largest parameter's partition."""
    part = trainable_params(shape, w) / n
    if z.stage < 3:
        return part
    return min(part, z.sub_group_size + largest_trainable(shape, w) / n)


def step_bytes(shape: ModelShape, w: Workload, n: int, z: ZeroSettings, m: ZeroMemory,
               g_rest: float) -> tuple[float, float]:
    """(gradients, optimizer temporary) bytes on the GPU while the optimizer steps, `g_rest` being what backward
    left (the 16-bit partition, ZeRO-3's reduce bucket, ZeRO-1/2 offload's staging buffer). Offloaded, the step
    runs on the host and leaves `g_rest` as it is.

    The fp32 gradient of the partition being stepped (`step_partition`) is made by flattening its 16-bit gradients
    and casting the flat copy (stage3.py `_prepare_fp32_grad_for_sub_group`, stage_1_and_2.py `step`:
    `self.flatten(...).to(fp32)`), so for a moment both exist. ZeRO-3's 16-bit partitions and reduce bucket are
    allocated once and stay; ZeRO-1/2 release the bucket at the end of backward (`_release_ipg_buffers`) and the
    16-bit partition before the step itself. A client torch AdamW (no optimizer section in the JSON,
    `ds_optimizer` off: the HF Trainer's `adamw_torch`, multi-tensor on a GPU) then allocates
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, one fp32 copy of the partition (torch/optim/adam.py
    `_multi_tensor_adam`), as does an optimizer section's torch AdamW (`torch_adam`); DeepSpeed's FusedAdam, torch's
    fused kernel (`fused_adamw`) and 8-bit AdamW update in place. Other optimizers: `step_copies`."""
    if z.offload_optimizer:
        return g_rest, 0.0
    p = step_partition(shape, w, n, z)
    low = compute_bytes(w)
    temp = 4 * p * step_copies(w, z)
    if z.stage == 3:
        return g_rest + 4 * p, max(temp, low * p)
    return 4 * p, max(temp, m.grad_part + low * p)


def step_copies(w: Workload, z: ZeroSettings) -> int:
    """fp32 copies of the stepped partition the optimizer's step allocates at once: an optimizer section's Adam is
    DeepSpeed's FusedAdam (none) or torch's foreach AdamW (`torch_adam`, one); a torch optimizer with a multi-tensor
    kernel (plan/optimizer_kinds.py `group_copies`: the client's, or one DeepSpeed builds by name, such as Adagrad)
    its group copies; one that loops over tensors (Adafactor) its `flat_copies`, the flat partition being the one
    tensor each step call sees (stage_1_and_2.py and stage3.py `_optimizer_step` hand the optimizer one group's,
    or one sub-group's, partition at a time, so no earlier tensor's `update` is still alive); bitsandbytes' kernels
    and fused ones none."""
    if z.ds_optimizer and w.optimizer == "adamw":
        return int(z.torch_adam)
    kind = kind_of(w)
    if w.multi_tensor_step:
        return kind.group_copies
    return 0 if w.bnb_optimizer else kind.flat_copies


def _offload_optimizer(shape: ModelShape, w: Workload, n: int, z: ZeroSettings, m: ZeroMemory,
                       states: float) -> None:
    """Host RAM holds the masters, the moments and their fp32 gradient. ZeRO-3 reduces the 16-bit gradient
    partition there too; ZeRO-1/2 keep none on the GPU, and stage each parameter's gradient through two buffers
    the size of the largest trainable parameter (one on the GPU, one on the host), with a 16-bit copy of the
    partition on the host."""
    low = compute_bytes(w)
    t = trainable_params(shape, w)
    # The whole partition's fp32 gradient, kept on the host for the CPU step (on the GPU the step makes one
    # sub-group's at a time: `step_bytes`)
    grad32 = 4 * t / n
    m.host += states + grad32
    m.host_optimizer = states + grad32
    m.states = 0.0
    if z.stage == 3:
        m.host += m.grad_part
        m.grad_part = 0.0
        return
    largest = largest_trainable(shape, w)
    m.host += low * t / n + low * largest
    m.staging = low * largest
    m.grad_part = 0.0  # the reduced gradient goes straight to the host's fp32 partition


def _tensors(b: Breakdown) -> float:
    return b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries
