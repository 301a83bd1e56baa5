"""What `plan CONFIG` adds beside the strategies' table: the job `train` would run (resolved as it would be, or
resumed as recorded) and the line recommending it, the pipeline layouts planned beside the strategies, and
the split of every row over GPUs offered where nothing fits."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardfit.cli.plan_args import with_flags
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.objective import get as get_objective
from shardfit.plan.estimate import Candidate
from shardfit.plan.hardware import Hardware, parse_gpus
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.pipeline import LAYOUT_HEADER
from shardfit.plan.plan import Alternative, estimate_all, recommend
from shardfit.plan.workload import Workload, workload_of
from shardfit.strategy import MULTI_RANK

if TYPE_CHECKING:  # resolve/ loads only where a config's job is planned (the functions import it)
    from shardfit.resolve import Resolved
    from shardfit.resolve.pipeline_choice import PipelineChoice
    from shardfit.resolve.resume import Resolution


def resolved_job(cfg: Config, args: argparse.Namespace) -> tuple[Resolved | None, str | None]:
    """The job `train` would run for the config on the hardware planned (as `check` prints it), where output_dir
    holds a run to resume, as train resumes it (resolve/resume.py `resumed_job`); None when no strategy fits it
    (the table says why), with the refusal's first line where it is the resumed run's job that does not fit."""
    from shardfit.resolve import DeviceFacts, resolve_job
    from shardfit.resolve.resume import ResumeDoesNotFit, resumed_job

    if args.gpus:  # planned GPUs compute in bf16
        node = parse_gpus(args.gpus, 1, args.cpu_mem)

        def resolve(c: Config) -> Resolution:
            return resolve_job(c, node, DeviceFacts("cuda", True), nnodes=args.nodes)
    else:
        from shardfit.parallel.job import resolve_here  # torch: detect() has loaded it already

        def resolve(c: Config) -> Resolution:
            return resolve_here(c, nproc=None, nnodes=args.nodes)
    try:
        return resumed_job(cfg, resolve)[0], None
    except ResumeDoesNotFit as e:
        return None, str(e).split("\n")[0]
    except DoesNotFitError:
        return None, None


def resumed_choice(cfg: Config, job: Resolved) -> str:
    """The line recommending the job of the run in output_dir that `train` resumes, where it keeps the job its run
    directory recorded (resolve/resume.py); empty where train resolves the job anew."""
    if not job.kept_as_recorded:
        return ""
    split = f" with each row split over {job.sequence_parallel} GPUs" if job.sequence_parallel > 1 else ""
    stages = f" in {job.pipeline_parallel} pipeline stages" if job.pipeline_parallel > 1 else ""
    return (f"recommended: {job.strategy}{split}{stages}, the job below: the run in {cfg.output_dir} resumes as it "
            "was recorded, which train runs (resume: never, or a new output_dir, resolves the job anew)")


def pipeline_strategies(args: argparse.Namespace, cfg: Config | None) -> tuple[str, ...]:
    """The strategies over a stage's data-parallel GPUs to plan: the one --strategy (or the config) names where it
    runs in stages, else each that does."""
    from shardfit.resolve.pipeline import PP_DP_STRATEGIES

    named = args.strategy if args.strategy not in (None, "all") else (cfg.strategy if cfg is not None else None)
    return (named,) if named in PP_DP_STRATEGIES else PP_DP_STRATEGIES


def auto_choice(cfg: Config, plan: Any, job: Any) -> str:
    """The line recommending the job `strategy: auto` resolved where it is not the plan's best strategy over whole
    rows (auto split the rows over ranks, resolve/decide.py, as train runs the job on these GPUs); empty where it
    is, where the config names the strategy, or where a pipeline's own line recommends it."""
    if cfg.strategy != "auto" or cfg.sequence_parallel != 1 or job.pipeline_parallel > 1 \
            or job.sequence_parallel == 1:
        return ""
    split = plan_for_split(cfg, job)
    rate = f", ~{split.step_s:.0f} s/step, {split.tokens_per_s:,.0f} tokens/s" \
        if split is not None and split.tokens_per_s and split.step_s else ""
    a = plan.adjusted
    lone = f"; {plan.recommended} with whole rows, in one process, trains {c.tokens_per_s:,.0f} tokens/s" \
        if plan.recommended and (c := plan.candidate(plan.recommended)) is not None and c.tokens_per_s else \
        f"; with whole rows only {a.strategy} with {a.what} fits, {a.tokens_per_s:,.0f} tokens/s" \
        if not plan.recommended and a is not None and a.tokens_per_s else ""
    return (f"recommended: {job.strategy} with each row split over {job.sequence_parallel} GPUs "
            f"(sequence_parallel {job.sequence_parallel}{rate}), the job below, which train runs on these "
            f"{job.hardware.world} GPUs{lone}")


def plan_for_split(cfg: Config, job: Any) -> Candidate | None:
    """The job's strategy planned with its rows split as the job runs them (the job's own plan)."""
    from shardfit.plan.choose import plan_for_config

    split = plan_for_config(dataclasses.replace(cfg, sequence_parallel=job.sequence_parallel,
                                                precision=job.precision), job.hardware)
    return split.candidate(job.strategy) if split is not None else None


