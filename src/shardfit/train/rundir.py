"""Who owns a run directory: one training at a time (a lock file), and only the run that wrote the checkpoints
resumes from them (a fingerprint of what determines the weights, in run.json).

Rank 0 makes every decision about the directory; the verdict is broadcast, so all ranks stop together with the
same message instead of some waiting forever in a collective.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardfit.config import Config
from shardfit.config.paths import unreadable
from shardfit.errors import UserError
from shardfit.parallel.env import DistEnv
from shardfit.resolve.checkpoint_files import file_digest
from shardfit.resolve.resume import LENGTH_KEYS, RUN_FILE, keeping_grad_accum, read_run_file, run_settings

LOCK = ".shardfit.lock"
# What a run writes; `resume: never` removes these before it starts over.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "adapter", "model", "plan.json", "preflight.json",
               "config.yaml", RUN_FILE, "tb")
# Keys that decide the shapes of what a checkpoint holds: a checkpoint whose run differs in one of them cannot load.
SHAPE_KEYS = ("model", "method", "lora", "freeze_trainable", "drop_modules", "freeze_modules")


def _digests(key: str, paths: str | list[str] | None) -> list[str] | None:
    """The sha256 of each file a data key names; one that cannot be read (its mode changed since the config was
    loaded) is a UserError naming the key, as the config's loading refuses it."""
    if paths is None:
        return None
    out = []
    for p in [paths] if isinstance(paths, str) else paths:
        try:
            out.append(file_digest(p))
        except OSError as e:
            raise unreadable(f"'{key}' {p}", e) from None
    return out


def fingerprint(cfg: Config, global_batch_examples: int) -> dict[str, Any]:
    """What determines the trained weights, independent of the strategy and the number of ranks: the model, the
    data (by content), what trains, and the schedule (the global batch, not how it is split over ranks)."""
    return {**run_settings(cfg), "data": _digests("data", cfg.data),
            "eval_data": _digests("eval_data", cfg.eval_data),
            "global_batch_examples": global_batch_examples}


def differences(old: dict[str, Any], new: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """`key: old -> new` for every key (of `keys`, default all) whose value changed."""
    names = keys or tuple(dict.fromkeys([*old, *new]))
    return [f"{k}: {_short(old.get(k))} -> {_short(new.get(k))}" for k in names if old.get(k) != new.get(k)]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    except (OSError, ValueError, RecursionError):
        summary = {}
    if not isinstance(summary, dict):
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
    previous = read_run_file(run_dir) if cfg.resume != "never" else None  # never: whatever it holds goes
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
            or not isinstance(now, int) or now % (cfg.micro_batch * cfg.grad_accum):
        return ""
    accum = keeping_grad_accum(was, cfg.micro_batch, now // (cfg.micro_batch * cfg.grad_accum))
    return "" if accum is None else f"to resume it on these ranks, --set grad_accum={accum} (the run's {was} " \
        "examples a step); "


def record_length(run_dir: Path, steps: int, steps_per_epoch: int) -> None:
    """Add the run's length to run.json once its data is read, so a later, longer schedule of it can be told
    from a different run (longer_schedule)."""
    run = read_run_file(run_dir) or {}
    run.update(steps=steps, steps_per_epoch=steps_per_epoch)
    (run_dir / RUN_FILE).write_text(json.dumps(run, indent=2))
