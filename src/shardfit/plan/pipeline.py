"""The plan of a pipeline (`pipeline_parallel: N`, each stage on one GPU or on `dp` data-parallel GPUs under a
strategy): where the decoder is cut, each stage's memory, the bubble of the 1F1B schedule, the point-to-point
traffic of the activations and each stage's gradient reduction over its replicas, in one optimizer step.
Torch-free: `stage_cut` is also where the runtime cuts (parallel/pipeline.py), so what is planned is what runs.

Memory of stage s holding b blocks: the blocks' weights, gradients and optimizer states; the first stage also the
input embedding and a multimodal model's tower (and the images' activations), the last the final norm, the output
head and the loss's buffers; and the activations 1F1B keeps in flight there, min(N - s, micro-batches) micro-batches
(stage 0 up to N, the last one): one micro-batch at its peak, the others' saved activations (with checkpointing,
each block's input). The cut is the fastest whose stages all fit (the fewest blocks on the fullest stage), with the
peaks as even as they can be, so that the first stage, which carries the most, gets fewer blocks where it must.

Time: a micro-batch's compute on one GPU of the whole model (plan/timing.py), each stage's share by its blocks; the
1F1B step takes (micro-batches + stages - 1) slots of the slowest stage's forward and backward, of which stages - 1
are the bubble, (stages-1)/(micro-batches+stages-1) of the step; each slot sends the hidden states of a micro-batch
forward and their gradient back over the link between neighbouring GPUs (the network across nodes).

Interleaved 1F1B (V stages per GPU, looped): a slot is one virtual stage's share, 1/V of a GPU's blocks, and the
step takes (V x micro-batches + stages - 1) of them, so the bubble shrinks to (stages-1)/(V x micro-batches +
stages-1) while V times as many hidden states cross the links. The first GPU keeps more activations in flight:
torch's warm-up runs (V-1) x (micro-batches per round) + 2 (stages-1) chunks ahead of the first backward, each
chunk 1/V of its blocks' activations.
The interleaved cut is the even one (parallel/pipeline.py `cut_looped`).

Zero bubble (torch's ScheduleInterleavedZeroBubble, the ZB1P schedule of Qi et al. 2024, arXiv 2401.10241): the same
looped stages, each backward split into an input-gradient pass (what the previous stage waits for) and a
weight-gradient pass that fills the idle slots. With a forward, an input gradient and a weight gradient of equal
cost (the paper's unit), its idle time is (stages-1) forwards of a virtual stage, so the bubble is
(stages-1)/(3 x V x micro-batches + stages-1). The three bubble formulas are what torch's own per-rank action lists
give when replayed with those costs (parallel/schedule_order.py; bench/pipeline_bubble.py and
tests/test_schedule_order.py check them against each other). Its warm-up runs one forward per hop ahead, not
interleaved 1F1B's two, and rank r defers r weight passes, so every rank keeps (V-1) x (micro-batches per round) +
stages - 1 chunks ahead.

Stages x data parallelism (world = N x dp, resolve/dims.py): each stage is held by dp neighbouring ranks under the
strategy (ddp, zero2, zero3), and each of the dp replicas runs `grad_accum` micro-batches a step through its own
pipeline (the global batch is dp times one pipeline's, as for any strategy). A stage's memory is the strategy's
estimate over its dp ranks (plan/estimate.py: what the strategy table replicates or shards, zero3's gathered
blocks), with what torch's PipelineStage makes FSDP2 keep besides (`held_by_pipeline`); the step adds each stage's
gradient reduction over its ranks (plan/comms.py `stage_sync_s`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.activations import (
    activation_bytes,
    checkpointed_block_bytes_per_token,
    media_activation_bytes,
)
from shardfit.plan.cards import card_of
from shardfit.plan.comms import FWD_SHARE, stage_sync_s
from shardfit.plan.estimate import (
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT_GIB,
    GIB,
    NCCL_GIB,
    Breakdown,
    Candidate,
    check_not_negative,
    estimate,
    planned_workload,
    trainable_params,
)
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS
from shardfit.plan.optimizer_states import (
    fp32_state_embedding,
    full_width_state_bytes,
    kind_of,
    optimizer_state_bytes,
    sharded_step_bytes,
    step_temp_bytes,
)
from shardfit.plan.plan import TIE, Plan, recommend
from shardfit.plan.precision import compute_bytes, frozen_weight_bytes, saved_copy_bytes, trainable_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.weight_bytes import head_weight_bytes
from shardfit.plan.workload import Workload, workload_of

# The columns of `PipelinePlan.row`: one pipeline layout per line.
LAYOUT_HEADER = (f"{'pipeline layout':<32} {'micro':>6} {'stage GiB':>10} {'fits':>5} {'bubble':>7} {'p2p s':>7} "
                 f"{'sync s':>7} {'step s':>8} {'tokens/s':>10}")


@dataclass(frozen=True)
class PipelinePlan:
    """One step of an N-stage pipeline: the blocks of each stage (`cut`) and each stage's peak (GiB) against the
    card, the bubble's share of the step, the activations' point-to-point seconds on its critical path, the step and
    the job's tokens/s."""

    stages: int
    micro_batches: int
    blocks_per_stage: int  # the most blocks a stage holds (the slowest stage)
    stage_gib: float  # the most loaded stage's peak
    card_gib: float
    bubble: float
    p2p_s: float
    step_s: float
    tokens_per_s: float
    fits: bool  # every stage's peak (runtime overhead included) within the card
    cut: tuple[int, ...] = ()  # decoder blocks of each stage, first to last
    stage_gibs: tuple[float, ...] = ()  # each stage's peak
    per_rank: int = 1  # stages per GPU: 1 under 1F1B, V under interleaved 1F1B and zero bubble (then `cut` and
    # `stage_gib` are the first GPU's: its blocks and peak)
    dp: int = 1  # data-parallel ranks holding each stage (replicas of the pipeline)
    strategy: str = "single"  # what those ranks replicate or shard (single: one rank per stage)
    sync_s: float = 0.0  # the slowest stage's gradient reduction (and zero3's gathers) over its dp ranks, per step
    schedule: str = "1f1b"  # the config's pipeline_schedule: 1f1b, interleaved_1f1b or zero_bubble

    @property
    def layout(self) -> str:
        """The layout in the config's words, e.g. `pipeline_parallel=4 x zero3 2`."""
        return f"pipeline_parallel={self.stages}" + (f" x {self.strategy} {self.dp}" if self.dp > 1 else "")

    def describe(self) -> str:
        """The plan's text output: the headline and each stage's blocks and memory."""
        verdict = "fits" if self.fits else "does not fit"
        if self.per_rank > 1:
            kind = "zero bubble" if self.schedule == "zero_bubble" else "interleaved 1F1B"
            return (f"pipeline {self.stages} stages x {self.micro_batches} micro-batches ({kind}, "
                    f"{self.per_rank} stages per GPU, {self.blocks_per_stage} blocks per GPU): first GPU "
                    f"{self.stage_gib:.1f} of {self.card_gib:.0f} GiB ({verdict}); bubble {100 * self.bubble:.0f}% "
                    f"of the step, activations point-to-point {self.p2p_s:.2f} s; ~{self.step_s:.2f} s/step, "
                    f"{self.tokens_per_s:,.0f} tokens/s")
        stages = ", ".join(f"{b} blocks {g:.1f}" for b, g in zip(self.cut, self.stage_gibs, strict=True))
        replicas = (f", {self.dp} replicas ({self.strategy} over each stage's {self.dp} GPUs, gradient reduction "
                    f"{self.sync_s:.2f} s)") if self.dp > 1 else ""
        per = " per replica" if self.dp > 1 else ""
        return (f"{self.layout}: {self.stages} stages x {self.micro_batches} micro-batches{per} (1F1B){replicas}: "
                f"most loaded stage {self.stage_gib:.1f} of {self.card_gib:.0f} GiB ({verdict}); bubble "
                f"{100 * self.bubble:.0f}% of the step, activations point-to-point {self.p2p_s:.2f} s; "
                f"~{self.step_s:.2f} s/step, {self.tokens_per_s:,.0f} tokens/s\n  stages (blocks, GiB): {stages}")

    def row(self) -> str:
        """One line of the layouts' table (`LAYOUT_HEADER`)."""
        return (f"{self.layout:<32} {self.micro_batches:>6} {self.stage_gib:>10.1f} {'yes' if self.fits else 'no':>5} "
                f"{100 * self.bubble:>6.0f}% {self.p2p_s:>7.2f} {self.sync_s:>7.2f} {self.step_s:>8.2f} "
                f"{self.tokens_per_s:>10,.0f}")

    def to_json(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["stage_gibs"] = [round(g, 4) for g in self.stage_gibs]
        out["cut"] = list(self.cut)
        out["layout"] = self.layout
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def bubble(stages: int, micro_batches: int, per_rank: int = 1, split_backward: bool = False) -> float:
    """The idle share of a 1F1B (or GPipe) step, (stages-1)/(micro-batches+stages-1), or of an interleaved 1F1B
    step with `per_rank` stages per GPU, (stages-1)/(per_rank x micro-batches + stages-1), or of a zero-bubble step
    (`split_backward`: a forward, an input-gradient and a weight-gradient pass per chunk, of equal cost, the idle
    time one forward per hop), (stages-1)/(3 x per_rank x micro-batches + stages-1)."""
    passes = 3 if split_backward else 1
    return (stages - 1) / (passes * per_rank * micro_batches + stages - 1)


def in_flight(stages: int, micro_batches: int, per_rank: int = 1, split_backward: bool = False) -> float:
    """The micro-batches' worth of the first GPU's activations its schedule keeps at once: 1F1B's min(stages,
    micro-batches); interleaved 1F1B's warm-up chunks plus the one computing (torch's `_get_warmup_ops` for rank 0),
    each 1/per_rank of the GPU's blocks; zero bubble's (`split_backward`) one forward per hop ahead, not two."""
    if per_rank == 1:
        return min(stages, micro_batches)
    per_round = micro_batches // max(1, micro_batches // stages)
    hops = (1 if split_backward else 2) * (stages - 1)
    chunks = min((per_rank - 1) * per_round + hops, micro_batches * per_rank - 1) + 1
    return chunks / per_rank


def even_cut(layers: int, stages: int) -> list[int]:
    """Blocks per stage, as even as `layers` allows, the first stages taking the remainder's extra blocks: the cut
    where the model's shape is unknown to the planner."""
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def balance(layers: int, fixed: Sequence[float], per_block: Sequence[float], most: int | None = None) -> list[int]:
    """Blocks per stage (each from one to `most`, `layers` in all) that make the largest of the stages' costs
    fixed[s] + blocks[s] * per_block[s] as small as it can be: each block in turn goes to the stage it leaves the
    cheapest (ties: the earlier stage), which is optimal for costs that grow with the blocks. Equal costs give
    `even_cut`."""
    n = len(fixed)
    most = layers if most is None else most
    if not 1 <= n <= layers <= n * most:
        raise ValueError(f"{n} stages of at most {most} blocks for {layers} blocks")
    blocks = [1] * n
    for _ in range(layers - n):
        s = min((i for i in range(n) if blocks[i] < most), key=lambda i: (fixed[i] + (blocks[i] + 1) * per_block[i], i))
        blocks[s] += 1
    return blocks


def _part_gib(params: int, trained: bool, w: Workload, embedding: bool = False,
              saved: bool = False) -> tuple[float, float, float]:
    """(weights, grads, optimizer) GiB of `params` weights outside the blocks: trained ones as a full fine-tune
    stores them, or peft's trained copy (`saved`) in the dtype the tool leaves it in (`saved_copy_bytes`) (the
    optimizer's full-size states, plan/optimizer_states.py; full-width ones for a trained input `embedding` the HF
    Trainer keeps in 32 bits under an 8-bit optimizer, `fp32_state_embedding`, as the stage's estimate counted it),
    frozen ones as stored."""
    if not trained:
        return params * frozen_weight_bytes(w) / GIB, 0.0, 0.0
    t = saved_copy_bytes(w) if saved else trainable_bytes(w)
    states = full_width_state_bytes(w) if embedding and fp32_state_embedding(w) else \
        optimizer_state_bytes(w, weight_bytes=t)
    return params * t / GIB, params * t / GIB, params * states / GIB


# The counts of a hybrid's interleaved kinds of block (plan/model_shape.py), which a share of the blocks holds in
# proportion.
INTERLEAVED = ("sliding_layers", "linear_layers", "linear_dense_layers", "mamba_layers", "attention_layers",
               "mamba_mixers", "mamba_dense_mixers")


def blocks_shape(shape: ModelShape, held: Sequence[range]) -> ModelShape:
    """The model of the decoder blocks in `held` (ranges of block indices). A mixture's dense blocks that come
    first (GLM-4.5's three, DeepSeek-V3's three) are counted where the ranges hold them; interleaved kinds (Llama
    4's dense blocks, a hybrid's linear-attention, Mamba and windowed blocks) in proportion, rounded down, so that
    no kind, nor any sum of kinds the planner takes from the blocks, exceeds the share's blocks."""
    blocks = sum(len(r) for r in held)

    def share(count: int) -> int:
        return count * blocks // shape.layers

    hybrid = any(getattr(shape, k) for k in INTERLEAVED if k != "sliding_layers")
    dense = sum(len(range(max(r.start, 0), min(r.stop, shape.dense_layers))) for r in held) \
        if shape.dense_first and not hybrid else share(shape.dense_layers)
    return dataclasses.replace(shape, layers=blocks, dense_layers=dense,
                               attention_groups=tuple(dataclasses.replace(g, blocks=share(g.blocks))
                                                      for g in shape.attention_groups),
                               **{k: share(getattr(shape, k)) for k in INTERLEAVED})


def stage_blocks(shape: ModelShape, stage: int, blocks: int, first: int | None) -> ModelShape:
    """The model of a stage holding `blocks` blocks from block `first` on; where the cut is not known yet
    (`first` None), the first stage's from block 0 and every other's past the dense blocks."""
    start = (0 if stage == 0 else shape.dense_layers) if first is None else first
    return blocks_shape(shape, [range(start, start + blocks)])


def stage_hardware(hw: Hardware, dp: int) -> Hardware:
    """The `dp` GPUs of `hw` that hold one stage: neighbours on the job's mesh (resolve/dims.py puts the stages
    farthest apart), on one node where they fit."""
    per_node = min(dp, hw.gpus_per_node)
    return dataclasses.replace(hw, nodes=-(-dp // per_node), gpus_per_node=per_node)


def held_by_pipeline(b: Breakdown, w: Workload, s: strategies.Strategy, dp: int) -> None:
    """What FSDP2 keeps on a stage's rank beyond its estimate as a strategy (GiB, in place). Torch's PipelineStage
    turns gradient sync and resharding after backward off until the step's last backward
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`; `perform_reduce_grad` turns them back on):
    each rank accumulates the stage's unsharded gradients (zero2, zero3: the shards come only from the step's
    reduce-scatter), and once a block's backward has run its 16-bit weights stay gathered until the step ends, beside
    the shards (zero3). DDP and one rank per stage hold nothing more."""
    if not s.sharded or dp == 1:
        return
    if s.shards_grads:
        b.grads *= dp
    if s.shards_params:
        stored = trainable_bytes(w) if w.method == "full" else compute_bytes(w)
        b.weights += b.weights * dp * compute_bytes(w) / stored


def stage_gib(shape: ModelShape, w: Workload, hw: Hardware, stages: int, stage: int, blocks: int, dp: int = 1,
              strategy: str = "single", first: int | None = None) -> float:
    """The peak (GiB, runtime overhead included) of stage `stage` of `stages` holding `blocks` decoder blocks (from
    block `first` on: `stage_blocks`), on each of the `dp` GPUs of `hw` that hold it under `strategy`
    (`stage_breakdown`)."""
    b = stage_breakdown(shape, w, hw, stages, stage, blocks, dp, strategy, first)
    check_not_negative(b, f"stage {stage} of {stages} ({blocks} blocks, {strategy})")
    tensors = sum((b.weights, b.grads, b.optimizer, b.activations, b.logits, b.temporaries))
    return tensors * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_GIB + (NCCL_GIB if stages * dp > 1 else 0.0)


def stage_breakdown(shape: ModelShape, w: Workload, hw: Hardware, stages: int, stage: int, blocks: int,
                    dp: int = 1, strategy: str = "single", first: int | None = None) -> Breakdown:
    """The tensors (GiB) at the peak of stage `stage` of `stages` holding `blocks` decoder blocks, on each of the
    `dp` GPUs of `hw` that hold it under `strategy`: the strategy's estimate over those GPUs of a model of `blocks`
    blocks, less what other stages hold (sharded as the strategy shards it), plus what the pipeline keeps
    (`held_by_pipeline`) and the saved activations of the micro-batches 1F1B keeps in flight there."""
    name = strategy if dp > 1 else "single"
    s = strategies.get(name)
    stage_shape = stage_blocks(shape, stage, blocks, first)
    whole = estimate(stage_shape, w, stage_hardware(hw, dp), name)
    b = dataclasses.replace(whole.per_gpu_gib)
    step_copy = whole.peak_phase == "optimizer"  # the peak holds the multi-tensor step's copies of what it steps
    # the parts' gradients the moment holds: every one at the step, and wherever earlier micro-batches' are held
    # (accumulation) or any at the loss (DDP's buckets). Within a lone micro-batch's backward which ones is the
    # estimate's, so none is taken off there: the stage errs high by what it has reached of them, never below zero
    grads_held = step_copy or (b.grads > 0 and (w.grad_accum > 1 or whole.peak_phase == "forward"))
    first, last = stage == 0, stage == stages - 1
    trains_embedding = w.method == "full"
    matrix = shape.vocab * shape.hidden  # the input embedding's, and an untied head's, weights
    # (weights, trained, the input embedding, peft's trained copy): the parts another stage holds
    parts: list[tuple[int, bool, bool, bool]] = []
    if not first:  # the towers stay on the first stage, with the images' and clips' activations
        parts.append((shape.extra_params, w.vision_trainable and w.method == "full", False, False))
        b.activations -= media_activation_bytes(stage_shape, w, name) / GIB
    if shape.tied:  # one matrix counted: the first stage's embedding, the last stage's copy of it as the head
        parts += [(matrix, trains_embedding, True, False)] if not first and not last else []
    else:
        parts += [(matrix, trains_embedding, True, False)] if not first else []
        parts += [(matrix, trains_embedding, False, False)] if not last else []
    saved = w.lora_saved if w.trains_adapters else ()  # peft's trained copies: the embedding's first, the head's last
    parts += [(matrix, True, True, True)] if "embed" in saved and not first else []
    parts += [(matrix, True, False, True)] if "head" in saved and not last else []
    if not last:  # the loss's buffers are the last stage's, and zero3's unsharded root (the head) too
        b.logits = 0.0
        # the root's gathered head is a temporary of forward and backward; the optimizer step's peak has none
        b.temporaries -= matrix * compute_bytes(w) / GIB if s.shards_params and not step_copy else 0.0
    if s.sharded and not s.shards_params and not step_copy:
        # zero2's gathered model (a temporary from forward into backward) holds the towers, the embedding and the
        # head of the estimate's whole model: those another stage holds are gathered there
        elsewhere = sum(params for params, _, _, copied in parts if not copied)
        b.temporaries -= elsewhere * compute_bytes(w) / GIB
    for params, trained, embedding, copied in parts:
        wt, g, o = _part_gib(params, trained, w, embedding, copied)
        # the multi-tensor step's copies (optimizer_states.py `foreach_temp_bytes`), in the trained weights' dtype
        stepped = saved_copy_bytes(w) if copied else trainable_bytes(w)
        copies = OPTIMIZER_KINDS[w.optimizer].group_copies
        copy = copies * params * stepped / GIB if trained and step_copy and w.multi_tensor_step else 0.0
        b.weights -= wt / (dp if s.sharded else 1)  # FSDP2 stores zero2's weights sharded too
        b.grads -= g / (dp if s.shards_grads else 1) if grads_held else 0.0
        b.optimizer -= (o + copy) / (dp if s.shards_optimizer else 1)
    if step_copy and not (first or last):
        b.optimizer -= _loop_step_excess(stage_shape, w, s, dp) / GIB
    held_by_pipeline(b, w, s, dp)
    in_flight = min(stages - stage, w.grad_accum)
    held = activation_bytes(stage_shape, w, blocks, name) if w.grad_ckpt == "none" else \
        w.tokens * blocks * checkpointed_block_bytes_per_token(stage_shape, w, name)
    b.activations += (in_flight - 1) * held / GIB
    return b


def _loop_step_excess(shape: ModelShape, w: Workload, s: strategies.Strategy, dp: int) -> float:
    """Bytes the estimate of a middle stage (one holding neither the embedding nor the head) counts too many for a
    step that loops over tensors (Adafactor: optimizer_states.py `step_temp_bytes`): its copies are of the
    largest tensor the stage trains, a decoder block's largest weight, not the embedding the estimate's model has."""
    if w.multi_tensor_step or not kind_of(w).tensor_copies or s.offload:
        return 0.0
    if s.sharded and dp > 1:
        t = trainable_params(shape, w)
        return (sharded_step_bytes(shape, w, t, dp, flat=w.runs_fsdp1)
                - sharded_step_bytes(shape, w, t, dp, flat=w.runs_fsdp1, matrices=False))
    return step_temp_bytes(shape, w, 0) - step_temp_bytes(shape, w, 0, matrices=False)


def stage_cut(shape: ModelShape, w: Workload, hw: Hardware, stages: int, dp: int = 1,
              strategy: str = "single") -> list[int]:
    """Decoder blocks of each of `stages` stages (each on `dp` GPUs under `strategy`): where the planner plans and
    where the runtime cuts. The step waits
    for the stage with the most blocks, so the cut is the one with the fewest blocks on its fullest stage whose
    peaks (`stage_gib`, linear in the blocks a stage holds: read at one and two blocks) all fit the card, with
    those peaks as even as they can be; where no cut fits, the one with the smallest largest peak."""
    if stages == 1:
        return [shape.layers]
    # each stage read at two sizes: the first stage of a dense-first mixture past its dense blocks, so that its
    # cost per block is an expert block's (read at one and two blocks it would be a dense block's)
    at = [1] * stages
    if blocks_shape(shape, [range(0, 2)]).dense_layers and shape.layers >= shape.dense_layers + stages + 1:
        at[0] = shape.dense_layers + 1
    ones = [stage_gib(shape, w, hw, stages, s, at[s], dp, strategy) for s in range(stages)]
    twos = [stage_gib(shape, w, hw, stages, s, at[s] + 1, dp, strategy) for s in range(stages)]
    per_block = [b - a for a, b in zip(ones, twos, strict=True)]
    fixed = [a - n * p for a, p, n in zip(ones, per_block, at, strict=True)]
    for most in range(-(-shape.layers // stages), shape.layers - stages + 2):
        blocks = balance(shape.layers, fixed, per_block, most)
        if max(f + b * p for f, b, p in zip(fixed, blocks, per_block, strict=True)) <= hw.gpu_mem_gib:
            return blocks
    return balance(shape.layers, fixed, per_block)


def _micro_and_fixed(shape: ModelShape, w: Workload, hw: Hardware) -> tuple[float, float]:
    """A micro-batch's time and the step's fixed part (the optimizer) on one GPU, from two accumulation lengths."""
    one_gpu = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
    one = step_time(shape, dataclasses.replace(w, grad_accum=1), one_gpu, "single").step_s
    two = step_time(shape, dataclasses.replace(w, grad_accum=2), one_gpu, "single").step_s
    return two - one, 2 * one - two


def _hop_s(shape: ModelShape, w: Workload, hw: Hardware, ranks: int) -> float:
    """One micro-batch's hidden states sent forward and their gradient back between neighbouring stages, over the
    GPUs' link when the job's `ranks` sit on one node, else over the network."""
    card = card_of(hw)
    bw = card.link if ranks <= hw.gpus_per_node else card.nic
    return 2 * (w.tokens * shape.hidden * compute_bytes(w) / bw + card.latency_s)


def plan_pipeline(shape: ModelShape, w: Workload, hw: Hardware, stages: int, per_rank: int = 1, dp: int = 1,
                  strategy: str = "single", schedule: str = "1f1b") -> PipelinePlan:
    """The pipeline of `stages` stages, each on `dp` GPUs of `hw` under `strategy` (dp replicas of the pipeline),
    each replica running `w.grad_accum` micro-batches a step through its one stage per GPU (1F1B, cut by
    `stage_cut`) or, one GPU per stage, its `per_rank` looped stages (interleaved 1F1B, or zero bubble where
    `schedule` says so; cut evenly)."""
    w = planned_workload(shape, w)
    if per_rank > 1:
        return _interleaved(shape, w, hw, stages, per_rank, schedule == "zero_bubble")
    name = strategy if dp > 1 else "single"
    cut = stage_cut(shape, w, hw, stages, dp, name)
    gibs = [stage_gib(shape, w, hw, stages, s, b, dp, name, sum(cut[:s])) for s, b in enumerate(cut)]
    m = w.grad_accum
    per_micro, fixed = _micro_and_fixed(shape, w, hw)
    slots = m + stages - 1
    p2p = slots * _hop_s(shape, w, hw, stages * dp)
    share = max(cut) / shape.layers  # every slot waits for the stage with the most blocks
    s = strategies.get(name)
    # The fullest stage's collectives over its dp ranks, prefetched under the compute: zero3's gathers under each
    # micro-batch, zero2's under the step's first forward; the reduction after the step's last backward, which
    # DDP's bucketed all-reduce overlaps.
    fullest = cut.index(max(cut))
    gather, once, reduce = stage_sync_s(stage_blocks(shape, fullest, max(cut), sum(cut[:fullest])), w,
                                        stage_hardware(hw, dp), name)
    if s.engine == "ddp":
        reduce = max(0.0, reduce - per_micro * share * (1 - FWD_SHARE))
    slot = max(per_micro * share, gather)
    sync = reduce + max(0.0, once - per_micro * share * FWD_SHARE) + slots * (slot - per_micro * share)
    optimizer = fixed * share / (dp if s.shards_optimizer else 1)
    step = slots * per_micro * share + p2p + sync + optimizer
    return PipelinePlan(stages=stages, micro_batches=m, blocks_per_stage=max(cut), stage_gib=max(gibs),
                        card_gib=hw.gpu_mem_gib, bubble=bubble(stages, m), p2p_s=p2p, step_s=step,
                        tokens_per_s=w.tokens * m * dp / step, fits=max(gibs) <= hw.gpu_mem_gib, cut=tuple(cut),
                        stage_gibs=tuple(gibs), dp=dp, strategy=name, sync_s=sync)


def layouts(shape: ModelShape, w: Workload, hw: Hardware, stages: int, names: Sequence[str]) -> list[PipelinePlan]:
    """The pipeline of `stages` stages over every GPU of `hw` (stages x `hw.world // stages` data-parallel GPUs
    each) under each strategy of `names`; the one layout of one GPU per stage when the stages take every GPU."""
    dp = hw.world // stages
    return [plan_pipeline(shape, w, hw, stages, dp=dp, strategy=n) for n in (names if dp > 1 else ("single",))]


def fastest(pipes: Sequence[PipelinePlan]) -> PipelinePlan | None:
    """The layout to train among `pipes`: the most tokens/s of those that fit, the simpler strategy (the table's
    speed rank) where the time model cannot tell them apart (TIE), as `recommend` ranks strategies; None when none
    fits."""
    fitting = [p for p in pipes if p.fits]
    if not fitting:
        return None
    top = max(p.tokens_per_s for p in fitting)
    return min((p for p in fitting if p.tokens_per_s >= top * (1 - TIE)),
               key=lambda p: (strategies.get(p.strategy).speed_rank, -p.tokens_per_s))


def _interleaved(shape: ModelShape, w: Workload, hw: Hardware, stages: int, per_rank: int,
                 split: bool = False) -> PipelinePlan:
    """Interleaved 1F1B (zero bubble where `split`) over `stages` GPUs of `per_rank` looped stages each (the even
    cut the runtime makes): the first GPU's peak, which keeps the most chunks in flight."""
    # The first GPU's blocks: its stages 0, N, 2N, ... of the N x V, the earlier stages taking the remainder's.
    counts = even_cut(shape.layers, stages * per_rank)
    per_gpu = [sum(counts[s] for s in range(r, stages * per_rank, stages)) for r in range(stages)]
    blocks = per_gpu[0]
    one_gpu = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
    m = w.grad_accum
    stage_shape = blocks_shape(shape, [range(sum(counts[:s]), sum(counts[:s + 1]))
                                       for s in range(0, stages * per_rank, stages)])
    one = estimate(stage_shape, w, one_gpu, "single")  # the blocks, embedding, tower, head: one micro-batch
    # The first GPU: no output head (unless tied: it is the embedding), and the inputs the other chunks in flight
    # keep until their backward (every saved activation without checkpointing).
    head = 0.0 if shape.tied else head_weight_bytes(shape, w)
    held = activation_bytes(stage_shape, w, blocks) if w.grad_ckpt == "none" else \
        w.tokens * blocks * checkpointed_block_bytes_per_token(stage_shape, w, "single")
    gib = one.per_gpu_gib.total + ((in_flight(stages, m, per_rank, split) - 1) * held - head) / GIB
    per_micro, fixed = _micro_and_fixed(shape, w, hw)
    slots = per_rank * m + stages - 1  # each a virtual stage's forward and backward of one micro-batch
    p2p = slots * _hop_s(shape, w, hw, stages)
    idle = bubble(stages, m, per_rank, split)
    # Each GPU's share of the micro-batches' compute, stretched by the schedule's idle share.
    step = per_micro * m / stages / (1 - idle) + p2p + fixed / stages
    return PipelinePlan(stages=stages, micro_batches=m, blocks_per_stage=blocks, stage_gib=gib,
                        card_gib=hw.gpu_mem_gib, bubble=idle, p2p_s=p2p, step_s=step,
                        tokens_per_s=w.tokens * m / step, fits=gib <= hw.gpu_mem_gib, cut=tuple(per_gpu),
                        stage_gibs=(gib,), per_rank=per_rank,
                        schedule="zero_bubble" if split else "interleaved_1f1b")


def config_cut(cfg: Config, hw: Hardware, stages: int, strategy: str = "single") -> tuple[int, ...]:
    """`stage_cut` for a config's job on `hw` (its GPUs divided between the stages, each stage's under
    `strategy`); empty when the planner cannot read the model's shape (the runtime then cuts evenly)."""
    try:
        shape = resolve_shape(cfg.model)
    except UserError:
        return ()
    if shape.layers < stages:
        return ()
    return tuple(stage_cut(shape, workload_of(cfg), hw, stages, max(1, hw.world // stages), strategy))


def rival(plan: Plan, rivals: Sequence[Candidate] | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """What a pipeline is weighed against: the strategy `recommend` picks of `rivals` (None: the plan's
    candidates, its recommendation; otherwise what `strategy: auto` may run, resolve/decide.py), and every one of
    them that fits, fastest first."""
    cands = [c for c in (plan.candidates if rivals is None else rivals) if c.fits and c.applies]
    name = plan.recommended if rivals is None else recommend(cands, plan.hardware)[0]
    best = next((c for c in cands if c.strategy == name), None) if name else None
    return best, sorted(cands, key=lambda c: -(c.tokens_per_s or 0))


def rival_name(best: Candidate, split: int = 1) -> str:
    """The rival as the job would run it: the strategy, with the rows split over `split` ranks where they are."""
    return best.strategy + (f" with sequence_parallel {split}" if split > 1 else "")


def versus(plan: Plan, pipe: PipelinePlan, refused: str, rivals: Sequence[Candidate] | None = None,
           split: int = 1) -> tuple[bool, str]:
    """Whether the plan recommends the pipeline `pipe` over the strategies, and why in numbers: it must fit, run
    (`refused`: what train says against it, empty when it runs it) and train more tokens/s than the strategy it
    would replace beyond the time model's precision (TIE), or be the only thing that fits. That strategy is the
    one `recommend` picks of `rivals` (`rival`: the plan's recommendation without them; with them, what
    `strategy: auto` would otherwise run, its rows split over `split` ranks where auto would split them)."""
    best, fitting = rival(plan, rivals)
    timed = best is not None and bool(best.tokens_per_s)
    rate = f"{pipe.tokens_per_s:,.0f} tokens/s (~{pipe.step_s:.0f} s/step)"
    interleaved = f" --set pipeline_schedule={pipe.schedule} --set pipeline_stages_per_rank={pipe.per_rank}" \
        if pipe.per_rank > 1 else ""
    if not pipe.fits:
        return False, f"not {pipe.layout}: its fullest stage needs {pipe.stage_gib:.1f} of {pipe.card_gib:.0f} GiB"
    if refused:
        return False, f"not {pipe.layout} ({rate}): train does not run it in this version"
    if best is not None and not timed:  # untimed strategies that fit: the pipeline cannot be shown faster
        return False, f"not {pipe.layout}: {rival_name(best, split)} fits, and the time model has no speed for it"
    if best is not None and best.tokens_per_s and pipe.tokens_per_s <= best.tokens_per_s * (1 + TIE):
        apart = "the time model cannot tell them apart, and the strategy is simpler" \
            if pipe.tokens_per_s >= best.tokens_per_s * (1 - TIE) else "slower"
        return False, (f"not {pipe.layout}: {rate}, no faster than {rival_name(best, split)}'s "
                       f"{best.tokens_per_s:,.0f} ({apart})")
    than = f"more than {rival_name(best, split)}'s {best.tokens_per_s:,.0f} ({best.step_s:.0f} s/step)" \
        if best is not None and best.tokens_per_s else "and no strategy fits"
    others = "; ".join(f"{c.strategy} {c.tokens_per_s:,.0f}" for c in fitting if c.tokens_per_s)
    where = f"{pipe.strategy} over each stage's {pipe.dp} GPUs" if pipe.dp > 1 else "one GPU per stage"
    strategy = f" --set strategy={pipe.strategy}" if pipe.dp > 1 else ""
    return True, (f"recommended over the strategies above: {pipe.layout}, {where} "
                  f"({rate}, {than}; strategies that fit: {others or 'none'}): train with --set "
                  f"pipeline_parallel={pipe.stages}{strategy} --set grad_accum={pipe.micro_batches}{interleaved} "
                  f"--nproc {pipe.stages * pipe.dp}")
