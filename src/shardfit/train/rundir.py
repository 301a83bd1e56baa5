"""Who owns a run directory: one training at a time (a lock file), and only the run that wrote the checkpoints
resumes from them (a fingerprint of what determines the weights, in run.json).

Rank 0 makes every decision about the directory; the verdict is broadcast, so all ranks stop together with the
same message instead of some waiting forever in a collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import yaml

from shardfit import method as methods
from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.parallel.env import DistEnv
from shardfit.resolve.job import Resolved
from shardfit.resolve.pipeline import LOOPED

LOCK = ".shardfit.lock"
RUN_FILE = "run.json"
# What a run writes; `resume: never` removes these before it starts over.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "adapter", "model", "plan.json", "preflight.json",
               "config.yaml", RUN_FILE, "tb")
# Keys that decide the shapes of what a checkpoint holds: a checkpoint whose run differs in one of them cannot load.
SHAPE_KEYS = ("model", "method", "lora", "freeze_trainable", "drop_modules", "freeze_modules")
# Keys of the schedule's length: a longer schedule of the same job continues from its last checkpoint; the trained
# result of the steps done so far is the same, the rest of the schedule now reaches further.
LENGTH_KEYS = ("epochs", "max_steps")
# The pipeline schedules a recorded config.yaml may name (resolve/pipeline.py).
SCHEDULES = ("1f1b", *LOOPED)


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digests(paths: str | list[str] | None) -> list[str] | None:
    if paths is None:
        return None
    return [file_digest(p) for p in ([paths] if isinstance(paths, str) else paths)]


def fingerprint(cfg: Config, global_batch_examples: int) -> dict[str, Any]:
    """What determines the trained weights, independent of the strategy and the number of ranks: the model, the
    data (by content), what trains, and the schedule (the global batch, not how it is split over ranks)."""
    lora = cfg.lora
    return {
        "model": cfg.model, "data": _digests(cfg.data), "eval_data": _digests(cfg.eval_data),
        "eval_split": cfg.eval_split, "method": cfg.method,
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": lora.targets}
        if methods.get(cfg.method).adapters else None,
        "freeze_trainable": cfg.freeze_trainable, "drop_modules": cfg.drop_modules,
        "freeze_modules": cfg.freeze_modules, "max_seq_len": cfg.max_seq_len, "packing": cfg.packing,
        "global_batch_examples": global_batch_examples, "lr": cfg.lr, "warmup_ratio": cfg.warmup_ratio,
        "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm, "epochs": cfg.epochs,
        "max_steps": cfg.max_steps, "seed": cfg.seed,
        # Only when set: the fingerprints of runs from before the key stay what they were.
        **({"data_columns": cfg.data_columns} if cfg.data_columns else {}),
    }


def differences(old: dict[str, Any], new: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """`key: old -> new` for every key (of `keys`, default all) whose value changed."""
    names = keys or tuple(dict.fromkeys([*old, *new]))
    return [f"{k}: {_short(old.get(k))} -> {_short(new.get(k))}" for k in names if old.get(k) != new.get(k)]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def recorded_pipeline(cfg: Config) -> tuple[Config, str | None]:
    """`pipeline_parallel: auto` on a run that resumes: the stages (and schedule) its run directory's config.yaml
    recorded, with a line saying so. A run started before auto could turn a pipeline on, or resolved otherwise,
    would else be resolved anew, and a pipeline changes the global batch, which the resume refuses (`claim`).
    `cfg` as it is where nothing is to resume (no run.json, `resume: never`) or the key is set."""
    run_dir = Path(cfg.output_dir)
    if cfg.pipeline_parallel != "auto" or cfg.resume == "never" or read_run_file(run_dir) is None:
        return cfg, None
    try:  # the file shardfit wrote: read as data only
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return cfg, None
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


T = TypeVar("T")


def resumed_job(cfg: Config, resolve: Callable[[Config], tuple[Resolved, T]]) -> tuple[Resolved, T]:
    """The job `cfg` runs, with what else `resolve` gives (its plan), as `resolve` resolves it anew, unless the
    run it resumes would then be refused: auto's choice for the same config changes as its rules do (one
    process's model_parallel may give way to rows split over every GPU), and another strategy, split or pipeline
    changes the data-parallel ranks and so the global batch, which the resume refuses (`claim`). Only where the
    job resolved anew changes run.json's global batch and the recorded job (`recorded_job`) keeps it is the
    recorded one run, its reasons first in `why` (the launcher's log, summary.json, `check`). Where the recorded
    job cannot run here (other GPUs, --nproc) or keeps no more than the new one, the new one runs, and `claim`
    says what differs."""
    kept, lines = recorded_job(cfg)
    if not lines:
        return resolve(cfg)
    run = read_run_file(Path(cfg.output_dir)) or {}
    target = (run.get("fingerprint") or {}).get("global_batch_examples") if isinstance(run, dict) else None
    fresh: tuple[Resolved, T] | DoesNotFitError | UserError
    try:
        fresh = resolve(cfg)
    except (DoesNotFitError, UserError) as e:  # the recorded job may still fit and keep the run
        fresh = e
    if isinstance(fresh, tuple) and (not isinstance(target, int) or global_batch(cfg, fresh[0]) == target):
        return fresh
    try:
        recorded: tuple[Resolved, T] | None = resolve(kept)
    except (DoesNotFitError, UserError):
        recorded = None
    if recorded is None or global_batch(kept, recorded[0]) != target:
        if not isinstance(fresh, tuple):
            raise fresh
        return fresh
    job = recorded[0]
    anew = (f"{fresh[0].strategy}, sequence_parallel {fresh[0].sequence_parallel}, pipeline_parallel "
            f"{fresh[0].pipeline_parallel}, a global batch of {global_batch(cfg, fresh[0])} examples"
            if isinstance(fresh, tuple) else str(fresh).split("\n")[0])
    why = (f"resumed as recorded: the run in {cfg.output_dir} trains a global batch of {target} examples "
           f"(run.json), which the recorded job keeps; resolved anew: {anew}")
    return dataclasses.replace(job, why=(*lines, why, *job.why)), recorded[1]


def global_batch(cfg: Config, job: Resolved) -> int:
    """Examples per optimizer step: the global batch the run's fingerprint records (`fingerprint`)."""
    return cfg.micro_batch * cfg.grad_accum * job.dims.dp


def _read_record(path: Path, parse: Callable[[str], Any]) -> Any:
    """A file shardfit wrote into the run directory, read as data only; None where it is missing or unreadable."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None


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


def read_run_file(run_dir: Path) -> dict[str, Any] | None:
    """The run.json shardfit wrote in `run_dir`, or None where there is none or it is not what shardfit writes (a
    JSON object whose fingerprint is an object): an edited or truncated file is no record to resume from."""
    try:
        run = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(run, dict) or not isinstance(run.get("fingerprint", {}), dict):
        return None
    return run


def decide_on_rank0(env: DistEnv, decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0 and give every rank its result; a UserError it raises is raised on every rank."""
    outcome: list[Any] = [None]
    if env.is_main:
        try:
            outcome[0] = ("ok", decide())
        except UserError as e:
            outcome[0] = ("error", str(e))
    if env.distributed:
        dist.broadcast_object_list(outcome)
    kind, value = outcome[0]
    if kind == "error":
        raise UserError(value)
    return value


def check_writable(run_dir: Path) -> None:
    """output_dir must be a directory this process can create and write."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output_dir {run_dir} is a file; give a directory (it is created when missing).")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output_dir {run_dir} is not writable ({e.strerror}); choose a directory you can write, "
                        "e.g. --set output_dir=runs/mine.") from None


class RunLock:
    """`.shardfit.lock` in the run directory, held by rank 0 for the whole run: a second training into the same
    directory is refused. A lock left by a killed run on this host (its pid is gone) is taken over."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        warning = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._alive(owner):
                    raise UserError(f"output_dir {self.path.parent} is in use by another training (pid "
                                    f"{owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}). "
                                    "Wait for it to finish, or use another output_dir. If no such process runs, "
                                    f"delete {self.path}.") from None
                warning = f"took over the lock of a run that is gone ({owner or 'unreadable lock'})"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return warning
        raise UserError(f"could not take the lock {self.path}; delete it if no training uses {self.path.parent}.")

    def _owner(self) -> dict[str, Any] | None:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    @staticmethod
    def _alive(owner: dict[str, Any]) -> bool:
        if owner.get("host") != socket.gethostname():
            return True  # another host's process cannot be checked from here: assume it runs
        try:
            os.kill(int(owner.get("pid", -1)), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, OverflowError, TypeError):  # TypeError: an edited lock's null pid
            return True
        return True

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _total_steps(fp: dict[str, Any], steps_per_epoch: int | None) -> int | None:
    """The optimizer steps a fingerprint's schedule runs: max_steps, else epochs over the steps of an epoch."""
    if fp.get("max_steps"):
        return int(fp["max_steps"])
    return int(fp["epochs"]) * steps_per_epoch if steps_per_epoch and fp.get("epochs") else None


def longer_schedule(run_dir: Path, previous: dict[str, Any], new: dict[str, Any]) -> str | None:
    """When `new` is the run in `run_dir` with only a longer schedule (max_steps or epochs raised), the words the
    start line says about it; else None. The run's length comes from run.json (written once its data was read),
    else from summary.json, else from max_steps alone."""
    old = previous.get("fingerprint") or {}
    changed = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    if not changed or any(k not in LENGTH_KEYS for k in changed):
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    per_epoch = previous.get("steps_per_epoch") or summary.get("steps_per_epoch")
    before = previous.get("steps") or summary.get("steps") or _total_steps(old, per_epoch)
    after = _total_steps(new, per_epoch)
    if before is None or after is None or after < before:
        return None
    what = "; ".join(differences(old, new, LENGTH_KEYS))
    if after == before:
        return f"the same {after} steps, written another way ({what})"
    return (f"a longer schedule of the same run ({what}): it continues from its last checkpoint to step {after} "
            f"(was {before}), the learning-rate schedule now ending there")


def claim(run_dir: Path, cfg: Config, new: dict[str, Any]) -> str | None:
    """Decide what this run does with `run_dir` (rank 0): start fresh, resume (the checkpoints are this run's, or
    this run's with a longer schedule), or refuse. `resume: never` clears the previous run's outputs first.
    Writes run.json; returns the words for a longer schedule (longer_schedule), else None."""
    previous = read_run_file(run_dir)
    has_outputs = (run_dir / "checkpoints").is_dir() or (run_dir / "summary.json").exists()
    longer = None
    if cfg.resume == "never":
        for name in RUN_OUTPUTS:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    elif cfg.resume == "auto":
        if previous is None and has_outputs and (run_dir / RUN_FILE).exists():
            raise UserError(f"{run_dir / RUN_FILE} is not the run record shardfit writes (truncated or edited: not a "
                            "JSON object with a fingerprint object), so nothing says which run its checkpoints belong "
                            "to. Restore it, use a new output_dir, or --set resume=never to start over there.")
        if previous is None and has_outputs:
            raise UserError(f"output_dir {run_dir} holds another run's outputs without a run.json (an older shardfit "
                            "or another tool). Use a new output_dir, or --set resume=never to start over there.")
        if previous is not None and previous.get("fingerprint") != new:
            longer = longer_schedule(run_dir, previous, new)
            if longer is None:
                diff = "; ".join(differences(previous.get("fingerprint") or {}, new))
                raise UserError(f"output_dir {run_dir} holds a different run ({diff}). Its checkpoints are not "
                                f"this config's: {_same_batch(previous.get('fingerprint') or {}, new, cfg)}use a "
                                "new output_dir, or --set resume=never to start over there.")
    else:
        if previous is not None and previous.get("fingerprint") != new:
            longer = longer_schedule(run_dir, previous, new)
            if longer is None:
                diff = "; ".join(differences(previous.get("fingerprint") or {}, new))
                raise UserError(f"output_dir {run_dir} holds a different run ({diff}); resuming into it would mix "
                                "the two. Use a new output_dir for the resumed run.")
        checkpoint = Path(cfg.resume)
        source = read_run_file(checkpoint.parent.parent)
        if source is not None:
            diff = differences(source.get("fingerprint") or {}, new, SHAPE_KEYS)
            if diff:
                raise UserError(f"'resume': {checkpoint} was written by a run with other shapes ({'; '.join(diff)}); "
                                "its weights cannot load into this config.")
    (run_dir / RUN_FILE).write_text(json.dumps({"fingerprint": new}, indent=2))
    return longer


def _same_batch(old: dict[str, Any], new: dict[str, Any], cfg: Config) -> str:
    """Where only the global batch differs (other GPUs, processes or split: other data-parallel ranks), the
    grad_accum that trains the recorded one on these ranks, when there is one; else nothing."""
    was, now = old.get("global_batch_examples"), new.get("global_batch_examples")
    if differences(old, new) != differences(old, new, ("global_batch_examples",)) \
            or not isinstance(was, int) or not isinstance(now, int) or now % (cfg.micro_batch * cfg.grad_accum):
        return ""
    per_accum = cfg.micro_batch * now // (cfg.micro_batch * cfg.grad_accum)  # micro_batch x data-parallel ranks
    if was % per_accum or was < per_accum:
        return ""
    return f"to resume it on these ranks, --set grad_accum={was // per_accum} (the run's {was} examples a step); "


def record_length(run_dir: Path, steps: int, steps_per_epoch: int) -> None:
    """Add the run's length to run.json once its data is read, so a later, longer schedule of it can be told
    from a different run (longer_schedule)."""
    run = read_run_file(run_dir) or {}
    run.update(steps=steps, steps_per_epoch=steps_per_epoch)
    (run_dir / RUN_FILE).write_text(json.dumps(run, indent=2))
