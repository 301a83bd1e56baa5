"""The bubble the plan states (plan/pipeline.py `bubble`) against the one torch's own schedules give: their per-rank
action lists (parallel/schedule_order.py), replayed with unit-cost forward, input- and weight-gradient passes."""

from __future__ import annotations

import pytest

from shardfit.parallel.schedule_order import Op, bubble, rank_orders
from shardfit.plan.pipeline import bubble as planned_bubble

CASES = [(kind, stages, m, per_rank) for stages in (2, 4) for m in (stages, 2 * stages, 4 * stages)
         for kind, per_rank in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zero_bubble", 3))]


@pytest.mark.parametrize(("kind", "stages", "m", "per_rank"), CASES)
def test_plan_bubble_is_torch_schedules(kind: str, stages: int, m: int, per_rank: int) -> None:
    orders = rank_orders(kind, stages, m, per_rank)
    # Every rank runs each of its stages' passes of every micro-batch exactly once.
    passes = "FIW" if kind == "zero_bubble" else "FB"
    for r, ops in enumerate(orders):
        mine = {s for s in range(stages * per_rank) if s % stages == r}
        assert sorted((o.kind, o.stage, o.micro) for o in ops) == sorted(
            (k, s, i) for k in passes for s in mine for i in range(m))
    assert bubble(orders) == pytest.approx(planned_bubble(stages, m, per_rank, kind == "zero_bubble"), abs=1e-12)


def test_zero_bubble_is_smaller_than_interleaved() -> None:
    """Splitting the backward fills all but one forward per hop: 2 stages x 2 per rank over 4 micro-batches idle
    1/25 of the step under zero bubble, 1/9 under interleaved 1F1B."""
    assert bubble(rank_orders("zero_bubble", 2, 4, 2)) == pytest.approx(1 / 25)
    assert bubble(rank_orders("interleaved_1f1b", 2, 4, 2)) == pytest.approx(1 / 9)


def test_replay_refuses_orders_that_wait_on_each_other() -> None:
    """Rank 0 waits for stage 1's gradient of a micro-batch stage 1 has not yet received: no schedule."""
    with pytest.raises(RuntimeError, match="wait on each other"):
        bubble([[Op("B", 0, 0), Op("F", 0, 0)], [Op("F", 1, 0), Op("B", 1, 0)]])
