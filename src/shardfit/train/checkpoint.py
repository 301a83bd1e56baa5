"""Resumable, atomic, sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of `checkpoints/step-N/`: DCP shards of the trainable weights and optimizer state (every rank writes its
own, under the whole model's names whatever the layout, so a checkpoint resumes on any other) with DCP's
`.metadata`, `trainer.pt` (step, tokens, scheduler) and `rng-<rank>.pt`. Loading unpickles no more than tensors,
plain values and DCP metadata (`weights_only=True`, trusted_dcp.py): a checkpoint from elsewhere cannot run code.
Everything is written under `.tmp-step-N` and renamed by rank 0 after a barrier, so a run killed mid-save still
has its previous checkpoint intact. The data position is the step itself (see data/loader.py), so nothing else is
needed to continue exactly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from shardfit.errors import JobFailed, UserError
from shardfit.parallel.env import DistEnv, barrier
from shardfit.parallel.pipeline import DecoderStage
from shardfit.parallel.shared_dir import ranks_seeing
from shardfit.resolve.checkpoint_files import MANIFEST, file_digest, intact, list_checkpoints, named_checkpoint
from shardfit.train.expert_lora_layout import expert_lora_b, state_dict_name, to_model, to_saved
from shardfit.train.trusted_dcp import TrustedLoadPlanner, TrustedReader, not_trusted, read_metadata, refusal

log = logging.getLogger(__name__)

_OPTS = StateDictOptions(ignore_frozen_params=True)
# The optimizer state under each parameter's own name, param_groups too (`param_groups.<name>.lr`): how pipeline
# checkpoints were written before they took the whole model's layout; such a checkpoint still loads, on any layout.
_FLAT_OPTS = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)


def _is_stage(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "module", model), DecoderStage)  # DDP over a stage's data-parallel ranks


class TrainState(Stateful):
    """Model (trainable parameters only: frozen ones come back from the base weights) and optimizer, in one
    layout whatever the run's: the whole model's names, the optimizer's state by each parameter's name and its
    param_groups by index, as one process writes them. A pipeline stage or an FSDP2 shard is then a part of that
    state, and DCP's name-based load reshards a checkpoint onto any other layout (2 stages -> zero3 -> 1 process)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, experts: Any = None, *,
                 flat: bool = False, whole_groups: bool = False):
        # `experts`: expert parallelism's shares (parallel/experts.py `ExpertShard`): saved as shards of the whole.
        # `flat`: the state as a checkpoint in the older flattened layout holds it (`_FLAT_OPTS`), to load one.
        # `whole_groups`: a pipeline stage names every stage's parameters in its param_groups (a collective:
        # every rank saves), as one process does, so that a layout whose ranks hold other parameters finds its own.
        self.model, self.optimizer, self.experts = model, optimizer, experts
        self.flat, self.whole_groups = flat, whole_groups

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_FLAT_OPTS if self.flat else _OPTS)
        model_sd, optim_sd = to_saved(model_sd, optim_sd, expert_lora_b(self.model))
        if self.experts is not None:
            model_sd, optim_sd = self.experts.as_shards(model_sd, optim_sd)
        if self.whole_groups and _is_stage(self.model) and not self.flat:
            optim_sd = {**optim_sd, "param_groups": whole_param_groups(optim_sd["param_groups"])}
        frozen = frozen_names(self.model)
        return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.experts is not None:
            state_dict = self.experts.as_local(state_dict)
        model_sd, optim_sd = to_model(state_dict["model"], state_dict["optim"], expert_lora_b(self.model))
        state_dict = {**state_dict, "model": model_sd, "optim": optim_sd}
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=StateDictOptions(
                           ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=self.flat))


def whole_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stage's param_groups with each group's `params` (parameter names) the union over every rank's, in rank
    order: what one process's optimizer lists. Loading maps each parameter to its group by these names, so a
    stage's own list alone would leave the other stages' parameters without their group on another layout. A
    collective over the world; the groups' hyperparameters are the same on every stage (one schedule)."""
    mine = [list(g["params"]) for g in groups]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return groups
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = []
    for i, group in enumerate(groups):
        names = [name for lists in every for name in lists[i]]
        out.append({**group, "params": list(dict.fromkeys(names))})
    return out


