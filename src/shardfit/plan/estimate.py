"""Analytic per-GPU memory of each strategy for a model shape, workload and hardware.

Bytes per parameter follow from the method and precision; sharding divides what the strategy shards by the world
size; activations follow from the tokens per micro-batch and the layer widths. What fake tensors cannot see on a
real GPU is added last (see `runtime_overhead`):
- CUDA context: 0.3-0.6 GiB per process on recent GPUs (PyTorch "CUDA semantics" notes; measured context sizes in
  pytorch/pytorch#20532 and NVIDIA's CUDA lazy-loading notes); 0.5 GiB is used.
- NCCL: communicator buffers of NCCL_BUFFSIZE (4 MiB default) per channel and peer (NCCL env docs); 0.5 GiB
  covers 8-GPU rings and trees.
- The caching allocator reserves more than it allocates (block rounding, fragmentation), and how much more
  depends on whether the card has room. When a card is full it frees every cached segment it can before it gives
  up, so what decides a fit is the reserve it cannot give back: free pieces of segments still in use.
  ALLOCATOR_RESERVE is that reserve as a fraction of the tensor peak, fitted to 58 public OOM messages of training
  runs; it is its own line (`allocator_reserve`). On a card with room nothing makes the cache give back what it
  freed: a successful run's max_memory_reserved() holds ALLOCATOR_CACHE more than its tensor peak, fitted to 25
  public sources of successful runs not near their card, each counted once. Both: bench/allocator_reserve.yaml and .py.
What the plan predicts, in PyTorch's terms: the tensor columns add up to torch.cuda.max_memory_allocated(); with
`allocator_reserve` to the least max_memory_reserved() the step fits in; `total` (with the CUDA context and NCCL's
buffers in `runtime_overhead`) to the least device memory it fits in, which decides `fits`. What a successful run
READS on a card with room (max_memory_reserved(), or nvidia-smi) is `peak_reading`: the tensors and the cache, at
most what the card leaves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardfit import method as methods
from shardfit import strategy as strategies
from shardfit.config.support import loss_chunk_rows
from shardfit.errors import PlannerBug
from shardfit.plan import experts, quant
from shardfit.plan.activations import (
    activation_bytes,
    forward_activation_bytes,
    logits_bytes,
    media_activation_bytes,
)
from shardfit.plan.adapters import lora_expert_params, lora_params, saved_params
from shardfit.plan.backward_temps import dequantize_bytes, expert_weight_grad_bytes, head_dequantize_bytes
from shardfit.plan.cards import card_of
from shardfit.plan.evaluation import eval_note, eval_parts
from shardfit.plan.fsdp1_grads import block_flat_grad_bytes, mixes_frozen_and_adapters
from shardfit.plan.fsdp_buffers import zero2_buffers, zero3_buffers
from shardfit.plan.hardware import Hardware
from shardfit.plan.in_flight import down_backward_bytes_per_token
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS, eight_bit_form
from shardfit.plan.optimizer_states import (
    model_state_bytes,
    optimizer_state_bytes,
    sharded_step_bytes,
    step_temp_bytes,
)
from shardfit.plan.precision import (
    compute_bytes,
    frozen_weight_bytes,
    saved_copy_bytes,
    trainable_bytes,
)
from shardfit.plan.reference_memory import reference_activation_bytes, reference_logits_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.weight_bytes import (
    block_weight_bytes,
    fsdp1_bnb_quant_state_bytes,
    head_weight_bytes,
    linear_weight_bytes,
    nf4_weights,
    quantized_head,
    stored_linear_bytes,
)
from shardfit.plan.workload import FULL_LOSSES, Workload

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
NCCL_GIB = 0.5
# The median over those OOM messages of reserved-but-unallocated / (allocated + the failed request), to 0.1 %;
# tests/test_allocator_reserve.py holds it to the data. Quartiles 0.7 % and 6.3 %, and 6.4 % at a failed request of
# 1 GiB or more: a step with a large allocation near its card's limit may need several times this.
ALLOCATOR_RESERVE = 0.017
# The median over sources (each source's median first) of successful training runs' max_memory_reserved() /
# max_memory_allocated() - 1, over the runs not near their card, whose peak the log caught and whose flooring moves
# the ratio by 5 points or less, to 0.1 %, an FSDP run's planned `stream_pool` taken out of its reserved first (it is
# added apart); tests/test_allocator_reserve.py holds it to the data. Quartiles 3.8 % and
# 20.9 %: Megatron's pre-training logs keep less (5.8 %), the other sources more (17 %). What the cache holds at the
# peak on a card with room; it decides no verdict.
ALLOCATOR_CACHE = 0.099
# The readings a published peak can be (bench/published_memory.yaml `reading`).
READINGS = ("allocated", "reserved", "total")


@dataclass
class Breakdown:
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    temporaries: float = 0.0
    # The caching allocator's reserve beyond the tensors that a full card cannot give back (fragmentation):
    # torch.cuda's memory_reserved() less memory_allocated() when the card is full (ALLOCATOR_RESERVE). On a card
    # with room the cache holds more (`peak_reading`), which decides nothing.
    allocator_reserve: float = 0.0
    runtime_overhead: float = 0.0  # the CUDA context and NCCL's buffers: outside the allocator
    total: float = 0.0
    # What a second stream's pool keeps reserved beyond the peak's tensors on a card with room (`stream_pool`):
    # FSDP's gradient shards, made on its reduce-scatter stream, whose cached blocks the compute stream cannot
    # reuse. Not in `total`: before a request fails the allocator frees every stream's cache and retries.
    stream_pool: float = 0.0


@dataclass
class Candidate:
    strategy: str
    fits: bool
    per_gpu_gib: Breakdown
    cpu_gib: float
    estimator: str = "analytic"
    notes: str = ""
    peak_phase: str = "forward"  # where the step peaks: forward (at the loss), backward, optimizer or eval
    # False where the hardware named cannot run the strategy at all (a multi-rank strategy on one device, GPU
    # offload or a split over GPUs on a CPU): the memory columns stay, but it is neither rated nor recommended.
    applies: bool = True
    extra: dict = field(default_factory=dict)
    # The time model's prediction (plan/timing.py): one optimizer step, the job's tokens/s, what bounds it.
    step_s: float | None = None
    tokens_per_s: float | None = None
    bound: str | None = None
    # Where the step's time goes, in seconds per optimizer step (compute_s, comm_s, pcie_s, host_s; parts the
    # engine overlaps overlap): `bound` is the largest.
    time_parts: dict[str, float] | None = None
    # A precomputed reference (DPO, KTO): seconds per training example of the one forward pass over the data that
    # runs once before the first step (the whole job's ranks sharing it); None without one.
    reference_pass_s: float | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["per_gpu_gib"] = {k: round(v, 3) for k, v in d["per_gpu_gib"].items()}
        d["cpu_gib"] = round(d["cpu_gib"], 3)
        d["step_s"] = None if self.step_s is None else round(self.step_s, 4)
        d["tokens_per_s"] = None if self.tokens_per_s is None else round(self.tokens_per_s, 1)
        d["reference_pass_s"] = None if self.reference_pass_s is None else float(f"{self.reference_pass_s:.4g}")
        if self.time_parts is not None:
            d["time_parts"] = {k: round(v, 4) for k, v in self.time_parts.items()}
        d.pop("extra")
        return d


def trainable_params(shape: ModelShape, w: Workload) -> int:
    if w.trains_adapters:
        tower = shape.audio.lora_params(w.lora_rank) if shape.audio is not None and w.audio_trainable else 0
        return lora_params(shape, w) + tower + saved_params(shape, w)
    if w.method == "freeze":
        return len(w.trained_blocks(shape.layers)) * shape.layer_params() + shape.hidden  # and the final norm
    return shape.params() - frozen_audio_params(shape, w) - frozen_vision_params(shape, w)


def frozen_vision_params(shape: ModelShape, w: Workload) -> int:
    """The Qwen-style vision tower a full or freeze fine-tune leaves frozen under freeze_vision_tower, its merger
    with it (models/adapters.py `_vision_trainable`): no gradient, no optimizer state. What the towers' count holds
    beyond the audio tower, which `frozen_audio_params` answers for."""
    if shape.vision is None or w.vision_trainable:
        return 0
    return shape.extra_params - (shape.audio.params() if shape.audio is not None else 0)


def trainable_weight_bytes(shape: ModelShape, w: Workload) -> float:
    """Bytes of the trainable weights, and of their gradients: `trainable_bytes` each, but peft's trained copies of
    whole modules (`saved_params`) in the dtype the tool leaves them in (`saved_copy_bytes`)."""
    saved = saved_params(shape, w)
    return float((trainable_params(shape, w) - saved) * trainable_bytes(w) + saved * saved_copy_bytes(w))


def frozen_audio_params(shape: ModelShape, w: Workload) -> int:
    """The audio tower's weights a full fine-tune leaves frozen: all of them under freeze_audio_tower, else its
    begin/end-of-audio embedding (it serves only the speech output, models/adapters.py)."""
    if shape.audio is None:
        return 0
    return shape.audio.params() if not w.audio_trainable else 2 * shape.audio.out


def state_bytes(shape: ModelShape, w: Workload, flat: bool = False) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for the whole model, before any sharding; the optimizer's over `flat`
    tensors (FSDP1's flat parameters: plan/optimizer_states.py `model_state_bytes`)."""
    p, t = shape.params(), trainable_params(shape, w)
    if w.method == "full":
        # fp32 master weights, cast per layer on the fly by autocast/FSDP; or, pure 16-bit, the weights themselves
        weights = p * float(trainable_bytes(w))
    else:
        frozen = p - (t if w.method == "freeze" else 0)
        linear = shape.decoder_linear_params()
        per_other = frozen_weight_bytes(w)
        stored = shape.over_blocks(lambda moe: linear_weight_bytes(shape, w, moe))
        weights = stored + (frozen - linear) * per_other + trainable_weight_bytes(shape, w)
        if quantized_head(shape, w):  # the LM head in 4-bit instead of the 16-bit copy counted with the rest
            weights += head_weight_bytes(shape, w) - shape.vocab * shape.hidden * per_other
    return weights, trainable_weight_bytes(shape, w), model_state_bytes(shape, w, t, flat=flat)


