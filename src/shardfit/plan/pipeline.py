"""The plan of a pipeline (`pipeline_parallel: N`, one GPU per stage): where the decoder is cut, each stage's
memory, the bubble of the 1F1B schedule and the point-to-point traffic of the activations, in one optimizer step.
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.cards import card_of
from shardfit.plan.estimate import (
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT_GIB,
    GIB,
    NCCL_GIB,
    activation_bytes,
    audio_activation_bytes,
    checkpointed_block_bytes_per_token,
    compute_bytes,
    estimate,
    head_weight_bytes,
    image_activation_bytes,
    trainable_bytes,
)
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.plan import TIE, Plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload, workload_of


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
    per_rank: int = 1  # stages per GPU: 1 under 1F1B, V under interleaved 1F1B (then `cut` and `stage_gib` are the
    # first GPU's: its blocks and peak)

    def describe(self) -> str:
        """The plan's text output: the headline and each stage's blocks and memory."""
        verdict = "fits" if self.fits else "does not fit"
        if self.per_rank > 1:
            return (f"pipeline {self.stages} stages x {self.micro_batches} micro-batches (interleaved 1F1B, "
                    f"{self.per_rank} stages per GPU, {self.blocks_per_stage} blocks per GPU): first GPU "
                    f"{self.stage_gib:.1f} of {self.card_gib:.0f} GiB ({verdict}); bubble {100 * self.bubble:.0f}% "
                    f"of the step, activations point-to-point {self.p2p_s:.2f} s; ~{self.step_s:.2f} s/step, "
                    f"{self.tokens_per_s:,.0f} tokens/s")
        stages = ", ".join(f"{b} blocks {g:.1f}" for b, g in zip(self.cut, self.stage_gibs, strict=True))
        return (f"pipeline {self.stages} stages x {self.micro_batches} micro-batches (1F1B): most loaded stage "
                f"{self.stage_gib:.1f} of {self.card_gib:.0f} GiB ({verdict}); bubble {100 * self.bubble:.0f}% of "
                f"the step, activations point-to-point {self.p2p_s:.2f} s; ~{self.step_s:.2f} s/step, "
                f"{self.tokens_per_s:,.0f} tokens/s\n  stages (blocks, GiB): {stages}")

    def to_json(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["stage_gibs"] = [round(g, 4) for g in self.stage_gibs]
        out["cut"] = list(self.cut)
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def bubble(stages: int, micro_batches: int, per_rank: int = 1) -> float:
    """The idle share of a 1F1B (or GPipe) step, (stages-1)/(micro-batches+stages-1), or of an interleaved 1F1B
    step with `per_rank` stages per GPU, (stages-1)/(per_rank x micro-batches + stages-1)."""
    return (stages - 1) / (per_rank * micro_batches + stages - 1)


def in_flight(stages: int, micro_batches: int, per_rank: int = 1) -> float:
    """The micro-batches' worth of the first GPU's activations its schedule keeps at once: 1F1B's min(stages,
    micro-batches); interleaved 1F1B's warm-up chunks plus the one computing (torch's `_get_warmup_ops` for rank 0),
    each 1/per_rank of the GPU's blocks."""
    if per_rank == 1:
        return min(stages, micro_batches)
    per_round = micro_batches // max(1, micro_batches // stages)
    chunks = min((per_rank - 1) * per_round + 2 * (stages - 1), micro_batches * per_rank - 1) + 1
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


def _part_gib(params: int, trained: bool, w: Workload) -> tuple[float, float, float]:
    """(weights, grads, optimizer) GiB of `params` weights outside the blocks: trained ones as a full fine-tune
    stores them (AdamW's two states), frozen ones as stored."""
    if not trained:
        return params * (4 if w.frozen_fp32 else compute_bytes(w)) / GIB, 0.0, 0.0
    t = trainable_bytes(w)
    return params * t / GIB, params * t / GIB, params * (2.0 if w.optimizer == "adamw8bit" else 2.0 * t) / GIB