def frozen_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of every frozen parameter, each alias of a shared one included. ignore_frozen_params drops a
    frozen parameter under the first name only, so a tied head (lm_head = embed_tokens) was saved in every LoRA
    checkpoint (57 MB of SmolLM2's 86 MB)."""
    return {state_dict_name(name) for name, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path) -> None:
    """Size and sha256 of every file of a checkpoint, then everything fsynced (files, then the directory), so a
    checkpoint that is renamed into place is whole on disk and can be verified later."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps(entries, indent=1))
    for p in [*files, ckpt / MANIFEST]:
        _fsync(p)
    _fsync(ckpt)


def save_checkpoint(run_dir: Path, step: int, tokens: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, env: DistEnv, keep: int,
                    experts: Any = None) -> Path:
    """Write `checkpoints/step-<step>` atomically on every rank; keep the newest `keep` checkpoints. A write that
    fails (a full disk, permissions) is a JobFailed saying so; the partial save is removed, the previous
    checkpoint stays as it was."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    try:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(env)
        with warnings.catch_warnings():
            # One process saves on purpose; DCP's notice about it would print at every checkpoint.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"train": TrainState(model, optimizer, experts, whole_groups=True)}, checkpoint_id=str(tmp),
                     no_dist=not env.distributed)
        torch.save(_rng_state(), tmp / f"rng-{env.rank}.pt")
        if env.is_main:
            torch.save({"step": step, "tokens": tokens, "scheduler": scheduler.state_dict(), "world": env.world},
                       tmp / "trainer.pt")
        barrier(env)
        if env.is_main:
            write_manifest(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync(root)
            for _, old in list_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError, CheckpointException) as e:
        # DCP wraps a rank's failure in CheckpointException (a BaseException); torch.save into a full disk raises
        # RuntimeError ("unexpected pos"), not OSError. Either is a write failure only when it says so.
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save would keep the disk full
        failure = _write_failure(e, root, lambda: checkpoint_bytes(model, optimizer))
        if failure is None:
            raise
        saved = [p for _, p in list_checkpoints(run_dir) if p != final]
        kept = (f"The previous checkpoint ({saved[-1]}) is intact" if saved else "There is no earlier checkpoint")
        fix = ("free disk space (or lower save_limit, or move output_dir)" if failure.startswith("disk full")
               else f"fix what stops writing under {root}")
        then = "; then run again (resume: auto continues from it)." if saved else "; then run again."
        raise JobFailed(f"{failure}. {kept}; {fix}{then}") from None
    barrier(env)
    return final


