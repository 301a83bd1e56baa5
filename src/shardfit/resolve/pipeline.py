"""`pipeline_parallel: N`: what this increment runs, decided once before the launch (and again on the built model,
whose config is the ground truth where the planner did not know the shape). Torch-free.

What runs: dense text decoders (Llama, Qwen2, Qwen3, ...), and Qwen2-VL and Qwen2.5-VL with their vision tower on
the first stage (one rank per stage, 1F1B), cut at decoder-block boundaries into N stages, each
stage held by the world / N data-parallel ranks of its group under the strategy (ddp, zero2, zero3; one rank per
stage needs none), trained with LoRA or a full fine-tune under the SFT objective, one micro-batch of the 1F1B
schedule per grad_accum micro-batch (parallel/pipeline.py); or, one rank per stage, N x V stages under interleaved
1F1B or zero bubble, V looped stages per rank. Everything else is refused with exit 2 and the reason, before
anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.attention_layout import count_of, refusal
from shardfit.plan.loaded_config import tied_of_config
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.pipeline import PipelinePlan, plan_pipeline
from shardfit.plan.plan import Plan
from shardfit.plan.shapes import resolve_shape
from shardfit.resolve.dims import ParallelDims
from shardfit.resolve.sequence import facts_of_config as decoder_facts

# Methods this increment trains through a pipeline: adapters over weights in the compute precision, or every weight.
PP_METHODS = ("lora", "full")
# The strategies over a stage's data-parallel ranks: DDP, or FSDP2 sharding over the stage's ranks (the pipeline
# schedule drives both: torch's PipelineStage syncs them on the step's last backward). zero3_offload's host
# round-trips through the schedule are not tried.
PP_DP_STRATEGIES = ("ddp", "zero2", "zero3")
INTERLEAVED = "interleaved_1f1b"
ZERO_BUBBLE = "zero_bubble"
# The schedules that loop several stages over each rank (one rank per stage): torch's interleaved 1F1B, and its
# interleaved zero bubble (ZB1P), which splits each backward into input- and weight-gradient passes.
LOOPED = (INTERLEAVED, ZERO_BUBBLE)
# Vision-language models whose vision tower and image merge the first stage runs (parallel/pipeline.py), with
# M-RoPE positions handed to every stage: tested against one process (tests/test_pipeline_vl.py). Qwen3-VL's
# deepstack features enter the first blocks and are not passed between stages.
PP_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class StageFacts:
    """What the rules need to know of the model: its decoder blocks, whether the input embedding and output head
    share one weight, and whether it is a mixture of experts, multimodal, or has layers that do not attend over the
    whole row."""

    layers: int
    tied: bool = False
    experts: bool = False
    multimodal: bool = False
    partial_attention: bool = False
    attention_kinds: tuple[str, ...] = ()  # what the partial-attention blocks are (plan/attention_layout.py KINDS)
    staged_tower: bool = False  # the multimodal part is a vision tower the first stage runs (PP_VISION_TYPES)


def _prefix(n: int) -> str:
    return f"pipeline_parallel: {n}"


FIX = "or set pipeline_parallel: 1"


def stages_of(cfg: Config) -> int:
    """The config's pipeline_parallel as a count of stages: `auto` is no pipeline (1) until the job resolves it
    (resolve/decide.py `resolve_job`, which records the count it settles on); the one place a raw config's
    pipeline_parallel is read as a number."""
    n = cfg.pipeline_parallel
    return 1 if n == "auto" else int(n)


def check_layout(cfg: Config, world: int, strategy: str | None = None) -> None:
    """The config's pipeline_parallel against the job's ranks, `strategy` (the resolved one; None: not known yet)
    and settings (UserError when refused)."""
    n = stages_of(cfg)
    if n == 1:
        return
    if cfg.sequence_parallel > 1:
        raise UserError(f"{_prefix(n)} with sequence_parallel: {cfg.sequence_parallel}: this version does not split "
                        f"rows inside a pipeline stage: set sequence_parallel: 1, {FIX}.")
    ParallelDims(world=world, pp=n).check()  # names what would divide
    if world > n and strategy is not None and strategy not in PP_DP_STRATEGIES:
        raise UserError(f"{_prefix(n)} on {world} ranks runs {n} stages x {world // n} data-parallel ranks, under "
                        f"strategy {' / '.join(PP_DP_STRATEGIES)} over each stage's ranks, not {strategy}: set "
                        f"strategy: zero3 (or ddp), launch {n} ranks (--nproc {n}, one per stage), {FIX}.")
    if objectives.get(cfg.objective).preference:
        raise UserError(f"{_prefix(n)} trains objective sft only in this version (a preference objective compares "
                        f"the two sides of a pair in one loss, which the stages' micro-batch split would need kept "
                        f"together): use objective: sft, {FIX}.")
    if methods.get(cfg.method).name not in PP_METHODS:
        raise UserError(f"{_prefix(n)} trains method {' or '.join(PP_METHODS)} in this version, not "
                        f"{cfg.method}: set method: lora (or full), {FIX}.")
    if cfg.compile is True:
        raise UserError(f"{_prefix(n)} does not run compiled blocks in this version: set compile: false (or "
                        f"auto), {FIX}.")
    if cfg.grad_accum < n:
        raise UserError(f"{_prefix(n)} with grad_accum: {cfg.grad_accum}: the 1F1B schedule runs the step's "
                        f"grad_accum micro-batches through the stages and needs at least one per stage: set "
                        f"grad_accum: {n} or more (more micro-batches shrink the idle bubble, "
                        f"(stages-1)/(micro-batches+stages-1)), {FIX}.")
    if cfg.pipeline_schedule in LOOPED and world > n:
        raise UserError(f"{_prefix(n)} with pipeline_schedule: {cfg.pipeline_schedule} on {world} ranks: this version "
                        f"interleaves stages with one rank per stage only (a rank's stages share its model, which "
                        f"the strategy would wrap once per stage): set pipeline_schedule: 1f1b, or launch {n} ranks "
                        f"(--nproc {n}), {FIX}.")
    rounds = max(1, cfg.grad_accum // n)
    if cfg.pipeline_schedule in LOOPED and cfg.grad_accum % rounds:
        # torch's looped schedules run the micro-batches in rounds of about one per stage, all of one size
        fits = [m for m in range(n, 4 * n + 1) if m % max(1, m // n) == 0]
        raise UserError(f"{_prefix(n)} with pipeline_schedule: {cfg.pipeline_schedule} and grad_accum: "
                        f"{cfg.grad_accum}: torch's looped schedules run the micro-batches in "
                        f"{rounds} rounds of equal size, which {cfg.grad_accum} does not split into: set grad_accum "
                        f"to one of {', '.join(map(str, fits))} (or a multiple of {n}), or pipeline_schedule: 1f1b, "
                        f"{FIX}.")
    if cfg.eval_metrics:
        raise UserError(f"{_prefix(n)} with eval_metrics: generation through a model cut over ranks is not in this "
                        f"version (the held-out loss is): set eval_metrics: [], {FIX}.")


def stages_per_rank(cfg: Config) -> int:
    """The stages each rank holds: pipeline_stages_per_rank under interleaved 1F1B and zero bubble, else one."""
    return cfg.pipeline_stages_per_rank if cfg.pipeline_schedule in LOOPED else 1


def job_stages(cfg: Config, plan: Plan | None, strategy: str) -> PipelinePlan | None:
    """The pipeline the job runs as the plan plans it: its stages on their data-parallel ranks under `strategy`,
    under the config's schedule (interleaved 1F1B and zero bubble with their looped stages, whose peak is not
    1F1B's); None without a pipeline, a plan, a shape the planner reads, or blocks for every stage (the rules
    refuse those, naming the blocks)."""
    stages, per_rank = stages_of(cfg), stages_per_rank(cfg)
    if plan is None or stages == 1:
        return None
    try:
        shape = resolve_shape(cfg.model)
    except UserError:
        return None
    if shape.layers < stages * per_rank:
        return None
    return plan_pipeline(shape, plan.workload, plan.hardware, stages, per_rank=per_rank,
                         dp=max(1, plan.hardware.world // stages), strategy=strategy,
                         schedule=cfg.pipeline_schedule)


def check_model(n: int, facts: StageFacts, model: str, method: str, per_rank: int = 1) -> None:
    """The model against pipeline_parallel `n` with `per_rank` stages per rank (UserError when refused)."""
    if n == 1:
        return
    why = ("is a mixture of experts" if facts.experts else "has a vision or audio tower other than Qwen2(.5)-VL's"
           if facts.multimodal and not facts.staged_tower
           else refusal(facts.attention_kinds) if facts.partial_attention else None)
    if why is not None:
        raise UserError(f"{_prefix(n)}: {model} {why}; this version cuts dense text decoders with full attention "
                        f"(Llama, Qwen2, Qwen3), Qwen2-VL and Qwen2.5-VL only: train it without a pipeline, {FIX}.")
    if facts.staged_tower and per_rank > 1:
        raise UserError(f"{_prefix(n)}: {model}'s vision tower runs on the first stage of a 1F1B pipeline; this "
                        f"version does not interleave it (pipeline_schedule: {' / '.join(LOOPED)}): set "
                        f"pipeline_schedule: 1f1b, {FIX}.")
    if facts.layers < n * per_rank:
        stages = f"{n} x {per_rank} = {n * per_rank} stages (pipeline_parallel x pipeline_stages_per_rank)" \
            if per_rank > 1 else f"{n} stages"
        fix = f"use a pipeline_stages_per_rank of at most {facts.layers // n}, or pipeline_schedule: 1f1b" \
            if per_rank > 1 and facts.layers >= n else f"use a pipeline_parallel of at most {facts.layers}"
        raise UserError(f"{_prefix(n)}: {model} has {facts.layers} decoder block{'s' if facts.layers != 1 else ''}, "
                        f"fewer than the {stages} (each stage holds at least one block): {fix}, {FIX}.")
    if facts.tied and methods.get(method).trains_base:
        raise UserError(f"{_prefix(n)}: {model} ties its output head to its input embedding, which sit on the first "
                        f"and last stages; a full fine-tune would train the two copies apart. Train it with method: "
                        f"lora (the tied weight stays frozen), {FIX}.")


def facts_of_shape(shape: ModelShape) -> StageFacts:
    """The planner's shape of the model as the rules read it."""
    return StageFacts(layers=shape.layers, tied=shape.tied, experts=shape.experts > 1,
                      multimodal=shape.multimodal,
                      partial_attention=shape.sliding_layers > 0 and shape.sliding_window > 0,
                      attention_kinds=shape.attention_kinds,
                      staged_tower=shape.vision is not None and shape.audio is None and shape.vision.kind in
                      PP_VISION_TYPES)


def facts_of_config(config: Any) -> StageFacts:
    """A built model's (transformers) config as the rules read it: the head tied by the planner's rule for the
    config the rank builds (plan/loaded_config.py `tied_of_config`)."""
    d = decoder_facts(config)
    text = getattr(config, "text_config", None) or config
    tied = tied_of_config(config)
    return StageFacts(layers=count_of(getattr(text, "num_hidden_layers", 0)), tied=tied, experts=d.experts,
                      multimodal=d.multimodal, partial_attention=d.partial_attention, attention_kinds=d.attention_kinds,
                      staged_tower=getattr(config, "model_type", None) in PP_VISION_TYPES)
