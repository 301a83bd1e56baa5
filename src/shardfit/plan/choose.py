"""A running job's plan: the strategy `auto` picks (the refusal to start what is predicted not to fit is
resolve/fits.py `refuse_if_oom`)."""

from __future__ import annotations

import dataclasses

from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.hardware import Hardware
from shardfit.plan.plan import Plan, make_plan, recommend
from shardfit.plan.render import format_table
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import workload_of
from shardfit.strategy import MULTI_RANK


def plan_for_config(cfg: Config, hw: Hardware) -> Plan | None:
    """The plan of a config's job on `hw`, or None when the model's shape cannot be read (e.g. a hub id that is
    neither cached nor in the catalog)."""
    try:
        shape = resolve_shape(cfg.model)
    except UserError:
        return None
    return make_plan(shape, workload_of(cfg), hw)


def tokens_per_s_at(plan: Plan, model: str, strategy: str, tokens_per_micro_batch: float) -> float | None:
    """The plan's tokens/s for `strategy` with micro-batches of `tokens_per_micro_batch` tokens each (a run's own:
    rows of its mean width) instead of rows full to max_seq_len. A host-bound step is no shorter for short rows,
    so the full-row figure would flatter a run of short ones. None when the model's shape cannot be read."""
    try:
        shape = resolve_shape(model)
    except UserError:
        return None
    w = plan.workload
    width = max(1, round(tokens_per_micro_batch / w.rows))
    return step_time(shape, dataclasses.replace(w, seq_len=width), plan.hardware, strategy).tokens_per_s


def auto_strategy(plan: Plan | None, world: int) -> str:
    """One process: `single`. Several ranks: the plan's recommendation when it runs on several ranks, else the
    multi-rank strategy that fits with the most predicted tokens/s (ties, and untimed plans, by SPEED_ORDER)."""
    if world == 1:
        return "single"
    if plan is None:
        return "zero3"  # shape unknown: sharding is the choice that fits most
    if plan.recommended in MULTI_RANK:
        return plan.recommended
    fitting = [c for c in plan.candidates if c.strategy in MULTI_RANK and c.fits and c.applies]
    if fitting:
        best, _ = recommend(fitting, plan.hardware)
        if best is not None:
            return best
    raise DoesNotFitError("no strategy fits this hardware.\n" + format_table(plan, style="config"))
