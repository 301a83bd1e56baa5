"""Which pipeline a job's GPUs should run, if any: the one decision `shardfit plan` shows below the strategies and
`strategy: auto` with `pipeline_parallel: auto` follows (resolve/decide.py), so that the plan's recommendation and
the job train resolves are the same. Torch-free.

The layouts: N stages for every N of 2 or more that divides the GPUs, that the decoder's blocks allow and that 1F1B
runs on the step's grad_accum micro-batches (or the N asked for), each stage on GPUs / N GPUs under each strategy a
stage's ranks run (plan/pipeline.py `layouts`). The pick is the fastest that fits (plan/pipeline.py `fastest`; of
its stage count's layouts, as train picks the strategy over a stage's ranks for a count the config names), and
the plan recommends it over the strategies when it fits, train runs it (the rules of resolve/pipeline.py, on the
config as planned) and it trains more tokens/s than the strategy it would replace by more than the time model's
precision (5 %), or nothing else fits (plan/pipeline.py `versus`): for `plan`, the plan's recommended strategy; for
`strategy: auto`, what auto would otherwise run on the job's ranks (resolve/decide.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.estimate import Candidate
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.pipeline import PipelinePlan, fastest, layouts, plan_pipeline, rival, rival_name, versus
from shardfit.plan.plan import Plan
from shardfit.plan.workload import Workload
from shardfit.resolve.dims import ParallelDims
from shardfit.resolve.pipeline import PP_DP_STRATEGIES, check_layout, check_model, facts_of_shape


@dataclass(frozen=True)
class PipelineChoice:
    """The layouts planned, the one to train among them (`pick`: the fastest that fits, else the one with the
    smallest fullest stage), what train says against it (`note`, empty when it runs it), and whether the plan
    recommends it over the strategies, with why in numbers."""

    layouts: tuple[PipelinePlan, ...]
    pick: PipelinePlan
    note: str
    recommended: bool
    why: str
    # What the pipeline was weighed against (plan/pipeline.py `rival`), in words, e.g. "zero3's 4,890 (~9 s/step)";
    # empty when nothing else fits.
    against: str = ""


def stage_counts(shape: ModelShape, w: Workload, hw: Hardware, asked: int) -> list[int]:
    """The stages to plan: the count asked for, or (none asked) every count of two or more that divides the GPUs,
    that the blocks allow and that 1F1B can run on the step's grad_accum micro-batches. None on a CPU or one GPU."""
    if asked > 1:
        return [asked]
    if hw.name == "cpu" or hw.world == 1:
        return []
    return [n for n in range(2, hw.world + 1) if hw.world % n == 0 and n <= shape.layers and n <= w.grad_accum]


def rules_config(cfg: Config | None, w: Workload, schedule: str = "1f1b") -> Config:
    """The settings train's pipeline rules read, as planned: the config's (defaults without one) with the
    workload's method, objective, micro-batches and row split, and the schedule planned."""
    base = cfg if cfg is not None else Config()
    return dataclasses.replace(base, method=w.method, objective=w.objective, grad_accum=w.grad_accum,
                               sequence_parallel=w.sequence_parallel, pipeline_schedule=schedule,
                               compile=True if w.compile else base.compile)


def refusal(stages: int, shape: ModelShape, source: str, rules: Config, world: int, per_rank: int = 1) -> str:
    """What train says against `stages` stages (`per_rank` looped stages on each of `world` GPUs) of the model for
    the settings `rules` (`rules_config`): empty when it runs them."""
    try:
        check_model(stages, facts_of_shape(shape), source, rules.method, per_rank=per_rank)
    except UserError as e:
        return f"planned only: train refuses it in this version ({e})"
    try:
        check_layout(dataclasses.replace(rules, pipeline_parallel=stages), world)
    except UserError as e:
        return f"planned only: train refuses it in this version ({e})"
    return ""


def planned_layouts(shape: ModelShape, w: Workload, hw: Hardware, stages: int, source: str, rules: Config,
                    per_rank: int = 1, names: Sequence[str] = ("single",), schedule: str = "interleaved_1f1b"
                    ) -> tuple[list[PipelinePlan], str]:
    """The pipelines of `stages` stages over the GPUs of `hw` under each strategy of `names` (plan/pipeline.py
    `layouts`; interleaved 1F1B, or zero bubble where `schedule` says so: `per_rank` stages on each of `stages`
    GPUs), and what train would say of them (`refusal`; empty: it runs them); more stages than blocks, or stages
    that do not divide the GPUs, is bad input."""
    if stages * per_rank > shape.layers:
        what = f"{stages} x {per_rank} stages" if per_rank > 1 else "stages"
        raise UserError(f"--pipeline-parallel {stages}: {source} has {shape.layers} decoder blocks, fewer than the "
                        f"{what} (each holds at least one block): use at most {shape.layers // per_rank}"
                        f"{' stages, or fewer stages per rank' if per_rank > 1 else ''}.")
    ParallelDims(world=hw.world, pp=stages).check()  # names the counts that divide the GPUs
    # Looped stages are planned with one GPU per stage, which is what train runs them on.
    note = refusal(stages, shape, source, rules, stages if per_rank > 1 else hw.world, per_rank)
    if per_rank > 1:
        if hw.world > stages:
            note = note or (f"planned on {stages} of the {hw.world} GPUs: train interleaves stages with one GPU per "
                            "stage only")
        return [plan_pipeline(shape, w, hw, stages, per_rank, schedule=schedule)], note
    return layouts(shape, w, hw, stages, names), note


def choose_pipeline(plan: Plan, shape: ModelShape, w: Workload, hw: Hardware, source: str, rules: Config, *,
                    asked: int = 1, per_rank: int = 1, names: Sequence[str] = PP_DP_STRATEGIES,
                    schedule: str = "interleaved_1f1b", rivals: Sequence[Candidate] | None = None,
                    split: int = 1) -> PipelineChoice | None:
    """The pipelines planned beside the strategies of `plan` (the `asked` stages, or every count `stage_counts`
    gives, as 1F1B), the one to train and whether the plan recommends it (`versus`, against `rivals` split over
    `split` ranks: what `strategy: auto` would otherwise run; None: the plan's recommendation); None when there is
    none to plan."""
    pipes: list[PipelinePlan] = []
    notes: dict[int, str] = {}
    for stages in stage_counts(shape, w, hw, asked):
        found, notes[stages] = planned_layouts(shape, w, hw, stages, source, rules, per_rank if asked > 1 else 1,
                                               names, schedule)
        pipes += found
    if not pipes:
        return None
    pick = fastest(pipes)
    # The strategy over the stages' ranks as train picks it for that many stages (resolve/decide.py
    # `_auto_pipeline`): the fastest of that count's layouts, which a tie across counts could make another.
    pick = fastest([p for p in pipes if p.stages == pick.stages]) if pick is not None else \
        min(pipes, key=lambda p: p.stage_gib)
    recommended, why = versus(plan, pick, notes[pick.stages], rivals, split)
    best, _ = rival(plan, rivals)
    against = f"{rival_name(best, split)}'s {best.tokens_per_s:,.0f} (~{best.step_s:.0f} s/step)" \
        if best is not None and best.tokens_per_s and best.step_s else ""
    return PipelineChoice(tuple(pipes), pick, notes[pick.stages], recommended, why, against)
