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

from shardfit import method as methods
from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.plan import Plan
from shardfit.plan.render import format_table
from shardfit.resolve.decide import settled
from shardfit.resolve.fits import memory_verdict
from shardfit.resolve.job import Resolved
from shardfit.resolve.pipeline import LOOPED

RUN_FILE = "run.json"
# The pipeline schedules a recorded config.yaml may name (resolve/pipeline.py).
SCHEDULES = ("1f1b", *LOOPED)
# How the reason of a job kept from the run directory begins (`plan CONFIG` prints it under the job's line).
RESUMED_WHY = "resumed as recorded"
# Keys of the schedule's length: a longer schedule of the same job continues from its last checkpoint; the trained
# result of the steps done so far is the same, the rest of the schedule now reaches further.
LENGTH_KEYS = ("epochs", "max_steps")
# Keys of run.json's fingerprint the keep rule does not compare: the global batch (what it keeps), the schedule's
# length (a longer one continues the run) and the data's digests (reading the data is the rank's; `claim` compares
# them before anything trains).
UNCOMPARED = ("global_batch_examples", "data", "eval_data", *LENGTH_KEYS)

Resolution = tuple[Resolved, Plan | None]
Resolver = Callable[[Config], Resolution]


class ResumeDoesNotFit(DoesNotFitError):
    """The job a run that resumes keeps from its run directory is predicted not to fit (exit 3, as any job
    predicted not to fit); `plan` says so beside its table."""


def read_run_file(run_dir: Path) -> dict[str, Any] | None:
    """run.json of `run_dir` (the run's fingerprint, written as it starts), or None where there is none or it is
    not JSON. UserError where it is JSON shardfit does not write (not an object, a fingerprint that is not one, or
    nested too deeply to read): what it holds cannot be told from another run's."""
    path = run_dir / RUN_FILE
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    except RecursionError:
        raise UserError(_not_ours(path, "it is nested too deeply to read")) from None
    if not isinstance(run, dict):
        raise UserError(_not_ours(path, f"it holds a JSON {type(run).__name__}, not an object"))
    if not isinstance(run.get("fingerprint") or {}, dict):
        raise UserError(_not_ours(path, "its fingerprint is not an object"))
    return run


def _not_ours(path: Path, why: str) -> str:
    """The refusal of a file in a run directory that shardfit did not write as it is (hand-edited or another
    tool's)."""
    return (f"{path} is not a file shardfit wrote ({why}). Move it away, use a new output_dir, or --set "
            "resume=never to start over there.")


def _read_record(path: Path, parse: Callable[[str], Any]) -> Any:
    """A file shardfit wrote into the run directory, read as data only; None where it is missing or unreadable.
    UserError where it is nested too deeply to parse (hand-edited: shardfit writes flat records)."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None
    except RecursionError:
        raise UserError(_not_ours(path, "it is nested too deeply to read")) from None


def run_settings(cfg: Config) -> dict[str, Any]:
    """The keys of a run's fingerprint (train/rundir.py `fingerprint`) read from the config alone: every one but
    the data's digests and the global batch, as run.json holds them."""
    lora = cfg.lora
    return {
        "model": cfg.model, "eval_split": cfg.eval_split, "method": cfg.method,
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": lora.targets}
        if methods.get(cfg.method).adapters else None,
        "freeze_trainable": cfg.freeze_trainable, "drop_modules": cfg.drop_modules,
        "freeze_modules": cfg.freeze_modules, "max_seq_len": cfg.max_seq_len, "packing": cfg.packing,
        "lr": cfg.lr, "warmup_ratio": cfg.warmup_ratio, "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm, "epochs": cfg.epochs, "max_steps": cfg.max_steps, "seed": cfg.seed,
        # Only when set: the fingerprints of runs from before the key stay what they were.
        **({"data_columns": cfg.data_columns} if cfg.data_columns else {}),
    }


def same_run(recorded: dict[str, Any], cfg: Config) -> bool:
    """Whether run.json's fingerprint `recorded` is `cfg`'s run but for the keys the keep rule leaves aside
    (UNCOMPARED): only then can keeping the recorded job make the resume one `claim` accepts."""
    mine = json.loads(json.dumps(run_settings(cfg)))  # as run.json holds it: tuples as lists
    return all(recorded.get(k) == mine.get(k) for k in dict.fromkeys([*recorded, *mine]) if k not in UNCOMPARED)


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


def keeping_grad_accum(target: Any, micro_batch: int, dp: int) -> int | None:
    """The grad_accum under which `dp` data-parallel ranks at `micro_batch` train the run's global batch `target`
    (examples a step); None where none does."""
    per_accum = micro_batch * dp
    if isinstance(target, bool) or not isinstance(target, int) or per_accum < 1 or target < per_accum \
            or target % per_accum:
        return None
    return target // per_accum