def stage_gib(shape: ModelShape, w: Workload, hw: Hardware, stages: int, stage: int, blocks: int) -> float:
    """The peak (GiB, runtime overhead included) of stage `stage` of `stages` holding `blocks` decoder blocks, on
    one GPU of `hw`: one GPU's estimate of a model of `blocks` blocks, less what other stages hold, plus the saved
    activations of the micro-batches 1F1B keeps in flight there."""
    one_gpu = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
    stage_shape = dataclasses.replace(shape, layers=blocks)
    b = dataclasses.replace(estimate(stage_shape, w, one_gpu, "single").per_gpu_gib)
    first, last = stage == 0, stage == stages - 1
    trains_embedding = w.method == "full"
    matrix = shape.vocab * shape.hidden  # the input embedding's, and an untied head's, weights
    parts: list[tuple[int, bool]] = []
    if not first:  # the towers stay on the first stage, with the images' and clips' activations
        parts.append((shape.extra_params, w.vision_trainable and w.method == "full"))
        b.activations -= (image_activation_bytes(stage_shape, w, "single")
                          + audio_activation_bytes(stage_shape, w, "single")) / GIB
    if shape.tied:  # one matrix counted: the first stage's embedding, the last stage's copy of it as the head
        parts += [(matrix, trains_embedding)] if not first and not last else []
    else:
        parts += [(matrix, trains_embedding)] if not first else []
        parts += [(matrix, trains_embedding)] if not last else []
    if not last:  # the loss's buffers are the last stage's
        b.logits = 0.0
    for params, trained in parts:
        wt, g, o = _part_gib(params, trained, w)
        b.weights, b.grads, b.optimizer = b.weights - wt, b.grads - g, b.optimizer - o
    in_flight = min(stages - stage, w.grad_accum)
    held = activation_bytes(stage_shape, w, blocks) if w.grad_ckpt == "none" else \
        w.tokens * blocks * checkpointed_block_bytes_per_token(stage_shape, w, "single")
    b.activations += (in_flight - 1) * held / GIB
    tensors = sum(max(0.0, x) for x in (b.weights, b.grads, b.optimizer, b.activations, b.logits, b.temporaries))
    return tensors * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT_GIB + (NCCL_GIB if stages > 1 else 0.0)


def stage_cut(shape: ModelShape, w: Workload, hw: Hardware, stages: int) -> list[int]:
    """Decoder blocks of each of `stages` stages: where the planner plans and where the runtime cuts. The step waits
    for the stage with the most blocks, so the cut is the one with the fewest blocks on its fullest stage whose
    peaks (`stage_gib`, linear in the blocks a stage holds: read at one and two blocks) all fit the card, with
    those peaks as even as they can be; where no cut fits, the one with the smallest largest peak."""
    if stages == 1:
        return [shape.layers]
    ones = [stage_gib(shape, w, hw, stages, s, 1) for s in range(stages)]
    twos = [stage_gib(shape, w, hw, stages, s, 2) for s in range(stages)]
    per_block = [b - a for a, b in zip(ones, twos, strict=True)]
    fixed = [a - p for a, p in zip(ones, per_block, strict=True)]
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


def _hop_s(shape: ModelShape, w: Workload, hw: Hardware, stages: int) -> float:
    """One micro-batch's hidden states sent forward and their gradient back between neighbouring GPUs."""
    card = card_of(hw)
    bw = card.link if stages <= hw.gpus_per_node else card.nic
    return 2 * (w.tokens * shape.hidden * compute_bytes(w) / bw + card.latency_s)


def plan_pipeline(shape: ModelShape, w: Workload, hw: Hardware, stages: int, per_rank: int = 1) -> PipelinePlan:
    """The pipeline of `stages` GPUs of `hw`, each running `w.grad_accum` micro-batches a step through its one stage
    (1F1B, cut by `stage_cut`) or its `per_rank` looped stages (interleaved 1F1B, cut evenly)."""
    if per_rank > 1:
        return _interleaved(shape, w, hw, stages, per_rank)
    cut = stage_cut(shape, w, hw, stages)
    gibs = [stage_gib(shape, w, hw, stages, s, b) for s, b in enumerate(cut)]
    m = w.grad_accum
    per_micro, fixed = _micro_and_fixed(shape, w, hw)
    slots = m + stages - 1
    p2p = slots * _hop_s(shape, w, hw, stages)
    share = max(cut) / shape.layers  # every slot waits for the stage with the most blocks
    step = slots * per_micro * share + p2p + fixed * share
    return PipelinePlan(stages=stages, micro_batches=m, blocks_per_stage=max(cut), stage_gib=max(gibs),
                        card_gib=hw.gpu_mem_gib, bubble=bubble(stages, m), p2p_s=p2p, step_s=step,
                        tokens_per_s=w.tokens * m / step, fits=max(gibs) <= hw.gpu_mem_gib, cut=tuple(cut),
                        stage_gibs=tuple(gibs))