def planned_shape(shape: ModelShape, w: Workload) -> ModelShape:
    """The shape the recipe runs: with `untied_head`, a tied checkpoint's head is a copy of its own."""
    return replace(shape, tied=False) if w.untied_head and shape.tied else shape


def planned_workload(shape: ModelShape, w: Workload) -> Workload:
    """The workload as the rank runs it: `sdpa` (transformers' default) is eager for a class without SDPA
    (sdpa_classes.py `runs_eager`, the rule models/build.py loads by)."""
    return replace(w, attention="eager") if shape.eager_only and w.attention == "sdpa" else w


def no_sync_grad_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The unsharded gradients each rank holds between optimizer steps under FSDP1's no_sync() (`fsdp1_no_sync`,
    with `grad_accum` above 1 on a sharded strategy); 0 otherwise.

    FSDP1's post-backward hook reshards the parameter but, while gradients are not synchronised, returns before
    the reduce-scatter and leaves `.grad` as the unsharded gradient of the whole flat parameter, which the next
    micro-batch's backward accumulates into (torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`: "if
    not state._sync_gradients: ... return"; `_finalize_params`: ".grad remains the unsharded gradient from prior
    no_sync() iterations", pytorch/pytorch@00ae0bc9). Lightning Fabric's `no_backward_sync` under FSDP is
    `module.no_sync()` (src/lightning/fabric/strategies/fsdp.py `_FSDPBackwardSyncControl`). The gradient has the
    unsharded flat parameter's size and dtype, the dtype the forward ran in (MixedPrecision's param_dtype, or the
    weights' own under bf16-true). A flat parameter gets a gradient when any of its weights trains: a full
    fine-tune's every weight; LoRA's adapters alone when they are flat parameters of their own
    (use_orig_params=False, `flat_params`), else the whole wrapped block that holds them (use_orig_params=True
    flattens a block's frozen and trainable weights together)."""
    if not (w.fsdp1_no_sync and w.grad_accum > 1 and strategies.get(strategy).sharded):
        return 0.0
    low = compute_bytes(w)
    if w.method == "full":
        return float(shape.params() * low)
    if w.trains_adapters and not w.flat_params:
        return block_flat_grad_bytes(shape, w)
    return float(trainable_params(shape, w) * trainable_bytes(w))


def qlora_shard_problem(shape: ModelShape, w: Workload, world: int) -> str | None:
    """Why QLoRA's NF4 weights of `shape` cannot be split into `world` row shards (what the check rule
    qlora_shard_layout refuses before training), or None."""
    if w.method != "qlora":
        return None
    for _, r, c in nf4_weights(shape, w):
        problem = quant.shard_problem(r, c, world)
        if problem:
            return f"a {r}x{c} weight: {problem}"
    return None


def loss_chunk_for(setting: int | str, vocab: int, hw: Hardware, precision: str) -> int:
    """Rows per chunk of the chunked loss: `loss_chunk` as set, or `auto` for `vocab` on `hw`'s card."""
    return loss_chunk_rows(setting, vocab, card_of(hw).compute_bound_rows(precision))


def with_loss_chunk(shape: ModelShape, w: Workload, hw: Hardware) -> Workload:
    """`w` with the rows of its chunked loss decided as a run on `hw` decides `loss_chunk: auto`."""
    if w.loss_chunk:
        return w
    return replace(w, loss_chunk=loss_chunk_for("auto", shape.vocab, hw, w.precision))


def estimate(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> Candidate:
    """Per-GPU peak memory of `strategy` (the most loaded GPU) and whether it fits.

    The step is estimated at its three candidate peaks: the loss at the end of the forward pass (all saved
    activations and the loss's buffers), backward (gradients filling while activations are released) and the
    optimizer step (gradients, states and the multi-tensor update's temporary). The largest is the peak, and its
    breakdown is the one reported, so the columns add up to what is allocated at one moment."""
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    s = strategies.get(strategy)
    rank = per_rank(shape, w, hw, s)
    candidates = step_candidates(shape, w, strategy, rank)
    moments = {k: max(v, key=_tensors) for k, v in candidates.items()}
    phase = max(moments, key=lambda k: _tensors(moments[k]))
    gathered = rank.gathered if hw.world > 1 else 0.0
    pool = stream_pool(candidates, moments[phase], grads_on_own_stream(shape, w, hw, s), gathered)
    b = in_gib(moments[phase])
    b.stream_pool = pool / GIB
    add_runtime_overhead(b, hw, strategy)
    at_eval = phase == "eval"
    fits, notes = _verdict(shape, w, hw, s, b, rank.cpu, at_eval)
    notes = "; ".join(n for n in (eval_note(shape, w, rank.ranks, at_eval), notes) if n)
    not_here = not_applicable(s, hw, w)  # a row the hardware or the job's split cannot run says why instead
    return Candidate(strategy, fits, b, rank.cpu / GIB, peak_phase=phase, notes=not_here or notes,
                     applies=not not_here)


@dataclass
class PerRank:
    """What one rank holds under a strategy, in bytes: its part of the model states, what it keeps in host RAM
    (offload), the blocks whose activations its GPU saves, and the strategy's transient buffers."""

    weights: float
    grads: float
    optimizer: float
    cpu: float = 0.0
    layers: int = 0
    foreach: float = 0.0  # what the optimizer's step allocates on this rank (`step_temp_bytes`)
    fwd_temp: float = 0.0
    bwd_temp: float = 0.0
    persistent_grads: bool = False  # DDP's gradient buckets live for the whole run
    # FSDP1 under CPU offload: the reduce-scattered gradient shards still on the GPU when backward ends
    # (`fsdp1_offload_grad_shard_bytes`); they are on the host by the optimizer step.
    held_grad_shards: float = 0.0
    grad_divisor: float = 1  # how many ways the gradients are split
    ranks: int = 1  # the processes an evaluation gathers its logits from
    # FSDP FULL_SHARD: the most the pool of the stream it gathers under holds (FSDP1's unshard stream: the gathered
    # flat parameters; FSDP2's copy-in stream: its all-gather outputs), which that pool keeps reserved while
    # nothing is gathered (`stream_pool`); 0 where nothing is gathered.
    gathered: float = 0.0
    # An engine whose gradients live in buffers of its own (DeepSpeed ZeRO: plan/deepspeed.py) says what it holds
    # at each moment; without one, `gradient_timeline` follows the gradient tensors.
    timeline: GradientTimeline | None = None
    loss_grad_temp: float = 0.0  # what the engine allocates besides when the loss's gradient is made
    freed_by_end: float = 0.0  # what `bwd_temp` holds that backward has freed by its end (zero2's gathered blocks)
    start_temp: float = 0.0  # what the engine gathers at forward's start, before any activation exists (zero3)


@dataclass(frozen=True)
class GradientTimeline:
    """The gradient bytes one rank holds at each moment of the step `step_candidates` weighs."""

    forward: float  # from the loss to backward's start
    loss: float  # at the loss's gradient
    blocks: float  # while the blocks run backward
    end: float  # at the input embedding's gradient, the end of backward
    step: float  # while the optimizer steps
    between: float  # between steps, where an evaluation runs


def gradient_timeline(shape: ModelShape, w: Workload, strategy: str, r: PerRank) -> GradientTimeline:
    """The gradients' timeline of a strategy whose gradients are plain tensors (or DDP's buckets): `r.timeline`
    where the engine gave one, else what the tensors make it. Gradients accumulate over micro-batches and DDP's
    buckets live for the whole run; a full fine-tune's untied input embedding makes its gradient last, at the end
    of backward."""
    if r.timeline is not None:
        return r.timeline
    g_fwd = r.grads if w.grad_accum > 1 or r.persistent_grads else 0.0
    embedding_grad = shape.vocab * shape.hidden * 4 if w.method == "full" and not shape.tied else 0.0
    # Under FSDP1's no_sync() the micro-batches before the optimizer step's hold every unsharded gradient instead,
    # through their forward and their backward (the last micro-batch's reduce-scatters replace them by shards
    # block by block, so it holds no more); the optimizer step sees the shards alone.
    # (never below nothing: an offloaded run holds no gradient on the GPU to take it from)
    g_end = max(0.0, r.grads - embedding_grad / r.grad_divisor) + r.held_grad_shards
    unsharded_grads = no_sync_grad_bytes(shape, w, strategy)
    if unsharded_grads:
        g_fwd = g_end = max(r.grads, unsharded_grads)
    # between steps: gradients freed by zero_grad(set_to_none), an engine's own buffers kept
    between = r.grads if r.persistent_grads else 0.0
    return GradientTimeline(g_fwd, g_fwd, g_fwd, g_end, r.grads, between)


def gathered_block_bytes(shape: ModelShape, w: Workload) -> float:
    """One block's weights as a sharded strategy gathers them: in the compute dtype, as FSDP's MixedPrecision
    gathers param_dtype over fp32 masters and over a model loaded in fp32 (`loaded_fp32`); QLoRA's NF4 as stored."""
    if w.method == "full":
        return shape.layer_params() * compute_bytes(w)
    return block_weight_bytes(shape, replace(w, loaded_fp32=False))


def per_rank(shape: ModelShape, w: Workload, hw: Hardware, s: strategies.Strategy) -> PerRank:
    """The model states one rank holds under `s`, and the buffers its engine adds around each block."""
    n = hw.world
    weights, grads, optim = state_bytes(shape, w, flat=s.sharded and w.runs_fsdp1)  # FSDP1: flat parameters
    t_all = trainable_params(shape, w)
    low = compute_bytes(w)
    # expert_parallel: the routed experts, 1/N of them on each rank and outside the strategy (plan/experts.py)
    ep = experts.applies(w, shape, s.engine, s.offload)
    block_experts = expert_block_bytes(shape, w) if ep else 0.0
    stored = block_experts / experts.per_block_params(shape) if ep else 0.0
    ex = experts.expert_states(shape, w, stored, trainable_bytes(w), optimizer_state_bytes(w),
                               lora_expert_params(shape, w)) if ep else (0.0, 0.0, 0.0)
    weights, grads, optim = weights - ex[0], grads - ex[1], optim - ex[2]
    if s.sharded and mixes_frozen_and_adapters(w):  # the blocks' flat gradients span their frozen weights
        grads = block_flat_grad_bytes(shape, w)
    layer_16 = gathered_block_bytes(shape, w)
    # bitsandbytes' quant states under FSDP1: whole on every rank, never gathered (`fsdp1_bnb_quant_state_bytes`)
    layer_16 -= fsdp1_bnb_quant_state_bytes(shape, w)
    quant_states = fsdp1_bnb_quant_state_bytes(shape, w, whole_model=True) if s.sharded else 0.0
    weights -= quant_states
    if ep:  # FSDP2 gathers a block without its routed experts (as it stores them: NF4 under QLoRA)
        layer_16 -= experts.per_block_params(shape) * low if w.method == "full" else block_experts
    root_16 = (shape.embed_params() + shape.hidden) * low
    own_embedding_16 = 0 if shape.tied else shape.vocab * shape.hidden * low
    # FSDP1 runs wrap the decoder blocks only (Lightning's {Block}, accelerate's TRANSFORMER_BASED_WRAP), so an
    # untied input embedding is in the root unit, which FSDP1 never frees after forward (torch/distributed/fsdp/
    # _runtime_utils.py `_post_forward_reshard`: "Do not free the root's parameters in the post-forward for
    # FULL_SHARD"; the root's pre-backward unshard then finds it gathered): held from the first forward to the
    # root's post-backward reshard, once (FSDP1 gathers into the flat parameter itself). Forward adds it to
    # FSDP2's layout, which frees the embedding unit after it runs; backward already counts one embedding (FSDP2
    # gathers its unit again for its gradient), which under FSDP1 is this same copy.
    embedding_in_root = own_embedding_16 if w.runs_fsdp1 else 0
    # Unsharded gradients of one block before its reduce-scatter: only trainable weights have them.
    layer_grads = shape.layer_params() * low if w.method == "full" else t_all / shape.layers * trainable_bytes(w)
    if ep and w.method == "full":
        layer_grads -= experts.per_block_params(shape) * low
    r = PerRank(0.0, 0.0, 0.0, layers=shape.layers, ranks=n if s.multi_rank else 1)
    if s.engine in ("plain", "ddp"):
        div_w = div_g = div_o = 1
        r.persistent_grads = s.engine == "ddp" and n > 1
    elif s.sharded:  # zero2, zero3, zero3_offload: FSDP stores all three sharded
        div_w = div_g = div_o = n
        r.foreach = sharded_step_bytes(shape, w, t_all, n, flat=w.runs_fsdp1)
        if s.shards_params:
            zero3_buffers(shape, w, r, root_16=root_16, own_embedding_16=own_embedding_16, layer_16=layer_16,
                          layer_grads=layer_grads, embedding_in_root=embedding_in_root)
        else:
            zero2_buffers(shape, w, n, r, root_16=root_16, own_embedding_16=own_embedding_16, layer_16=layer_16,
                          layer_grads=layer_grads)
        if s.offload:
            r.cpu = weights / n + grads / n + optim / n
            held = fsdp1_offload_grad_shard_bytes(shape, w, grads / n)
            weights = grads = optim = r.foreach = 0.0
            div_w = div_g = div_o = 1
            staging, grad_shard = offload_staging_bytes(shape, w, n)
            r.fwd_temp += staging
            r.bwd_temp += staging + grad_shard
            r.held_grad_shards = held
    else:  # model_parallel: one process, blocks split over the node's GPUs, one GPU computes at a time
        g = hw.gpus_per_node
        share = (-(-shape.layers // g)) / shape.layers
        div_w = div_g = div_o = 1 / share if g > 1 else 1
        r.layers = -(-shape.layers // g)
    n_ep = w.expert_parallel if ep else 1
    r.weights, r.grads, r.optimizer, r.grad_divisor = (weights / div_w + ex[0] / n_ep + quant_states,
                                                       grads / div_g + ex[1] / n_ep, optim / div_o + ex[2] / n_ep,
                                                       div_g)
    r.weights += shape.audio.buffer_bytes() if shape.audio is not None else 0  # buffers are never sharded/offloaded
    if not s.sharded:  # plain tensors: one multi-tensor temporary over what this GPU trains
        r.foreach = step_temp_bytes(shape, w, r.grads / trainable_bytes(w))
    return r


def expert_block_bytes(shape: ModelShape, w: Workload) -> float:
    """One mixture-of-experts block's routed experts as stored (`state_bytes` counts them so): a full fine-tune's
    fp32 masters (or pure 16-bit weights), else as `stored_linear_bytes` stores them (QLoRA's NF4 stacks, or the
    compute dtype)."""
    if w.method == "full":
        return float(experts.per_block_params(shape) * trainable_bytes(w))
    return stored_linear_bytes(shape, w, True, experts_only=True)


def offload_staging_bytes(shape: ModelShape, w: Workload, n: int) -> tuple[float, float]:
    """What FSDP2's CPU offload (CPUOffloadPolicy) keeps on the GPU beside the gathered block, per rank: (staging,
    gradient shard). Before a unit's all-gather each rank copies its shard from pinned host memory to the GPU as
    stored (a full fine-tune's fp32 masters) and casts it to the compute dtype for the all-gather's input
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`), for the unit that computes and the
    one prefetched ahead of it; after a unit's reduce-scatter its fp32 gradient shard waits on the GPU until the
    copy to the host has run (_fsdp_collectives.py `foreach_reduce`). The host's pinned buffers are host RAM.

    FSDP1 (`runs_fsdp1`) holds neither beside a computing unit: (0, 0). It copies a unit's shard to the GPU in its
    pre-unshard and drops the copy before the unit computes (torch/distributed/fsdp/_flat_param.py `pre_unshard` ->
    `flat_param_to` or `_use_low_precision_shard`; `unshard` then points the flat parameter at the gathered buffer
    and `post_unshard` frees `_mp_shard`, all inside _runtime_utils.py `_unshard`), and it keeps every gradient
    shard until backward ends instead (`fsdp1_offload_grad_shard_bytes`)."""
    if w.runs_fsdp1:
        return 0.0, 0.0
    low = compute_bytes(w)
    layer = shape.layer_params()
    if w.method == "full":  # the stored shard, and its cast where the masters are wider than the compute dtype
        stored = trainable_bytes(w)
        per_unit = layer * (stored + (low if stored != low else 0)) / n
    else:  # frozen weights are stored as they compute (NF4 as NF4): the copy alone
        per_unit = (block_weight_bytes(shape, w) - fsdp1_bnb_quant_state_bytes(shape, w)) / n
    grads = (layer if w.method == "full" else trainable_params(shape, w) / shape.layers) * 4.0 / n
    return 2 * per_unit, grads


def fsdp1_offload_grad_shard_bytes(shape: ModelShape, w: Workload, shards: float) -> float:
    """What FSDP1 under CPU offload (CPUOffload(offload_params=True)) still holds on the GPU of `shards`, the
    rank's gradient shards of every trainable weight (bytes), when the input embedding's gradient is made at the
    end of backward; 0 for FSDP2 (`runs_fsdp1` False).

    Each unit's post-backward hook reduce-scatters its flat gradient into a new padded shard on the GPU and keeps
    it as `flat_param._saved_grad_shard` (torch/distributed/fsdp/_runtime_utils.py `_reduce_grad`,
    `_accumulate_sharded_grad`: "flat_param._saved_grad_shard = sharded_grad"); `_offload_grad` copies it into the
    pinned `_cpu_grad` without dropping it. Only the post-backward final callback lets it go, through
    `_finalize_params` -> FlatParamHandle.prepare_gradient_for_optim (_flat_param.py: `.grad` becomes
    `_cpu_grad`, then `delattr(flat_param, "_saved_grad_shard")`). So the shards pile up on the GPU through
    backward, in the flat parameter's dtype (`_cast_grad_to_param_dtype`), all of them but the root unit's, whose
    hook runs after the embedding's gradient: a full fine-tune's embedding, final norm and head are in the root
    (FSDP1 runs wrap the decoder blocks, `embedding_in_root`)."""
    if not w.runs_fsdp1:
        return 0.0
    total = trainable_params(shape, w)
    if not total:
        return 0.0
    root = shape.embed_params() + shape.hidden if w.method == "full" else 0
    return shards * max(0, total - root) / total


def step_moments(shape: ModelShape, w: Workload, strategy: str, r: PerRank) -> dict[str, Breakdown]:
    """The step at its three candidate peaks (bytes): the loss (forward), the worst moment of backward, and the
    optimizer step; and an evaluation while training where the job runs one (plan/evaluation.py)."""
    return {k: max(v, key=_tensors) for k, v in step_candidates(shape, w, strategy, r).items()}


def step_candidates(shape: ModelShape, w: Workload, strategy: str, r: PerRank) -> dict[str, list[Breakdown]]:
    """Every moment `step_moments` weighs (bytes), by phase: backward's three (the loss's gradient, the last
    block's backward, the input embedding's gradient), one of each other phase, and an evaluation's worst."""
    tokens = w.tokens
    layers = r.layers
    g = gradient_timeline(shape, w, strategy, r)
    residual_grads = tokens * shape.hidden * 4 * 2  # the gradient of the residual stream flowing back, fp32
    # The down projection's backward moment. A sharded full fine-tune's is not modelled: its `bwd_temp` is the
    # block's end, with the block's whole unsharded gradients, FSDP's worst, and that moment stands alone. Under
    # adapters those gradients are small and the moment is the block's gathered weights (`bwd_temp`) beside the
    # three MLP-wide gradients (measured with plan --simulate: tiny zero3 LoRA -4.3 % -> +0.8 %).
    down_bwd = 0.0 if strategies.get(strategy).sharded and w.method == "full" else \
        down_backward_bytes_per_token(shape, w, strategy)
    # QLoRA: a linear layer's backward dequantizes its weight again (the gradient of its input needs it). The
    # same dequantization in forward never peaks: at that moment backward's gradients and the loss's buffers do
    # not exist yet. In a dense block the down projection's backward comes first: by then the recomputation's
    # transients and down's input are gone (the adapter, recorded after the base matmul, made its gradients
    # first), so its moment has the block's activations as they stand at down's backward; the other linears
    # come later, with less saved (measured with plan --simulate). Elsewhere the block's every activation stays.
    # An expert stack's weight gradient comes at another moment of the block's backward than its linears'
    # dequantization: the larger of the two.
    dequant = dequantize_bytes(shape, w, strategy)
    dense = bool(dequant and layers and down_backward_bytes_per_token(shape, w, strategy))
    bwd_temp = r.bwd_temp + max(0.0 if dense else dequant, expert_weight_grad_bytes(shape, w, strategy))
    # The fp32 logits a loop keeps through backward and the optimizer step (`keeps_logits`, full losses only).
    held = tokens * shape.vocab * 4.0 if w.keeps_logits and w.loss in FULL_LOSSES else 0.0
    # The images' pixels and the clips' features (and trainable towers' saved activations) stay until backward
    # reaches the towers, which it does last.
    vision = media_activation_bytes(shape, w, strategy)
    wr, opt, fwd_temp = r.weights, r.optimizer, r.fwd_temp
    tied_pending, tied_sum = tied_gradient_sum(shape, w, strategy, r)
    forward = Breakdown(wr, g.forward, opt, forward_activation_bytes(shape, w, layers, strategy) + vision,
                        logits_bytes(shape, w, strategy), fwd_temp)
    if w.reference == "adapters_off":  # the reference's forward runs first, on the same weights, saving nothing
        forward = max(forward, Breakdown(wr, g.forward, opt, reference_activation_bytes(shape, w, strategy) + vision,
                                         reference_logits_bytes(shape, w), fwd_temp), key=_tensors)
    moments = {
        # Without checkpointing, long packed rows peak inside the body: its mask and the last block's down
        # projection outweigh the loss's chunk. A sharded engine's gathering at forward's start stands alone.
        "forward": [forward] + ([Breakdown(wr, g.forward, opt,
                                           forward_activation_bytes(shape, w, layers, strategy, "body") + vision,
                                           0.0, fwd_temp)] if w.grad_ckpt == "none" and layers else [])
                   + ([Breakdown(wr, g.forward, opt, vision, 0.0, r.start_temp)] if r.start_temp else []),
        # Backward: the loss's gradient (a full loss only; the blocks are not recomputed yet), the last block's
        # backward (every activation saved, the recomputed block's included) and its end (every gradient made).
        "backward": [
            Breakdown(wr, g.loss, opt, forward_activation_bytes(shape, w, layers, strategy, "backward") + vision,
                      logits_bytes(shape, w, strategy, "backward") + held,
                      fwd_temp + head_dequantize_bytes(shape, w) + r.loss_grad_temp),
            Breakdown(wr, g.blocks, opt, activation_bytes(shape, w, layers, strategy) + vision, held,
                      bwd_temp + residual_grads),
            # The block alive at its down projection's backward: three MLP-wide gradients at once, with the
            # residual stream's gradient (one tensor, where `residual_grads` takes a block's end with two). QLoRA's
            # dequantized weight is gone by then: the base layer's matmul, its last reader, made its gradient.
            *([Breakdown(wr, g.blocks, opt,
                         activation_bytes(shape, w, layers, strategy, at_down_backward=True) + vision, held,
                         r.bwd_temp + tokens * down_bwd)] if down_bwd and layers else []),
            # QLoRA's dequantized down weight, with the gradient of down's input its adapter made.
            *([Breakdown(wr, g.blocks, opt,
                         activation_bytes(shape, w, layers, strategy, at_down_backward=True) + vision, held,
                         r.bwd_temp + dequant + residual_grads)] if dense else []),
            # The input embedding's gradient comes last, after the first block has released its activations.
            Breakdown(wr, g.end, opt, activation_bytes(shape, w, 1, strategy) + vision, held,
                      bwd_temp - r.freed_by_end + residual_grads),
            # A tied head's gradient meets the embedding's once every block has run backward: the blocks' saved
            # and temporary tensors are gone, the residual stream's gradient (one tensor) feeds the embedding.
            *([Breakdown(wr, g.end - tied_pending, opt, vision, held, residual_grads / 2 + tied_sum)]
              if tied_sum else [])],
        "optimizer": [Breakdown(wr, g.step, opt + r.foreach, 0.0, held, 0.0)],
    }
    if w.eval_batch:  # between steps
        moments["eval"] = [max((Breakdown(wr, g.between, opt, a, lg, fwd_temp)
                                for a, lg in eval_parts(shape, w, strategy, r.ranks)), key=_tensors)]
    return moments


def tied_gradient_sum(shape: ModelShape, w: Workload, strategy: str, r: PerRank) -> tuple[float, float]:
    """A full fine-tune of a model whose head shares the input embedding, at the embedding's gradient: (what the
    shared weight's .grad does not hold yet, the temporaries). Autograd keeps the head's gradient in the weight's
    input buffer from the loss on and, when the embedding's arrives at the end of backward, adds the two out of
    place: three vocab x hidden gradients at once, the .grad made only after (unless an earlier micro-batch or
    DDP's bucket holds it). On one process and under DDP; a sharded strategy's end of backward is its own
    (`bwd_temp`), and a DeepSpeed engine's gradients follow its timeline."""
    if w.method != "full" or not shape.tied or strategies.get(strategy).sharded or r.timeline is not None:
        return 0.0, 0.0
    one = shape.vocab * shape.hidden * trainable_bytes(w)
    return (0.0 if w.grad_accum > 1 or r.persistent_grads else one), 3.0 * one


def grads_on_own_stream(shape: ModelShape, w: Workload, hw: Hardware, s: strategies.Strategy) -> bool:
    """Whether the gradient column of every moment is FSDP's gradient shards, made on a stream of their own: a
    sharded strategy's reduce-scatter output (FSDP1 `_reduce_grad` allocates `new_sharded_grad` under its
    post-backward stream; FSDP2 `foreach_reduce` its reduce-scatter output under the reduce-scatter stream, "the GPU
    sharded gradient is allocated in the RS stream"). Not under no_sync(), whose unsharded gradients autograd
    makes on the compute stream (`no_sync_grad_bytes`), nor where expert parallelism keeps experts' gradients
    outside FSDP (plan/experts.py)."""
    if not s.sharded or hw.world < 2 or experts.applies(w, shape, s.engine, s.offload):
        return False
    return not (w.fsdp1_no_sync and w.grad_accum > 1)


def stream_pool(candidates: dict[str, list[Breakdown]], peak: Breakdown, shards: bool, gathered: float) -> float:
    """Bytes that other streams' pools add to a reading beyond `peak`'s tensors, on a card with room: the
    gradient shards' (`shards`: every moment's gradient column is theirs) and the pool FSDP gathers into (FSDP1's
    unshard stream, FSDP2's all-gather copy-in stream), which holds `gathered` at most.

    PyTorch's caching allocator serves a request only with a cached block of the request's stream
    (c10/cuda/CUDACachingAllocator.cpp `get_free_block`: a block whose `stream` is not the request's is no match),
    so each stream's pool keeps its own worst moment reserved: the compute stream's most, at whichever moment
    (every `candidates` moment less its gradient shards), and the shards' most. In one stream the shards would
    reuse the activations backward frees; here they cannot. The gathered weights are in every moment's tensors but
    the optimizer step's; there the unshard pool's blocks sit idle beside the step (counted there only: elsewhere
    part of them is in use, so this is the least it adds)."""
    every = [(m, gathered if phase == "optimizer" else 0.0) for phase, ms in candidates.items() for m in ms]
    own = max(_tensors(m) - (m.grads if shards else 0.0) + idle for m, idle in every)
    own += max(m.grads for m, _ in every) if shards else 0.0
    return max(0.0, own - _tensors(peak))


def in_gib(b: Breakdown) -> Breakdown:
    """`b`'s tensor columns from bytes to GiB (in place; the runtime overhead is added in GiB afterwards)."""
    for f in ("weights", "grads", "optimizer", "activations", "logits", "temporaries"):
        setattr(b, f, getattr(b, f) / GIB)
    return b


def _verdict(shape: ModelShape, w: Workload, hw: Hardware, s: strategies.Strategy, b: Breakdown,
             cpu: float, at_eval: bool = False) -> tuple[bool, str]:
    """Whether the strategy fits (its peak in GPU memory, its offloaded shards in host RAM, the layouts QLoRA and
    model_parallel allow), and the note that says why or how much room is left."""
    n = hw.world
    fits = b.total <= hw.gpu_mem_gib
    notes = ""
    host_gib = cpu / GIB * hw.gpus_per_node
    if s.offload and hw.cpu_mem_gib is not None and host_gib > hw.cpu_mem_gib:
        fits = False
        notes = f"host RAM too small for offloaded shards: {host_gib:.0f} GiB per node needed"
    if s.engine == "device_map" and hw.nodes > 1:
        fits, notes = False, "model_parallel splits one process over one node's GPUs; use zero3 across nodes"
    if not methods.get(w.method).allows(s.engine):
        fits, notes = False, "QLoRA's 4-bit weights are not trained split over GPUs; use zero3 (check: " \
                             "qlora_split_over_devices)"
    shard_problem = qlora_shard_problem(shape, w, n) if s.sharded else None
    if shard_problem:
        fits, notes = False, f"QLoRA's 4-bit weights cannot be sharded over {n} GPUs: {shard_problem} (check: " \
                             "qlora_shard_layout)"
    return fits, notes or _note(s, b, hw, w, at_eval)


def not_applicable(s: strategies.Strategy, hw: Hardware, w: Workload | None = None) -> str | None:
    """Why the hardware named cannot run `s` at all, or None when it can. shardfit runs a multi-rank strategy in
    one process as `single` (parallel/env.py: one process is never a process group), and on a CPU there is no
    device memory to offload from and no GPUs to split layers over. A job whose rows are split over ranks (`w`'s
    sequence_parallel) needs a multi-rank strategy (resolve/sequence.py `check_layout` refuses the others)."""
    cpu = hw.name == "cpu"
    if s.multi_rank and hw.world == 1:
        return (f"n/a on one {hw.unit}: needs several ranks (shardfit train --nproc N"
                f"{'' if cpu else ' on N GPUs'}); one process runs it as single")
    if w is not None and w.sequence_parallel > 1 and not s.multi_rank:
        return (f"n/a with sequence_parallel {w.sequence_parallel}: a row split over ranks needs a multi-rank "
                "strategy (ddp, zero2, zero3)")
    if cpu and s.offload:
        return "n/a on a CPU: there is no GPU memory to offload from (zero3 is the same without the copies)"
    if cpu and s.engine == "device_map":
        return "n/a on a CPU: there are no GPUs to split the layers over (it runs as single)"
    if s.engine == "device_map" and hw.gpus_per_node == 1:
        return "n/a on one GPU: there is no other GPU to split the layers over (it runs as single)"
    return None


def _tensors(b: Breakdown) -> float:
    return b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries


def check_not_negative(b: Breakdown, what: str) -> None:
    """PlannerBug where a part of `b` is below zero: one path subtracted what another did not count. It would let a
    plan that cannot run read as fitting, so it is a bug, never clamped (a pipeline stage's breakdown as much as a
    strategy's)."""
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries"):
        if getattr(b, part) < -1e-9:
            raise PlannerBug(f"internal error: {what} has {getattr(b, part):.3f} GiB of {part}, below zero (two of "
                             "the planner's paths count the same bytes differently); please report it with the "
                             "command line")


def add_runtime_overhead(b: Breakdown, hw: Hardware, strategy: str) -> None:
    """Fill in what a real GPU adds to the tensor peak (GiB) and the total: the allocator's reserve (its own line),
    the CUDA context, and NCCL buffers when several ranks of the strategy talk (`runtime_overhead`)."""
    check_not_negative(b, f"the plan of {strategy}")
    tensors = _tensors(b)
    talks = hw.world > 1 and strategies.get(strategy).multi_rank
    b.allocator_reserve = tensors * ALLOCATOR_RESERVE
    b.runtime_overhead = CUDA_CONTEXT_GIB + (NCCL_GIB if talks else 0.0)
    b.total = tensors + b.allocator_reserve + b.runtime_overhead


def peak_reading(b: Breakdown, gpu_gib: float, reading: str = "reserved") -> float:
    """What a run of breakdown `b` (GiB) reads at its peak on a card of `gpu_gib` when it succeeds: `allocated`
    torch.cuda.max_memory_allocated() (the tensors), `reserved` max_memory_reserved() (the tensors and the cache,
    ALLOCATOR_CACHE of them, and a second stream's pool, `stream_pool`) and `total` that and the runtime, as
    nvidia-smi shows the device. The cache is capped by the card: before a request fails the allocator frees
    cached segments and retries, so a run near its card reads what the card leaves after the runtime, never less
    than the verdict's reserve needs."""
    if reading not in READINGS:
        raise ValueError(f"reading {reading!r}: one of {', '.join(READINGS)}")
    tensors = b.total - b.runtime_overhead - b.allocator_reserve
    if reading == "allocated":
        return tensors
    room = max(gpu_gib - b.runtime_overhead, tensors + b.allocator_reserve)
    reserved = min(tensors * (1 + ALLOCATOR_CACHE) + b.stream_pool, room)
    return reserved if reading == "reserved" else reserved + b.runtime_overhead


# What lowers each part of the peak, for the note of a strategy that does not fit.
EIGHT_BIT = "the optimizer's 8-bit form"  # named by `lowers` for the job's own optimizer
LOWERS = {"weights": ("sharding (zero3)", "LoRA", "QLoRA"), "grads": ("sharding (zero2/zero3)", "LoRA"),
          "optimizer": ("sharding (zero2/zero3)", "LoRA", EIGHT_BIT),
          "activations": ("gradient checkpointing", "a smaller micro-batch", "shorter sequences"),
          "logits": ("a smaller micro-batch", "shorter sequences", "the chunked loss"),
          "temporaries": ("a smaller micro-batch",)}


def lowers(part: str, w: Workload) -> str | None:
    """What lowers `part` of the peak, less what the run already does: a run training adapters is not told to
    use LoRA, a QLoRA run QLoRA, a checkpointed run checkpointing, a micro-batch of one a smaller one, nor the
    chunked loss's run that loss; an 8-bit optimizer only where the job's own has one (plan.py
    `eight_bit_offer`'s rule), named by its label. None where nothing is left."""
    done = {"LoRA"} if w.trains_adapters else set()
    if w.method == "qlora":
        done.add("QLoRA")
    if w.grad_ckpt == "full":
        done.add("gradient checkpointing")
    if w.micro_batch == 1:
        done.add("a smaller micro-batch")
    if w.loss not in FULL_LOSSES:
        done.add("the chunked loss")
    eight_bit = eight_bit_form(w.optimizer, w.no_8bit_form)
    left = [OPTIMIZER_KINDS[eight_bit].label if x == EIGHT_BIT and eight_bit else x for x in LOWERS[part]
            if x not in done and (x != EIGHT_BIT or eight_bit)]
    if not left:
        return None
    return left[0] if len(left) == 1 else f"{', '.join(left[:-1])} or {left[-1]}"


def largest_part(b: Breakdown) -> tuple[str, float]:
    """The part of the peak (weights, grads, optimizer, activations, logits, temporaries) that is largest."""
    return max(((k, getattr(b, k)) for k in LOWERS), key=lambda kv: kv[1])


def _note(s: strategies.Strategy, b: Breakdown, hw: Hardware, w: Workload, at_eval: bool = False) -> str:
    """Why a strategy does not fit and what lowers its largest part, or how much room it leaves. At an eval peak
    (`at_eval`) the evaluation's own note says what lowers it; the training's remedies would not."""
    cap = hw.gpu_mem_gib
    unit = hw.unit
    if b.total > cap:
        part, gib = largest_part(b)
        replica = f"full replica per {unit}: " if s.engine in ("plain", "ddp") else ""
        if s.engine == "ddp" and (ep := w.expert_parallel) > 1:  # every weight but the routed experts' (1/ep)
            replica = f"replica with 1/{ep} of the experts per {unit}: "
        if part == "weights" and gib > cap:
            return f"{replica}weights alone need {gib:.0f} GiB of {cap:.0f} GiB"
        if at_eval and part not in ("weights", "grads", "optimizer"):
            return f"{replica}{b.total:.1f} GiB of {cap:.0f} GiB at evaluation; largest part: {part} {gib:.1f} GiB"
        fix = lowers(part, w)
        if fix and (s.shards_params or (s.sharded and part != "weights")):  # sharded already: more ranks share it
            fix = fix.replace("sharding (zero2/zero3)", "more GPUs").replace("sharding (zero3)", "more GPUs")
        if s.sharded and not s.shards_params and part == "temporaries":  # zero2's gathered model (`per_rank`)
            fix = "zero3, which gathers one block at a time where zero2 keeps the whole model gathered"
        said = f"{replica}{b.total:.1f} GiB of {cap:.0f} GiB; largest part: {part} {gib:.1f} GiB"
        return f"{said} (lowered by {fix})" if fix else said
    if s.engine == "plain" and hw.world > 1:
        return f"uses one {unit} only"
    if s.offload:
        return "params, grads and optimizer state in host RAM (PCIe traffic every step)"
    if s.engine == "device_map":
        return "layers split over local GPUs; one GPU computes at a time"
    return f"{cap - b.total:.1f} GiB headroom"