def resumed_job(cfg: Config, resolve: Resolver) -> Resolution:
    """The job `cfg` runs and its plan, as `resolve` resolves it anew, unless the run it resumes would then be
    refused: auto's choice for the same config changes as its rules do (one process's model_parallel may give way
    to rows split over every GPU), and another strategy, split or pipeline changes the data-parallel ranks and so
    the global batch, which the resume refuses (`claim`). Only where run.json records this config's run (`same_run`:
    another lr, say, is another run, which `claim` refuses naming it), the job resolved anew changes its global
    batch and the recorded job (`recorded_job`) keeps it is the recorded one run, its reasons first in `why`
    (the launcher's log, summary.json, `check`, `plan`). It is planned as any job resolved: where it is predicted
    not to fit (and `force` is off), the resume is refused before anything loads (ResumeDoesNotFit, exit 3),
    naming the micro_batch and grad_accum, grad_ckpt: full, or (where neither alone does) both together that keep
    the batch and fit, and the grad_accum
    that keeps it on the job resolved anew, or, where neither does, how to start over (unless the new job runs
    here: it then runs, and `claim` names the grad_accum that keeps the batch on its ranks). Where the recorded
    job cannot run here (other GPUs, --nproc) or keeps no more than the new one, the new one runs, and `claim` says
    what differs.
    Every entry point calls this: the same run directory gives the same job whatever started it."""
    kept, lines = recorded_job(cfg)
    if not lines:
        return resolve(cfg)
    recorded = (read_run_file(Path(cfg.output_dir)) or {}).get("fingerprint") or {}
    if not same_run(recorded, cfg):
        return resolve(cfg)
    target = recorded.get("global_batch_examples")
    fresh: Resolution | DoesNotFitError | UserError
    try:
        fresh = resolve(cfg)
    except (DoesNotFitError, UserError) as e:  # the recorded job may still fit and keep the run
        fresh = e
    if isinstance(fresh, tuple) and (not isinstance(target, int) or global_batch(cfg, fresh[0]) == target):
        return fresh
    keeping = _keeping(kept, target, resolve)
    if keeping is None:
        if not isinstance(fresh, tuple):
            raise fresh
        return fresh
    job, plan = keeping
    anew = (f"{fresh[0].strategy}, sequence_parallel {fresh[0].sequence_parallel}, pipeline_parallel "
            f"{fresh[0].pipeline_parallel}, a global batch of {global_batch(cfg, fresh[0])} examples"
            if isinstance(fresh, tuple) else str(fresh).split("\n")[0].rstrip(". "))
    if not cfg.force and not _fits(kept, job, plan)[0]:
        fix = smaller_micro_batch(kept, target, resolve)
        ckpt = with_checkpointing(kept, target, resolve)
        # Both changes at once only where neither alone fits: the fewer keys a resume changes, the better.
        both = checkpointed_smaller(kept, target, resolve) if fix is None and ckpt is None else None
        if fix is None and ckpt is None and both is None and isinstance(fresh, tuple):
            return fresh  # `claim` refuses it naming what differs, and the grad_accum that keeps the batch there
        other = _anew_keeping(cfg, fresh[0], target, resolve) if isinstance(fresh, tuple) else None
        raise ResumeDoesNotFit(_misfit(kept, job, plan, target, anew, (fix, ckpt, both), other))
    why = (f"{RESUMED_WHY}: the run in {cfg.output_dir} trains a global batch of {target} examples (run.json), "
           f"which the recorded job keeps; resolved anew: {anew}")
    return dataclasses.replace(job, why=(*lines, why, *job.why), kept_as_recorded=True), plan


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
    stage's) and the card's: resolve/fits.py `memory_verdict`, the rule the rank refuses by."""
    verdict = memory_verdict(plan, job.strategy, settled(cfg, job))
    return verdict.fits, verdict.gib, verdict.card_gib


def _rate(cfg: Config, job: Resolved, plan: Plan | None) -> float | None:
    """The tokens/s the plan predicts for `job` of `cfg` (a pipeline's: its stages'); None where it has none."""
    return memory_verdict(plan, job.strategy, settled(cfg, job)).tokens_per_s


# A way to resume: (micro_batch, grad_accum, GiB per GPU, tokens/s or None).
Way = tuple[int, int, float, float | None]


def smaller_micro_batch(kept: Config, target: Any, resolve: Resolver) -> Way | None:
    """The largest micro_batch below `kept`'s, with the grad_accum that keeps its examples a step, under which the
    recorded job trains the run's global batch `target` and fits; None where no smaller one does."""
    per_rank = kept.micro_batch * kept.grad_accum
    for m in range(kept.micro_batch - 1, 0, -1):
        if per_rank % m:
            continue
        smaller = dataclasses.replace(kept, micro_batch=m, grad_accum=per_rank // m)
        found = _keeping(smaller, target, resolve)
        if found is not None:
            fits, gib, _ = _fits(smaller, *found)
            if fits:
                return m, per_rank // m, gib, _rate(smaller, *found)
    return None


def with_checkpointing(kept: Config, target: Any, resolve: Resolver) -> Way | None:
    """The recorded job `kept` at its own micro_batch and grad_accum with every block checkpointed (grad_ckpt:
    full, which recomputes activations in the backward and leaves the trained result as it is), where it then
    trains the run's global batch `target` and fits; None where checkpointing is on already or does not help."""
    if kept.grad_ckpt == "full":
        return None
    checkpointed = dataclasses.replace(kept, grad_ckpt="full")
    found = _keeping(checkpointed, target, resolve)
    if found is None:
        return None
    fits, gib, _ = _fits(checkpointed, *found)
    return (kept.micro_batch, kept.grad_accum, gib, _rate(checkpointed, *found)) if fits else None


def checkpointed_smaller(kept: Config, target: Any, resolve: Resolver) -> Way | None:
    """grad_ckpt: full together with the largest micro_batch below `kept`'s (and the grad_accum that keeps its
    examples a step) under which the recorded job trains the run's global batch `target` and fits; None where
    checkpointing is on already or no such micro_batch fits."""
    if kept.grad_ckpt == "full":
        return None
    return smaller_micro_batch(dataclasses.replace(kept, grad_ckpt="full"), target, resolve)


def _anew_keeping(cfg: Config, fresh: Resolved, target: Any, resolve: Resolver) -> tuple[Way, Resolved] | None:
    """The grad_accum under which the job resolved anew (`fresh`, at `cfg`'s micro_batch) trains the run's global
    batch `target`, where it then still resolves to a job that keeps it and fits, with that job; else None."""
    accum = keeping_grad_accum(target, cfg.micro_batch, fresh.dims.dp)
    if accum is None or accum == cfg.grad_accum:
        return None
    other = dataclasses.replace(cfg, grad_accum=accum)
    try:
        job, plan = resolve(other)
    except (DoesNotFitError, UserError):
        return None
    fits, gib, _ = _fits(other, job, plan)
    if global_batch(other, job) != target or not fits:
        return None
    return (cfg.micro_batch, accum, gib, _rate(other, job, plan)), job


def _speed(rate: float | None) -> str:
    return "" if rate is None else f", {rate:,.0f} tokens/s"


def _misfit(kept: Config, job: Resolved, plan: Plan | None, target: Any, anew: str,
            ways: tuple[Way | None, Way | None, Way | None], other: tuple[Way, Resolved] | None) -> str:
    """Why the recorded job of a run that resumes is refused: it keeps the run's global batch but is predicted
    not to fit; the micro_batch and grad_accum that keep both (`ways[0]`, `smaller_micro_batch`), checkpointing
    that does (`ways[1]`, `with_checkpointing`) and the two together (`ways[2]`, `checkpointed_smaller`), where
    there are, and the grad_accum that keeps the batch on the job resolved anew (`other`, `_anew_keeping`), else
    how to start over. Not resolve/fits.py `refusal_line`: this refuses a run's recorded job, not a strategy, with
    several ways to keep the run rather than one fix, and check raises it before any finding exists (exit 3) as
    train does; it ends with the same force tail."""
    _, gib, card = _fits(kept, job, plan)
    fix, ckpt, both = ways
    what = f"{job.strategy}, sequence_parallel {job.sequence_parallel}, pipeline_parallel {job.pipeline_parallel}"
    alt = ""
    if other is not None:
        (_, accum, other_gib, rate), new = other
        alt = (f"; or --set grad_accum={accum}, which keeps the batch on the job resolved anew ({new.strategy}, "
               f"sequence_parallel {new.sequence_parallel}, pipeline_parallel {new.pipeline_parallel}: "
               f"{other_gib:.1f} GiB per GPU{_speed(rate)})")
    keeps = []
    if fix is not None:
        keeps.append(f"--set micro_batch={fix[0]} --set grad_accum={fix[1]} (the same {target} examples a step, "
                     f"{fix[2]:.1f} GiB per GPU{_speed(fix[3])})")
    if ckpt is not None:
        keeps.append(f"--set grad_ckpt=full (every block's activations recomputed in the backward: the same "
                     f"micro_batch {ckpt[0]} x grad_accum {ckpt[1]} and trained result, {ckpt[2]:.1f} GiB per "
                     f"GPU{_speed(ckpt[3])})")
    if both is not None:
        keeps.append(f"--set grad_ckpt=full --set micro_batch={both[0]} --set grad_accum={both[1]} (every block's "
                     f"activations recomputed in the backward, and the same {target} examples a step: "
                     f"{both[2]:.1f} GiB per GPU{_speed(both[3])})")
    how = (f"To keep the run, resume it with {'; or with '.join(keeps)}{alt}; or use a new output_dir, or --set "
           "resume=never to start over there (or set force: true to start it anyway)." if keeps else
           "No smaller micro_batch, nor checkpointing, makes it fit with the same examples a step: use a new "
           "output_dir, or --set resume=never to start over there (or set force: true to start it anyway).")
    table = f"\n{format_table(plan, style='config')}" if plan is not None and job.pipeline_parallel == 1 else ""
    return (f"output_dir {kept.output_dir} holds a run that resumes only as it was recorded ({what}: the run's "
            f"global batch of {target} examples, run.json), and that job at micro_batch {kept.micro_batch} x "
            f"grad_accum {kept.grad_accum} is predicted not to fit: {gib:.1f} of {card:.0f} GiB per GPU (resolved "
            f"anew: {anew}). {how}{table}")
