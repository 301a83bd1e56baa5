"""The job of a run that resumes: the one rule by which `train` (launching or in a rank torchrun or srun started),
`check` and `plan` resolve a config whose output_dir holds a run to resume. Resolving anew may change the run's
global batch (auto's rules change, another strategy or split changes the data-parallel ranks), which the resume
refuses (train/rundir.py `claim`); the job the run directory recorded then runs in its place, where it keeps the
batch and fits. Torch-free: it reads the files shardfit wrote into the run directory as data only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.plan import Plan
from shardfit.plan.render import format_table
from shardfit.resolve.decide import settled
from shardfit.resolve.job import Resolved
from shardfit.resolve.pipeline import LOOPED, job_stages

RUN_FILE = "run.json"
# The pipeline schedules a recorded config.yaml may name (resolve/pipeline.py).
SCHEDULES = ("1f1b", *LOOPED)
# How the reason of a job kept from the run directory begins (`plan CONFIG` prints it under the job's line).
RESUMED_WHY = "resumed as recorded"

Resolution = tuple[Resolved, Plan | None]
Resolver = Callable[[Config], Resolution]


class ResumeDoesNotFit(DoesNotFitError):
    """The job a run that resumes keeps from its run directory is predicted not to fit (exit 3, as any job
    predicted not to fit); `plan` says so beside its table."""


def read_run_file(run_dir: Path) -> dict[str, Any] | None:
    """run.json of `run_dir` (the run's fingerprint, written as it starts), or None where there is none."""
    try:
        return json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def _read_record(path: Path, parse: Callable[[str], Any]) -> Any:
    """A file shardfit wrote into the run directory, read as data only; None where it is missing or unreadable."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None


def recorded_pipeline(cfg: Config) -> tuple[Config, str | None]:
    """`pipeline_parallel: auto` on a run that resumes: the stages (and schedule) its run directory's config.yaml
    recorded, with a line saying so. A run started before auto could turn a pipeline on, or resolved otherwise,
    would else be resolved anew, and a pipeline changes the global batch, which the resume refuses (`claim`).
    `cfg` as it is where nothing is to resume (no run.json, `resume: never`) or the key is set."""
    run_dir = Path(cfg.output_dir)
    if cfg.pipeline_parallel != "auto" or cfg.resume == "never" or read_run_file(run_dir) is None:
        return cfg, None
    recorded = _read_record(run_dir / "config.yaml", yaml.safe_load)
    if not isinstance(recorded, dict):
        return cfg, None
    n = recorded.get("pipeline_parallel", 1)  # absent: a run from before the key, without a pipeline
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return cfg, None
    schedule = recorded.get("pipeline_schedule")
    kept = dataclasses.replace(cfg, pipeline_parallel=n, **(
        {"pipeline_schedule": schedule} if n > 1 and schedule in SCHEDULES else {}))
    return kept, (f"pipeline_parallel auto -> {n}: kept from {run_dir / 'config.yaml'}, the run this one resumes "
                  "(set pipeline_parallel to choose otherwise, or resume: never to start over)")


def recorded_job(cfg: Config) -> tuple[Config, list[str]]:
    """`strategy: auto` on a run that resumes: the job its run directory recorded, which `resumed_job` falls back
    to: the pipeline (`recorded_pipeline`), and where the config also leaves the row split to auto
    (sequence_parallel 1), the strategy and split (preflight.json's strategy, else summary.json's resolved one;
    config.yaml's sequence_parallel), with the lines saying so. `cfg` as the pipeline leaves it where nothing is
    to resume, a strategy is named, the split is set or the run's pipeline was another."""
    kept, line = recorded_pipeline(cfg)
    lines = [line] if line else []
    run_dir = Path(cfg.output_dir)
    if cfg.strategy != "auto" or cfg.sequence_parallel != 1 or cfg.resume == "never" \
            or read_run_file(run_dir) is None:
        return kept, lines
    recorded = _read_record(run_dir / "config.yaml", yaml.safe_load)
    name = _recorded_strategy(run_dir)
    if not isinstance(recorded, dict) or name is None:
        return kept, lines
    sp = recorded.get("sequence_parallel", 1)  # absent: a run from before the key, its rows whole
    pp = recorded.get("pipeline_parallel", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1 or pp != kept.pipeline_parallel:
        return kept, lines
    lines.append(f"strategy auto -> {name}, sequence_parallel {sp}: kept from {run_dir}, the run this one resumes "
                 "(set a strategy to choose otherwise, or resume: never to start over)")
    return dataclasses.replace(kept, strategy=name, sequence_parallel=sp), lines


def _recorded_strategy(run_dir: Path) -> str | None:
    """The strategy the run in `run_dir` resolved: preflight.json's (written as it starts), else summary.json's
    resolved job (written as it ends); None where neither names one shardfit knows."""
    preflight = _read_record(run_dir / "preflight.json", json.loads)
    summary = _read_record(run_dir / "summary.json", json.loads)
    resolved = summary.get("resolved") if isinstance(summary, dict) else None
    for record in (preflight, resolved):
        name = record.get("strategy") if isinstance(record, dict) else None
        if isinstance(name, str) and name in strategies.NAMES:
            return name
    return None


def global_batch(cfg: Config, job: Resolved) -> int:
    """Examples per optimizer step: the global batch the run's fingerprint records (train/rundir.py
    `fingerprint`)."""
    return cfg.micro_batch * cfg.grad_accum * job.dims.dp


def resumed_job(cfg: Config, resolve: Resolver) -> Resolution:
    """The job `cfg` runs and its plan, as `resolve` resolves it anew, unless the run it resumes would then be
    refused: auto's choice for the same config changes as its rules do (one process's model_parallel may give way
    to rows split over every GPU), and another strategy, split or pipeline changes the data-parallel ranks and so
    the global batch, which the resume refuses (`claim`). Only where the job resolved anew changes run.json's
    global batch and the recorded job (`recorded_job`) keeps it is the recorded one run, its reasons first in `why`
    (the launcher's log, summary.json, `check`, `plan`). It is planned as any job resolved: where it is predicted
    not to fit (and `force` is off), the resume is refused before anything loads (ResumeDoesNotFit, exit 3),
    naming the micro_batch and grad_accum that keep the batch and fit, or, where no smaller micro_batch does, how
    to start over (unless the new job runs here: it then runs, and `claim` names the grad_accum that keeps the
    batch on its ranks). Where the recorded job cannot run here (other GPUs, --nproc) or keeps no more than the new
    one, the new one runs, and `claim` says what differs. Every entry point calls this: the same run directory
    gives the same job whatever started it."""
    kept, lines = recorded_job(cfg)
    if not lines:
        return resolve(cfg)
    run = read_run_file(Path(cfg.output_dir)) or {}
    target = (run.get("fingerprint") or {}).get("global_batch_examples") if isinstance(run, dict) else None
    fresh: Resolution | DoesNotFitError | UserError
    try:
        fresh = resolve(cfg)
    except (DoesNotFitError, UserError) as e:  # the recorded job may still fit and keep the run
        fresh = e
    if isinstance(fresh, tuple) and (not isinstance(target, int) or global_batch(cfg, fresh[0]) == target):
        return fresh
    recorded = _keeping(kept, target, resolve)
    if recorded is None:
        if not isinstance(fresh, tuple):
            raise fresh
        return fresh
    job, plan = recorded
    anew = (f"{fresh[0].strategy}, sequence_parallel {fresh[0].sequence_parallel}, pipeline_parallel "
            f"{fresh[0].pipeline_parallel}, a global batch of {global_batch(cfg, fresh[0])} examples"
            if isinstance(fresh, tuple) else str(fresh).split("\n")[0])
    if not cfg.force and not _fits(kept, job, plan)[0]:
        fix = smaller_micro_batch(kept, target, resolve)
        if fix is None and isinstance(fresh, tuple):
            return fresh  # `claim` refuses it naming what differs, and the grad_accum that keeps the batch there
        raise ResumeDoesNotFit(_misfit(kept, job, plan, target, anew, fix))
    why = (f"{RESUMED_WHY}: the run in {cfg.output_dir} trains a global batch of {target} examples (run.json), "
           f"which the recorded job keeps; resolved anew: {anew}")
    return dataclasses.replace(job, why=(*lines, why, *job.why)), plan


def _keeping(kept: Config, target: Any, resolve: Resolver) -> Resolution | None:
    """The recorded job `kept` resolved here, where it can run here and trains the run's global batch `target`;
    else None."""
    try:
        recorded = resolve(kept)
    except (DoesNotFitError, UserError):
        return None
    return recorded if global_batch(kept, recorded[0]) == target else None


def _fits(cfg: Config, job: Resolved, plan: Plan | None) -> tuple[bool, float, float]:
    """Whether the plan predicts `job` of `cfg` to fit, with the GiB it takes per GPU (a pipeline's: its fullest
    stage's) and the card's; a job the planner cannot plan (no shape, no candidate) is taken to fit, as the rank's
    own checks take it (plan/choose.py `refuse_if_oom`)."""
    if plan is None:
        return True, 0.0, 0.0
    if job.pipeline_parallel > 1:
        pipe = job_stages(settled(cfg, job), plan, job.strategy)
        return (True, 0.0, 0.0) if pipe is None else (pipe.fits, pipe.stage_gib, pipe.card_gib)
    c = plan.candidate(job.strategy)
    return (True, 0.0, 0.0) if c is None else (c.fits, c.per_gpu_gib.total, plan.hardware.gpu_mem_gib)


def smaller_micro_batch(kept: Config, target: Any, resolve: Resolver) -> tuple[int, int, float] | None:
    """The largest micro_batch below `kept`'s, with the grad_accum that keeps its examples a step, under which the
    recorded job trains the run's global batch `target` and fits (micro_batch, grad_accum, GiB per GPU); None
    where no smaller one does."""
    per_rank = kept.micro_batch * kept.grad_accum
    for m in range(kept.micro_batch - 1, 0, -1):
        if per_rank % m:
            continue
        smaller = dataclasses.replace(kept, micro_batch=m, grad_accum=per_rank // m)
        found = _keeping(smaller, target, resolve)
        if found is not None:
            fits, gib, _ = _fits(smaller, *found)
            if fits:
                return m, per_rank // m, gib
    return None


def _misfit(kept: Config, job: Resolved, plan: Plan | None, target: Any, anew: str,
            fix: tuple[int, int, float] | None) -> str:
    """Why the recorded job of a run that resumes is refused: it keeps the run's global batch but is predicted
    not to fit; the micro_batch and grad_accum that keep both (`fix`, `smaller_micro_batch`), where there are,
    else how to start over."""
    _, gib, card = _fits(kept, job, plan)
    what = f"{job.strategy}, sequence_parallel {job.sequence_parallel}, pipeline_parallel {job.pipeline_parallel}"
    how = (f"To keep the run, resume it with --set micro_batch={fix[0]} --set grad_accum={fix[1]} (the same "
           f"{target} examples a step, {fix[2]:.1f} GiB per GPU); or use a new output_dir, or --set resume=never "
           "to start over there." if fix is not None else
           "No smaller micro_batch makes it fit with the same examples a step: use a new output_dir, or --set "
           "resume=never to start over there (or set force: true to start it anyway).")
    table = f"\n{format_table(plan, style='config')}" if plan is not None and job.pipeline_parallel == 1 else ""
    return (f"output_dir {kept.output_dir} holds a run that resumes only as it was recorded ({what}: the run's "
            f"global batch of {target} examples, run.json), and that job at micro_batch {kept.micro_batch} x "
            f"grad_accum {kept.grad_accum} is predicted not to fit: {gib:.1f} of {card:.0f} GiB per GPU (resolved "
            f"anew: {anew}). {how}{table}")
