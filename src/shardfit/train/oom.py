"""An out-of-memory during a run, said as the expected failure it is (exit 1): what ran out and where, the plan's
figure for this job, what the plan already knows to fit instead, and which checkpoint survives."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from shardfit.config import Config
from shardfit.errors import JobFailed, UserError
from shardfit.errors import ran_out as kind_of_oom
from shardfit.plan.estimate import largest_part
from shardfit.plan.plan import Alternative, Plan, alternatives
from shardfit.plan.shapes import resolve_shape
from shardfit.train.checkpoint import list_checkpoints

_TRIED = (re.compile(r"tried to allocate (\d+) bytes", re.I), re.compile(r"Tried to allocate ([\d.]+ [KMGT]iB)"))


def ran_out(e: BaseException, device: torch.device) -> str | None:
    """What ran out when `e` is an out-of-memory error on `device`, in words ("host RAM", "GPU memory (cuda:0)");
    None for any other error."""
    what = kind_of_oom(e, device.type)
    return f"{what} ({device})" if what == "GPU memory" else what


def _tried(text: str) -> str:
    """The size of the allocation that failed, as the allocator reported it ("" when it did not)."""
    m = _TRIED[0].search(text)
    if m:
        return f"a {int(m.group(1)) / 2**30:.2f} GiB allocation failed"
    m = _TRIED[1].search(text)
    return f"a {m.group(1)} allocation failed" if m else ""


@dataclass(frozen=True)
class Where:
    """The run as far as the failure concerns it."""

    cfg: Config
    strategy: str
    world: int
    device: torch.device
    run_dir: Path
    place: str | None  # the watchdog's last phase and place ("step 3 (backward)"), None before the first step


def out_of_memory(e: BaseException, what: str, plan: Plan | None, at: Where) -> JobFailed:
    """The JobFailed that replaces the out-of-memory `e`: one message a user can act on."""
    tried = _tried(str(e))
    where = f"in {at.place}" if at.place else "before the first step (loading or preparing the model)"
    lines = [f"out of memory: {what} ran out {where}" + (f"; {tried}" if tried else "")
             + f" (strategy {at.strategy} on {at.world} x {at.device.type}, {at.cfg.precision}, micro_batch "
               f"{at.cfg.micro_batch}, max_seq_len {at.cfg.max_seq_len}, grad_ckpt {at.cfg.grad_ckpt})."]
    lines += _plan_lines(plan, at, what)
    lines.append(_checkpoint_line(at.run_dir))
    return JobFailed("\n".join(lines))


def _plan_lines(plan: Plan | None, at: Where, what: str) -> list[str]:
    """The plan's figure for the strategy that ran, and what it knows to fit instead."""
    c = plan.candidate(at.strategy) if plan is not None else None
    if plan is None or c is None:
        return ["shardfit had no plan for this model (its shape could not be read); lower micro_batch, turn on "
                "grad_ckpt: full or shorten max_seq_len."]
    hw = plan.hardware
    part, gib = largest_part(c.per_gpu_gib)
    figure = (f"the plan predicted {c.per_gpu_gib.total:.1f} GiB per {hw.unit} of {hw.gpu_mem_gib:.1f} for "
              f"{at.strategy} (largest part: {part} {gib:.1f} GiB)")
    if not c.fits:
        out = [f"{figure[0].upper()}{figure[1:]}: it predicted this and would have refused to start; force: true "
               "started it anyway."]
    else:
        shared = " Other processes on this machine use the same RAM." if what == "host RAM" else ""
        out = [f"{figure[0].upper()}{figure[1:]}, which fits: the run needed more than the plan accounts for (long "
               f"rows, other programs); please report it with {at.run_dir / 'plan.json'}.{shared}"]
    instead = _instead(plan, at)
    out.append("What fits instead, by the plan: " + "; or ".join(instead) + "." if instead else
               "The plan knows of nothing that fits on this hardware: fewer/shorter rows or more memory.")
    return out


def _instead(plan: Plan, at: Where) -> list[str]:
    """The plan's other strategies that fit (fastest first), then its nearest changes, as config overrides."""
    unit = plan.hardware.unit
    fitting = sorted((c for c in plan.candidates if c.fits and c.applies and c.strategy != at.strategy),
                     key=lambda c: -(c.tokens_per_s or 0.0))
    out = [f"--set strategy={c.strategy} ({c.per_gpu_gib.total:.1f} GiB per {unit})" for c in fitting[:2]]
    for a in _changes(plan, at.cfg.model)[:3]:
        phrase = a.phrase("config")
        if phrase:
            out.append(phrase)
    return out


def _changes(plan: Plan, model: str) -> list[Alternative]:
    """The plan's nearest changes: those it listed when nothing fit, else computed now with the same estimator."""
    if plan.alternatives is not None:
        return plan.alternatives
    try:
        shape = resolve_shape(model)
    except UserError:
        return []
    return alternatives(shape, plan.workload, plan.hardware)


def _checkpoint_line(run_dir: Path) -> str:
    saved = list_checkpoints(run_dir)
    if not saved:
        return "No checkpoint was written; the run starts over when started again."
    step, path = saved[-1]
    return f"The checkpoint of step {step} survives ({path}); resume: auto continues from it."
