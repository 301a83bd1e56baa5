"""Where the blind sets' memory error lies: in the planner's model of the tensors, or outside the tensors.

    python bench/blind_vs_simulate.py              # writes bench/results/blind_vs_simulate.json, prints the table
    python bench/blind_vs_simulate.py --limit 3    # the first three rows only (a quick check)

For every pooled blind row with a published peak (bench/plan_vs_blind_pooled.py's sets) whose strategy
`plan --simulate` can run (FSDP2 or one device; no DeepSpeed row, no offload), the row's case is built exactly as its
set's script builds it, then measured by `shardfit.simulate.step.simulate`: one real step of the transformers model
on fake tensors, with the same runtime overhead and reading as the planner's. Each row then has three numbers:

- planned: the planner's predicted reading (the set's committed result);
- simulated: the same reading of the simulated step;
- published: what the source printed.

planned / simulated - 1 is the planner's own error against the tensors it models; simulated / published - 1 is what
the tensors of the run as the row describes it leave unexplained (the allocator, a reading taken elsewhere, settings
the source does not state). Nothing here is tuned on: it reads the blind rows' errors apart and changes no
prediction. A row the simulation cannot build (a remote-code model, a shape the catalog only describes) says why.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import plan_vs_blind as pvb  # noqa: E402
import plan_vs_blind_pooled as pooled  # noqa: E402
import plan_vs_published as pvp  # noqa: E402

from shardfit.errors import UserError  # noqa: E402
from shardfit.simulate.step import simulate  # noqa: E402
from shardfit.strategy import get as get_strategy  # noqa: E402

OUT = BENCH / "results" / "blind_vs_simulate.json"
# each set's script module and the part of its rows the pool counts (plan_vs_blind_pooled.SETS, by module)
SCRIPTS = {"plan_vs_blind4.json": "plan_vs_blind4", "plan_vs_blind5.json": "plan_vs_blind5",
           "plan_vs_blind6.json": "plan_vs_blind6", "plan_vs_blind7.json": "plan_vs_blind7",
           "plan_vs_blind8.json": "plan_vs_blind8", "plan_vs_blind9.json": "plan_vs_blind9",
           "plan_vs_blind10.json": "plan_vs_blind10", "plan_vs_moe_blind.json": "plan_vs_moe_blind"}


def simulable(case: dict) -> str | None:
    """Why `case` cannot be simulated, or None."""
    if "deepspeed" in case:
        return "a DeepSpeed run (plan/deepspeed.py, no simulation)"
    if "shape" in case:
        return "a model the catalog describes only by its shape"
    if not get_strategy(case["strategy"]).simulable:
        return f"{case['strategy']} is not simulated"
    return None


def measure(case: dict) -> dict:
    """The simulated reading of `case` (GiB) and the seconds the simulation took, or why it could not run."""
    why = simulable(case)
    if why:
        return {"skipped": why}
    shape, hw = pvp.throughput_shape(case), pvp.hardware(case)
    w = pvp.workload(case, case["seq"])
    t0 = time.perf_counter()
    try:
        cand = simulate(shape, w, hw, case["strategy"], None)
    except (UserError, ValueError, RuntimeError, NotImplementedError) as e:
        return {"skipped": f"simulation failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    reading = case.get("reading", "total")
    return {"simulated_read_gib": round(pvb.predicted_reading(cand.per_gpu_gib, reading, hw.gpu_mem_gib), 2),
            "simulated_total_gib": round(cand.per_gpu_gib.total, 2), "seconds": round(time.perf_counter() - t0, 1)}


def collect(limit: int | None = None) -> list[dict]:
    """Every pooled memory row with its simulation: each set's rows re-evaluated by its own script, with the row's
    case captured as its script builds it."""
    captured: dict[tuple[str, int], dict] = {}
    original = pvb.evaluate_row

    def capturing(index: int, row: dict, spec: dict, settings: dict | None = None) -> dict:
        out = original(index, row, spec, settings)
        if out.get("planned") and "error" in out:
            name = pvb.source_of(row, spec)
            captured[(current[0], index)] = pvb.case_of(row, spec["sources"][name], spec, settings)
        return out

    current = [""]
    pvb.evaluate_row = capturing
    rows: list[dict] = []
    try:
        for set_name, file, part in pooled.SETS:
            module = __import__(SCRIPTS[file])
            current[0] = set_name
            result = module.evaluate(_spec(module))
            for r in pooled.rows_of(result, part):
                if "error" not in r:
                    continue
                case = captured[(set_name, r["row"])]
                rows.append({"set": set_name, "row": r["row"], "source": r["source"], "model": r["planner_model"],
                             "method": r["method"], "strategy": r["planner_strategy"], "reading": r["reading"],
                             "planned_read_gib": r["predicted_read_gib"], "published_gib": r["published_gib"],
                             "case": case})
    finally:
        pvb.evaluate_row = original
    rows = rows[:limit] if limit else rows
    for i, r in enumerate(rows, 1):
        r.update(measure(r.pop("case")))
        if "simulated_read_gib" in r:
            r["planner_vs_simulated"] = round(r["planned_read_gib"] / r["simulated_read_gib"] - 1, 4)
            r["simulated_vs_published"] = round(r["simulated_read_gib"] / r["published_gib"] - 1, 4)
            r["planned_vs_published"] = round(r["planned_read_gib"] / r["published_gib"] - 1, 4)
        print(f"[{i}/{len(rows)}] {r['set']} row {r['row']} {r['model']} {r['strategy']}: "
              f"{r.get('skipped') or r['simulated_vs_published']}", file=sys.stderr, flush=True)
    return rows


def _spec(module: object) -> dict:
    """A set's YAML as its script reads it."""
    import yaml

    return yaml.safe_load(Path(module.SET).read_text())  # type: ignore[attr-defined]


def _median_abs(values: list[float]) -> float | None:
    return round(statistics.median(abs(v) for v in values), 4) if values else None


def summary(rows: list[dict]) -> dict:
    """Medians of |error| over the simulated rows: the planner against the simulation, the simulation against the
    sources, the planner against the sources (the same rows)."""
    done = [r for r in rows if "simulated_read_gib" in r]
    return {"rows": len(rows), "simulated": len(done),
            "planner_vs_simulated": _median_abs([r["planner_vs_simulated"] for r in done]),
            "simulated_vs_published": _median_abs([r["simulated_vs_published"] for r in done]),
            "planned_vs_published": _median_abs([r["planned_vs_published"] for r in done]),
            "skipped": sorted({r["skipped"] for r in rows if "skipped" in r})}


def table(rows: list[dict]) -> str:
    lines = ["| set | row | model | method | strategy | reading | published GiB | planned | simulated | "
             "planned vs simulated | simulated vs published |", "|---|--:|---|---|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "simulated_read_gib" not in r:
            continue
        lines.append(f"| {r['set']} | {r['row']} | {r['model']} | {r['method']} | {r['strategy']} | {r['reading']} "
                     f"| {r['published_gib']:.2f} | {r['planned_read_gib']:.2f} | {r['simulated_read_gib']:.2f} | "
                     f"{r['planner_vs_simulated']:+.1%} | {r['simulated_vs_published']:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, help="simulate the first N rows only")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    rows = collect(args.limit)
    result = {"summary": summary(rows), "rows": rows}
    if not args.limit:
        OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