def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors one rank's checkpoint holds (its shards of the trainable weights and optimizer
    state): about what a save writes."""
    total = 0
    pending: list[Any] = [TrainState(model, optimizer).state_dict()]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, (list, tuple)):
            pending += value
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
            total += local.numel() * local.element_size()
    return total


def _write_failure(e: BaseException, root: Path, needed: Any) -> str | None:
    """What stopped a checkpoint write, in words, or None when `e` is not a write failure: a full disk (by its
    errno, or, for an error that carries none, by the free space being less than the checkpoint needs), or
    another OSError. `needed()`: the checkpoint's size."""
    errors = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    oserrors = [x for x in errors if isinstance(x, OSError)]
    try:
        free: int | None = shutil.disk_usage(root).free
    except OSError:
        free = None
    try:
        size = int(needed())
    except Exception:  # noqa: BLE001 - the estimate only words the message; the failure is known already
        size = 0
    full = [x for x in oserrors if x.errno in (errno.ENOSPC, errno.EDQUOT)]
    if full or (not oserrors and free is not None and 0 < size and free < size):
        have = f", {free:,} free" if free is not None else ""
        said = f" ({full[0].strerror})" if full and full[0].strerror else ""
        return f"disk full at {root}{said}: " + (f"about {size:,} bytes needed for the checkpoint{have}" if size
                                                 else "no space left for the checkpoint")
    if oserrors:
        x = oserrors[0]
        return f"could not write a checkpoint under {root}: {x.strerror or x}"
    return None


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: the newest intact one for `auto` (a damaged newer one is skipped with a
    warning), none for `never`, else the given path (which must be intact)."""
    if resume == "never":
        return None
    if resume == "auto":
        for _, path in reversed(list_checkpoints(run_dir)):
            problem = intact(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is damaged (%s); falling back to the one before it", path, problem)
        return None
    return named_checkpoint(resume, str(run_dir))


def _load_plain(path: Path) -> Any:
    """A `torch.save`d file of tensors and plain values; one that needs more (code) is refused, not a traceback."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refusing, or a damaged file: either way it is not loaded
        raise not_trusted(path, refusal(e)) from None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    env: DistEnv, experts: Any = None) -> Resumed:
    """Restore weights, optimizer, scheduler and RNG; DCP reshards when the world size or the layout changed
    (pipeline stages, FSDP2 shards, one process: the names are the same). Nothing in the
    checkpoint is unpickled beyond plain values, tensors and DCP's metadata (see trusted_dcp.py)."""
    metadata = read_metadata(path / ".metadata")  # a crafted or foreign checkpoint stops here, before DCP starts
    flat = flat_optimizer(metadata.state_dict_metadata)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"train": TrainState(model, optimizer, experts, flat=flat)}, checkpoint_id=str(path),
                     storage_reader=TrustedReader(str(path)), planner=TrustedLoadPlanner(path),
                     no_dist=not env.distributed)
    except CheckpointException as e:
        # DCP wraps what a rank raised; a refused value is bad input, said as such (not a traceback of ranks)
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UserError)]
        if refused:
            raise refused[0] from None
        raise
    meta = _load_plain(path / "trainer.pt")
    scheduler.load_state_dict(meta["scheduler"])
    _lr_at_restored_step(optimizer, scheduler)
    rng = path / f"rng-{env.rank}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seeded RNG
        _set_rng_state(_load_plain(rng))
    if env.distributed:
        dist.barrier()
    return Resumed(int(meta["step"]), int(meta["tokens"]), path)


def flat_optimizer(keys: Any) -> bool:
    """Whether a checkpoint's optimizer state is in the older flattened layout, its param_groups by parameter name
    (`train.optim.param_groups.<name>.lr`, pipeline runs before the whole model's layout), not by index."""
    groups = [k.split(".")[3] for k in keys if k.startswith("train.optim.param_groups.")]
    return bool(groups) and not groups[0].isdigit()


def _lr_at_restored_step(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Each group's lr as this run's schedule has it at the restored step. The optimizer's state holds the lr of
    the schedule that saved it: for a longer schedule of the same run (max_steps raised) that was its last one,
    near 0, and the first continued step would not train."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class Checkpointer:
    """The run's checkpoints: where training resumes from, and a save every `every` steps before the last (the
    last step is saved by `save`), keeping the newest `keep`."""

    def __init__(self, run_dir: Path, env: DistEnv, *, every: int, keep: int, total_steps: int,
                 experts: Any = None):
        self.run_dir, self.env, self.every, self.keep, self.total = Path(run_dir), env, every, keep, total_steps
        self.experts = experts  # expert parallelism's shares, or None

    def resume(self, resume: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               lr_schedule: Any) -> Resumed | None:
        """Check that every rank sees the run directory, then restore the checkpoint `resume` names, if any."""
        require_shared_dir(self.run_dir, self.env)
        path = find_resume(self.run_dir, resume)
        return None if path is None else load_checkpoint(path, module, optimizer, lr_schedule, self.env,
                                                         self.experts)

    def maybe_save(self, step: int, tokens: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   lr_schedule: Any) -> None:
        if self.due(step):
            self.save(step, tokens, module, optimizer, lr_schedule)

    def due(self, step: int) -> bool:
        """Whether `maybe_save` saves after step `step` (the last step's checkpoint is `finish`'s)."""
        return step % self.every == 0 and step != self.total

    def save(self, step: int, tokens: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             lr_schedule: Any) -> Path:
        return save_checkpoint(self.run_dir, step, tokens, module, optimizer, lr_schedule, self.env, self.keep,
                               self.experts)