def _interleaved(shape: ModelShape, w: Workload, hw: Hardware, stages: int, per_rank: int) -> PipelinePlan:
    """Interleaved 1F1B over `stages` GPUs of `per_rank` looped stages each (the even cut the runtime makes): the
    first GPU's peak, which keeps the most chunks in flight."""
    # The first GPU's blocks: its stages 0, N, 2N, ... of the N x V, the earlier stages taking the remainder's.
    counts = even_cut(shape.layers, stages * per_rank)
    per_gpu = [sum(counts[s] for s in range(r, stages * per_rank, stages)) for r in range(stages)]
    blocks = per_gpu[0]
    one_gpu = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
    m = w.grad_accum
    stage_shape = dataclasses.replace(shape, layers=blocks)
    one = estimate(stage_shape, w, one_gpu, "single")  # the blocks, embedding, tower, head: one micro-batch
    # The first GPU: no output head (unless tied: it is the embedding), and the inputs the other chunks in flight
    # keep until their backward (every saved activation without checkpointing).
    head = 0.0 if shape.tied else head_weight_bytes(shape, w)
    held = activation_bytes(stage_shape, w, blocks) if w.grad_ckpt == "none" else \
        w.tokens * blocks * checkpointed_block_bytes_per_token(stage_shape, w, "single")
    gib = one.per_gpu_gib.total + ((in_flight(stages, m, per_rank) - 1) * held - head) / GIB
    per_micro, fixed = _micro_and_fixed(shape, w, hw)
    slots = per_rank * m + stages - 1  # each a virtual stage's forward and backward of one micro-batch
    p2p = slots * _hop_s(shape, w, hw, stages)
    step = slots * per_micro / (stages * per_rank) + p2p + fixed / stages
    return PipelinePlan(stages=stages, micro_batches=m, blocks_per_stage=blocks, stage_gib=gib,
                        card_gib=hw.gpu_mem_gib, bubble=bubble(stages, m, per_rank), p2p_s=p2p, step_s=step,
                        tokens_per_s=w.tokens * m / step, fits=gib <= hw.gpu_mem_gib, cut=tuple(per_gpu),
                        stage_gibs=(gib,), per_rank=per_rank)


def config_cut(cfg: Config, hw: Hardware, stages: int) -> tuple[int, ...]:
    """`stage_cut` for a config's job on `hw` (one GPU of it per stage); empty when the planner cannot read the
    model's shape (the runtime then cuts evenly)."""
    try:
        shape = resolve_shape(cfg.model)
    except UserError:
        return ()
    if shape.layers < stages:
        return ()
    return tuple(stage_cut(shape, workload_of(cfg), hw, stages))


def versus(plan: Plan, pipe: PipelinePlan, refused: str) -> tuple[bool, str]:
    """Whether the plan recommends the pipeline `pipe` over its strategies, and why in numbers: it must fit, run
    (`refused`: what train says against it, empty when it runs it) and train more tokens/s than the recommended
    strategy beyond the time model's precision (TIE); the strategies are ranked as `recommend` ranks them."""
    best = plan.candidate(plan.recommended) if plan.recommended else None
    rate = f"{pipe.tokens_per_s:,.0f} tokens/s (~{pipe.step_s:.0f} s/step)"
    interleaved = f" --set pipeline_schedule=interleaved_1f1b --set pipeline_stages_per_rank={pipe.per_rank}" \
        if pipe.per_rank > 1 else ""
    if not pipe.fits:
        return False, f"not the pipeline: its fullest stage needs {pipe.stage_gib:.1f} of {pipe.card_gib:.0f} GiB"
    if refused:
        return False, f"not the pipeline ({rate}): train does not run it in this version"
    if best is not None and best.tokens_per_s and pipe.tokens_per_s <= best.tokens_per_s * (1 + TIE):
        return False, (f"not the pipeline: {rate}, no faster than {best.strategy}'s "
                       f"{best.tokens_per_s:,.0f} (the time model cannot tell them apart, and the strategy is simpler)")
    than = f"more than {best.strategy}'s {best.tokens_per_s:,.0f} ({best.step_s:.0f} s/step)" \
        if best is not None and best.tokens_per_s else "and no strategy fits"
    others = "; ".join(f"{c.strategy} {c.tokens_per_s:,.0f}" for c in sorted(
        plan.candidates, key=lambda c: -(c.tokens_per_s or 0)) if c.fits and c.applies and c.tokens_per_s)
    return True, (f"recommended over the strategies above: pipeline_parallel {pipe.stages}, one GPU per stage "
                  f"({rate}, {than}; strategies that fit: {others or 'none'}): train with --set "
                  f"pipeline_parallel={pipe.stages} --set grad_accum={pipe.micro_batches}{interleaved} "
                  f"--nproc {pipe.stages}")