# The flags that plan the images or audio of another workload than the config's data holds (`with_media`).
MEDIA_FLAGS = ("images_per_sample", "image_size", "image_max_pixels", "audio_per_sample", "audio_seconds")


# The flags that plan other pipelines than those `pipeline_parallel: auto` weighs (every count, as 1F1B).
PIPELINE_FLAGS = ("pipeline_parallel", "pipeline_stages_per_rank", "pipeline_schedule")


def plans_the_job(args: argparse.Namespace, cfg: Config | None) -> bool:
    """Whether the table plans what `train CONFIG` resolves on these GPUs: a config under `strategy: auto`, every
    strategy planned (no --strategy), and no flag that plans another workload (--seq, --batch, --method, media,
    pipelines ...). Only then may the plan's recommendation follow the job auto resolves; else the table's
    recommendation is for what the table plans, which the job line (the config's) does not run."""
    if cfg is None or cfg.strategy != "auto" or args.strategy not in (None, "all"):
        return False
    if any(getattr(args, k) is not None for k in (*MEDIA_FLAGS, *PIPELINE_FLAGS)):
        return False
    base = workload_of(cfg)
    return with_flags(base, args) == base


def job_rivals(args: argparse.Namespace, cfg: Config | None, plan: Any,
               hw: Hardware) -> tuple[list[Candidate] | None, int]:
    """What a pipeline is weighed against: where the table plans the config's own job (`plans_the_job`) on named
    GPUs, what `train` would otherwise run on them with the processes left to auto (resolve/decide.py
    `auto_rivals`, the decision `pipeline_parallel: auto` follows), so that the pipeline recommended is the job's;
    else the plan's recommended strategy (None)."""
    if cfg is None or not args.gpus or hw.world < 2 or not plans_the_job(args, cfg):
        return None, 1
    from shardfit.resolve import DeviceFacts
    from shardfit.resolve.decide import auto_rivals

    whole = dataclasses.replace(cfg, pipeline_parallel=1)
    return auto_rivals(whole, DeviceFacts("cuda", True), plan, None, args.nodes, hw.gpus_per_node)


def named_without_stages(args: argparse.Namespace, choice: PipelineChoice) -> PipelineChoice:
    """`choice` as the plan recommends it where --strategy names a strategy that does not run in stages (single,
    model_parallel, zero3_offload): the layouts stay planned, but the recommendation stays among the strategy
    named, so none of them is recommended."""
    from shardfit.resolve.pipeline import PP_DP_STRATEGIES

    named = args.strategy
    if named in (None, "all") or named in PP_DP_STRATEGIES or not choice.recommended:
        return choice
    return dataclasses.replace(choice, recommended=False, why=(
        f"not {choice.pick.layout}: --strategy {named} plans that strategy alone, and a pipeline's stages run "
        f"{', '.join(PP_DP_STRATEGIES)} (plan with --strategy all to weigh the pipelines)"))


