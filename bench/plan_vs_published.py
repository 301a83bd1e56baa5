"""The planner against published peak-memory measurements (bench/published_memory.yaml).

    python bench/plan_vs_published.py          # prints the table, writes bench/results/plan_vs_published.json

For a `max_context` case the run at `seq` just fit the card, so its real peak lay just under the card's memory:
the error reported is the predicted total at `seq` over the card's memory, minus one. The planner's own largest
fitting sequence length is printed beside the published one. An `oom` case is right when the planner says that
nothing of the smallest length the same source ran anywhere fits the card.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.plan.estimate import Workload, estimate  # noqa: E402
from shardfit.plan.hardware import parse_gpus  # noqa: E402
from shardfit.plan.shapes import resolve_shape  # noqa: E402

CASES = ROOT / "bench" / "published_memory.yaml"
OUT = ROOT / "bench" / "results" / "plan_vs_published.json"
WORKLOAD_KEYS = {f.name for f in dataclasses.fields(Workload)} - {"seq_len"}


def predicted_total(case: dict, seq: int) -> float:
    """Per-GPU GiB the planner predicts for the single-GPU run of `case` at sequence length `seq`."""
    w = Workload(seq_len=seq, **{k: v for k, v in case.items() if k in WORKLOAD_KEYS})
    return estimate(resolve_shape(case["model"]), w, parse_gpus(f"1x{case['gpu']}"), "single").per_gpu_gib.total


def max_fitting_seq(case: dict) -> int:
    """The largest sequence length (to 1 token) the planner says fits the card; 0 when none does."""
    cap = parse_gpus(f"1x{case['gpu']}").gpu_mem_gib
    lo, hi = 0, 1 << 22
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predicted_total(case, mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def evaluate(spec: dict) -> dict:
    """Each case with the planner's prediction, the error, and whether the fits/does-not-fit verdict is right."""
    rows = []
    cases = [{**spec["defaults"], **c} for c in spec["cases"]]
    smallest = {}
    for c in cases:
        if not c.get("oom"):
            smallest[c["model"]] = min(smallest.get(c["model"], 1 << 30), c["seq"])
    for c in cases:
        cap = parse_gpus(f"1x{c['gpu']}").gpu_mem_gib
        seq = smallest[c["model"]] if c.get("oom") else c["seq"]
        total = predicted_total(c, seq)
        row = {"model": c["model"], "gpu": c["gpu"], "gpu_gib": cap, "seq": seq, "published": "OOM" if c.get("oom")
               else f"fits at {seq}", "predicted_total_gib": round(total, 2), "predicted_max_seq": max_fitting_seq(c),
               "verdict_right": (total > cap) if c.get("oom") else (total <= cap), "source": c["source"]}
        if not c.get("oom"):
            row["error"] = round(total / cap - 1, 4)
        rows.append(row)
    errors = [abs(r["error"]) for r in rows if "error" in r]
    return {"cases": rows, "median_abs_error": round(statistics.median(errors), 4),
            "verdicts_right": sum(r["verdict_right"] for r in rows), "verdicts": len(rows),
            "sources": spec["sources"]}


def markdown(result: dict) -> str:
    lines = ["| model | GPU | published (HF + FA2) | predicted total GiB | error | planner's max seq | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        err = f"{r['error']:+.1%}" if "error" in r else "-"
        lines.append(f"| {r['model']} | {r['gpu']} | {r['published']} | {r['predicted_total_gib']:.1f} | {err} | "
                     f"{r['predicted_max_seq']:,} | {'right' if r['verdict_right'] else 'WRONG'} |")
    lines.append(f"\nmedian |error| {result['median_abs_error']:.1%}; verdicts right "
                 f"{result['verdicts_right']}/{result['verdicts']}")
    return "\n".join(lines)


def main() -> None:
    result = evaluate(yaml.safe_load(CASES.read_text()))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
