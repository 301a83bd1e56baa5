"""The bubble of the pipeline schedules torch builds, against the plan's formula (plan/pipeline.py `bubble`).

    python bench/pipeline_bubble.py                 # 2 stages, 2 per rank, 2/4/8 micro-batches
    python bench/pipeline_bubble.py --stages 4 --per-rank 3 --micro 4 8 16

No training: each schedule's per-rank compute order is read from torch's own builders (the action lists
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble compute in their constructors, 1F1B's runtime order;
parallel/schedule_order.py) and replayed with a forward, an input-gradient and a weight-gradient pass of one unit
each (a full backward two) under the pipeline's dependencies. The bubble is the idle share of the ranks' time in
that replay, exact for those costs. Writes bench/results/pipeline_bubble.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.parallel.schedule_order import COST, SCHEDULES, bubble, rank_orders  # noqa: E402
from shardfit.plan.pipeline import bubble as planned_bubble  # noqa: E402


def measure(stages: int, per_rank: int, micro: list[int]) -> list[dict[str, object]]:
    """One row per schedule and micro-batch count: the replayed bubble, the plan's, and the step's span in units."""
    rows: list[dict[str, object]] = []
    for kind in SCHEDULES:
        v = 1 if kind == "1f1b" else per_rank
        for m in micro:
            orders = rank_orders(kind, stages, m, v)
            got = bubble(orders)
            busy = sum(COST[op.kind] for op in orders[0])
            rows.append({"schedule": kind, "stages": stages, "per_rank": v, "micro_batches": m,
                         "busy_units_per_rank": busy, "span_units": round(busy / (1 - got), 6),
                         "bubble_torch": round(got, 6),
                         "bubble_plan": round(planned_bubble(stages, m, v, kind == "zero_bubble"), 6)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--per-rank", type=int, default=2, help="looped stages per rank (interleaved, zero bubble)")
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pipeline_bubble.json")
    args = ap.parse_args()
    rows = measure(args.stages, args.per_rank, args.micro)
    print(f"{'schedule':<18} {'V':>2} {'micro':>5} {'span':>6} {'torch':>8} {'plan':>8}")
    for r in rows:
        print(f"{r['schedule']:<18} {r['per_rank']:>2} {r['micro_batches']:>5} {r['span_units']:>6g} "
              f"{100 * r['bubble_torch']:>7.2f}% {100 * r['bubble_plan']:>7.2f}%")
    worst = max(abs(r["bubble_torch"] - r["bubble_plan"]) for r in rows)
    out = {"what": "idle share of the step in torch's schedules (unit-cost replay) vs the plan's formula",
           "costs": COST, "max_abs_difference": worst, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"largest difference {worst:.2e}; wrote {args.out}")


if __name__ == "__main__":
    main()