def add_pipelines(args: argparse.Namespace, cfg: Config | None, plan: Any, shape: ModelShape, w: Workload,
                  hw: Hardware, source: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The pipeline layouts planned beside the strategies: their JSON and text lines (a table of the layouts, the
    fastest that fits described, and whether the plan recommends it over the strategies: the decision
    resolve/pipeline_choice.py makes, which `strategy: auto` follows); (None, []) without any."""
    from shardfit.resolve.pipeline import LOOPED, stages_per_rank
    from shardfit.resolve.pipeline_choice import choose_pipeline, rules_config

    configured = cfg.pipeline_parallel if cfg is not None and cfg.pipeline_parallel != "auto" else 1
    asked = args.pipeline_parallel or configured
    per_rank = args.pipeline_stages_per_rank or (stages_per_rank(cfg) if cfg is not None else 1)
    named = args.pipeline_schedule or (cfg.pipeline_schedule if cfg is not None else "1f1b")
    if args.pipeline_schedule == "1f1b":
        per_rank = 1
    elif named in LOOPED and per_rank == 1:  # a looped schedule named without V: the config's (default) V
        per_rank = (cfg or Config()).pipeline_stages_per_rank
    # Looped stages are planned as the schedule named, interleaved 1F1B unless it is zero bubble.
    schedule = "zero_bubble" if named == "zero_bubble" else "interleaved_1f1b"
    looped = asked > 1 and per_rank > 1
    rules = rules_config(cfg, w, schedule if looped else "1f1b")
    rivals, split = job_rivals(args, cfg, plan, hw)
    choice = choose_pipeline(plan, shape, w, hw, source, rules, asked=asked, per_rank=per_rank,
                             names=pipeline_strategies(args, cfg), schedule=schedule, rivals=rivals, split=split)
    if choice is None:
        return None, []
    choice = named_without_stages(args, choice)
    pipe, note, why = choice.pick, choice.note, choice.why
    out = {**pipe.to_json(), "note": note, "recommended": choice.recommended, "versus": why,
           "layouts": [p.to_json() for p in choice.layouts]}
    table = [LAYOUT_HEADER, *(p.row() for p in choice.layouts)] if len(choice.layouts) > 1 or pipe.dp > 1 else []
    return out, [*table, pipe.describe() + (f"\n  {note}" if note else "") + f"\n  {why}"]


def split_alternative(shape: ModelShape, w: Workload, hw: Hardware, source: str) -> Alternative | None:
    """When nothing fits: the fewest GPUs splitting every row (`sequence_parallel`) under which a multi-rank
    strategy fits, found by the rule `strategy: auto` follows (resolve/decide.py `smallest_split`). On several
    nodes, where no split dividing their ranks fits, a split that fits on another node count (fewer nodes first,
    then up to twice as many), the count given as the Alternative's `nodes` and said in its words. None where the
    rows are split already, the split's rules refuse the model or the objective, or no split fits on any of
    those node counts."""
    from shardfit.resolve.decide import smallest_split
    from shardfit.resolve.sequence import check_model, facts_of_shape

    if w.sequence_parallel != 1 or get_objective(w.objective).preference:
        return None

    def allowed(n: int) -> bool:
        try:
            check_model(n, facts_of_shape(shape), source)
        except UserError:
            return False
        return True

    def fits_on(on: Hardware) -> Callable[[int], Candidate | None]:
        def fits(n: int) -> Candidate | None:
            cands = estimate_all(shape, dataclasses.replace(w, sequence_parallel=n), on, MULTI_RANK)
            best, _ = recommend(cands, on)
            return next(c for c in cands if c.strategy == best) if best else None
        return fits

    found = smallest_split(hw.world, allowed, fits_on(hw))
    if found is not None:
        n, c = found
        return Alternative(f"every row split over {n} GPUs", (("sequence_parallel", n),), None, c.strategy,
                           c.per_gpu_gib.total, hw.unit)
    # A split must divide the ranks: on 3 nodes of 8 (24 ranks) a 16-way split, which a 64-head model allows and
    # which fits, cannot be laid out, while 2 or 4 such nodes take it. Fewer nodes first (the GPUs at hand). On one
    # node every split divides some node count: more nodes are the "twice the GPUs" alternative's to offer.
    for nodes in [*range(hw.nodes - 1, 0, -1), *range(hw.nodes + 1, 2 * hw.nodes + 1)] if hw.nodes > 1 else []:
        on = dataclasses.replace(hw, nodes=nodes)
        found = smallest_split(on.world, lambda n: hw.world % n != 0 and allowed(n), fits_on(on))
        if found is not None:
            n, c = found
            return Alternative(f"every row split over {n} GPUs, on {nodes} node(s) ({n} does not divide the "
                               f"{hw.world} ranks of {hw.nodes} nodes: a split must divide the ranks and the heads)",
                               (("sequence_parallel", n),), nodes, c.strategy, c.per_gpu_gib.total, hw.unit)
    return None


def add_job(args: argparse.Namespace, cfg: Config, plan: Any, pipeline: dict[str, Any] | None, out: dict[str, Any],
            table: str, lines: list[str]) -> tuple[str, list[str], str]:
    """The job `train` runs for the config (`resolved_job`) added to the plan's JSON and text: its line and why,
    and where the table plans that job, the recommendation of it (the job auto split, or a resumed run's job);
    the table and lines as they are then, and the line recommending the job (empty where the table's own
    recommendation stands)."""
    job, refused = resolved_job(cfg, args)
    chosen = ""
    if refused:  # train would refuse the resumed run's job before loading: say so with the table
        out["resume_refused"] = refused
        lines = [*lines, refused]
    if job is None:
        return table, lines, chosen
    out["resolved"] = job.to_json()
    if plans_the_job(args, cfg):  # the table plans the job train resolves: recommend that job
        resumed = resumed_choice(cfg, job)
        chosen = resumed or auto_choice(cfg, plan, job)
        if resumed and pipeline is not None and pipeline["recommended"] and job.pipeline_parallel == 1:
            lines = [x.replace("recommended over the strategies above", "fastest over the strategies above")
                     for x in lines]
        if chosen:  # the job, not the best strategy over whole rows (or a smaller micro-batch), is what to run
            table = table.replace("\nrecommended: ", "\nbest strategy: ", 1).replace(
                "\nnothing fits as configured. recommended: ", "\nnothing fits as configured with whole rows: ", 1)
            lines = [*lines, chosen]
        if chosen or (pipeline is not None and pipeline["recommended"] and job.pipeline_parallel > 1):
            out["recommended"] = job.strategy  # the strategy the recommended job runs (`resolved` says how)
    from shardfit.resolve.decide import LONE_WHY, PIPE_WHY, SPLIT_WHY  # resolved_job imported it
    from shardfit.resolve.resume import RESUMED_WHY

    # auto split the rows or turned a pipeline on, a pipeline's lone stages run as ddp, or the run resumes as
    # recorded: why
    return table, [*lines, job.describe(), *(f"  {w}" for w in job.why if w.startswith(
        (SPLIT_WHY, PIPE_WHY, LONE_WHY, RESUMED_WHY)))], chosen
