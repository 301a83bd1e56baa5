"""The plan of a pipeline (`pipeline_parallel: N`, one GPU per stage): the most loaded stage's memory, the bubble
of the 1F1B schedule and the point-to-point traffic of the activations, in one optimizer step. Torch-free.

Memory: a stage holds ceil(blocks / N) decoder blocks with their weights, gradients and optimizer states, and,
under 1F1B, the first stage keeps the activations of up to N micro-batches in flight (min(N, grad_accum)): one
micro-batch at its peak, the others' saved activations (with checkpointing, each block's input). The first stage
is the one counted: the input embedding and a multimodal model's tower, no output head (the last stage's; its
loss buffers are counted too, which errs on the large side).

Time: a micro-batch's compute on one GPU of the whole model (plan/timing.py), split evenly over the stages; the
1F1B step takes (micro-batches + stages - 1) slots of one stage's forward and backward, of which stages - 1 are
the bubble, (stages-1)/(micro-batches+stages-1) of the step; each slot sends the hidden states of a micro-batch
forward and their gradient back over the link between neighbouring GPUs (the network across nodes).

Interleaved 1F1B (V stages per GPU, looped): a slot is one virtual stage's share, 1/V of a GPU's blocks, and the
step takes (V x micro-batches + stages - 1) of them, so the bubble shrinks to (stages-1)/(V x micro-batches +
stages-1) while V times as many hidden states cross the links. The first GPU keeps more activations in flight:
torch's warm-up runs (V-1) x (micro-batches per round) + 2 (stages-1) chunks ahead of the first backward, each
chunk 1/V of its blocks' activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardfit.plan.cards import card_of
from shardfit.plan.estimate import (
    GIB,
    activation_bytes,
    checkpointed_block_bytes_per_token,
    compute_bytes,
    estimate,
    head_weight_bytes,
)
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload


@dataclass(frozen=True)
class PipelinePlan:
    """One step of an N-stage pipeline: the first stage's peak (GiB) against the card, the bubble's share of the
    step, the activations' point-to-point seconds on its critical path, the step and the job's tokens/s."""

    stages: int
    micro_batches: int
    blocks_per_stage: int
    stage_gib: float
    card_gib: float
    bubble: float
    p2p_s: float
    step_s: float
    tokens_per_s: float
    fits: bool  # the first stage's peak (runtime overhead included) within the card
    per_rank: int = 1  # stages per GPU: 1 under 1F1B, V under interleaved 1F1B

    def describe(self) -> str:
        """One line for the plan's text output."""
        verdict = "fits" if self.fits else "does not fit"
        schedule = "1F1B" if self.per_rank == 1 else f"interleaved 1F1B, {self.per_rank} stages per GPU"
        return (f"pipeline {self.stages} stages x {self.micro_batches} micro-batches ({schedule}, "
                f"{self.blocks_per_stage} blocks per GPU): first stage {self.stage_gib:.1f} of "
                f"{self.card_gib:.0f} GiB ({verdict}); bubble {100 * self.bubble:.0f}% of the step, activations "
                f"point-to-point {self.p2p_s:.2f} s; ~{self.step_s:.2f} s/step, {self.tokens_per_s:,.0f} tokens/s")

    def to_json(self) -> dict[str, float | int | bool]:
        out = dataclasses.asdict(self)
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


def plan_pipeline(shape: ModelShape, w: Workload, hw: Hardware, stages: int, per_rank: int = 1) -> PipelinePlan:
    """The pipeline of `stages` GPUs of `hw`, each running `w.grad_accum` micro-batches a step through its one stage
    (1F1B) or its `per_rank` looped stages (interleaved 1F1B)."""
    # The first GPU's blocks: its stages 0, N, 2N, ... of the N x V, the earlier stages taking the remainder's.
    base, extra = divmod(shape.layers, stages * per_rank)
    blocks = sum(base + (1 if s < extra else 0) for s in range(0, stages * per_rank, stages))
    one_gpu = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
    m = w.grad_accum
    held_batches = in_flight(stages, m, per_rank)
    stage_shape = dataclasses.replace(shape, layers=blocks)
    one = estimate(stage_shape, w, one_gpu, "single")  # the blocks, embedding, tower, head: one micro-batch
    # The first stage: no output head (unless tied: it is the embedding), and the inputs the other micro-batches in
    # flight keep until their backward (every saved activation without checkpointing).
    head = 0.0 if shape.tied else head_weight_bytes(shape, w)
    held = activation_bytes(stage_shape, w, blocks) if w.grad_ckpt == "none" else \
        w.tokens * blocks * checkpointed_block_bytes_per_token(stage_shape, w, "single")
    stage_gib = one.per_gpu_gib.total + ((held_batches - 1) * held - head) / GIB
    # A micro-batch's time and the step's fixed part (the optimizer) on one GPU, from two accumulation lengths.
    one = step_time(shape, dataclasses.replace(w, grad_accum=1), one_gpu, "single").step_s
    two = step_time(shape, dataclasses.replace(w, grad_accum=2), one_gpu, "single").step_s
    per_micro, fixed = two - one, 2 * one - two
    card = card_of(hw)
    bw = card.link if stages <= hw.gpus_per_node else card.nic
    hop = 2 * (w.tokens * shape.hidden * compute_bytes(w) / bw + card.latency_s)  # forward and backward sends
    slots = per_rank * m + stages - 1  # each a virtual stage's forward and backward of one micro-batch
    p2p = slots * hop
    step = slots * per_micro / (stages * per_rank) + p2p + fixed / stages
    return PipelinePlan(stages=stages, micro_batches=m, blocks_per_stage=blocks, stage_gib=stage_gib,
                        card_gib=hw.gpu_mem_gib, bubble=bubble(stages, m, per_rank), p2p_s=p2p, step_s=step,
                        tokens_per_s=w.tokens * m / step, fits=stage_gib <= hw.gpu_mem_gib, per_rank=per_rank)
