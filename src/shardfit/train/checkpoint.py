"""Resumable, atomic, sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of `checkpoints/step-N/`: DCP shards of the trainable weights and optimizer state (every rank writes its
own), `trainer.pt` (step, tokens, scheduler) and `rng-<rank>.pt`. Everything is written under `.tmp-step-N` and
renamed by rank 0 after a barrier, so a run killed mid-save still has its previous checkpoint intact. The data
position is the step itself (see data/loader.py), so nothing else is needed to continue exactly.
"""

from __future__ import annotations

import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from shardfit.errors import UserError
from shardfit.parallel.env import DistEnv, barrier
from shardfit.parallel.shared_dir import ranks_seeing

_STEP_DIR = re.compile(r"^step-(\d+)$")
_OPTS = StateDictOptions(ignore_frozen_params=True)


class TrainState(Stateful):
    """Model (trainable parameters only: frozen ones come back from the base weights) and optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=StateDictOptions(ignore_frozen_params=True,
                                                                                      strict=False))


@dataclass
class Resumed:
    step: int
    tokens: int
    path: Path


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def require_shared_dir(run_dir: Path, env: DistEnv) -> None:
    """Every rank must see the same run directory: DCP writes one shard per rank and rank 0 renames the step
    directory, so on node-local disks a multi-node checkpoint would be silently incomplete. Checked once at start."""
    missing = ranks_seeing(run_dir, env).count(False)
    if missing:
        raise UserError(f"output_dir {run_dir} is not shared: {missing} of {env.world} ranks cannot see what "
                        "rank 0 wrote there. Checkpoints are sharded across ranks, so on several nodes output_dir "
                        "must be on a filesystem every node mounts (NFS, Lustre, a shared volume).")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "trainer.pt").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(run_dir: Path, step: int, tokens: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, env: DistEnv, keep: int) -> Path:
    """Write `checkpoints/step-<step>` atomically on every rank; keep the newest `keep` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    with warnings.catch_warnings():
        # One process saves on purpose; DCP's notice about it would print at every checkpoint.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"train": TrainState(model, optimizer)}, checkpoint_id=str(tmp), no_dist=not env.distributed)
    torch.save(_rng_state(), tmp / f"rng-{env.rank}.pt")
    if env.is_main:
        torch.save({"step": step, "tokens": tokens, "scheduler": scheduler.state_dict(), "world": env.world},
                   tmp / "trainer.pt")
    barrier(env)
    if env.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: newest for `auto`, none for `never`, else the given path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1][1] if found else None
    p = Path(resume)
    if not (p / "trainer.pt").is_file():
        raise UserError(f"'resume': {resume} is not a shardfit checkpoint (no trainer.pt). Use auto, never, "
                        f"or a path like runs/demo/checkpoints/step-200.")
    return p


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    env: DistEnv) -> Resumed:
    """Restore weights, optimizer, scheduler and RNG; DCP reshards when the world size changed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"train": TrainState(model, optimizer)}, checkpoint_id=str(path), no_dist=not env.distributed)
    meta = torch.load(path / "trainer.pt", weights_only=True)
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng-{env.rank}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seeded RNG
        _set_rng_state(torch.load(rng, weights_only=True))
    if env.distributed:
        dist.barrier()
    return Resumed(int(meta["step"]), int(meta["tokens"]), path)


class Checkpointer:
    """The run's checkpoints: where training resumes from, and a save every `every` steps before the last (the
    last step is saved by `save`), keeping the newest `keep`."""

    def __init__(self, run_dir: Path, env: DistEnv, *, every: int, keep: int, total_steps: int):
        self.run_dir, self.env, self.every, self.keep, self.total = Path(run_dir), env, every, keep, total_steps

    def resume(self, resume: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               lr_schedule: Any) -> Resumed | None:
        """Check that every rank sees the run directory, then restore the checkpoint `resume` names, if any."""
        require_shared_dir(self.run_dir, self.env)
        path = find_resume(self.run_dir, resume)
        return None if path is None else load_checkpoint(path, module, optimizer, lr_schedule, self.env)

    def maybe_save(self, step: int, tokens: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   lr_schedule: Any) -> None:
        if step % self.every == 0 and step != self.total:
            self.save(step, tokens, module, optimizer, lr_schedule)

    def save(self, step: int, tokens: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             lr_schedule: Any) -> Path:
        return save_checkpoint(self.run_dir, step, tokens, module, optimizer, lr_schedule, self.env, self.keep)
