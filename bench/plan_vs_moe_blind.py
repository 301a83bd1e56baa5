"""The planner against the MoE blind set (bench/published_moe_blind.yaml): published figures of mixture-of-experts
fine-tuning runs, collected by someone who never saw a prediction; an out-of-sample measure, not tuned on.

    python bench/plan_vs_moe_blind.py      # prints the tables, writes bench/results/plan_vs_moe_blind.json

The method is the first blind set's (bench/plan_vs_blind.py, whose functions this reuses): each row is predicted
with what it states, the YAML's `unknown` defaults where it states nothing, its source's mapping of model, GPUs,
strategy, precision and optimizer onto the planner's vocabulary, and the per-row `row_settings` (what its source
text states beyond the columns). A row the YAML lists under `not_planned` keeps its reason and its group (`why`).
Each row is `dev` or `test` by the rule fixed in the YAML before any prediction (parity of the first hex digit of
sha256(source_url), bench/plan_vs_published.py `part`); the test part is the headline, dev is shown beside it.
Per part: memory median and p90 |error| with the count under-predicted by more than 5 % (and the median signed
error), fits-or-not right/total with how many out-of-memory runs were predicted to fit, tokens/s median |error|.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import plan_vs_blind as pvb  # noqa: E402
import plan_vs_published as pvp  # noqa: E402

SET = BENCH / "published_moe_blind.yaml"
OUT = BENCH / "results" / "plan_vs_moe_blind.json"
PARTS = ("test", "dev")


def evaluate_row(index: int, row: dict, spec: dict) -> dict:
    """One row with its part: the first blind set's evaluation, or the YAML's reason for not planning it."""
    part = pvp.part(row["source_url"])
    skip = spec["not_planned"]["rows"].get(index)
    if skip is not None:
        return {"row": index, "part": part, "source": pvb.source_of(row, spec), "model": row["model"],
                "method": row["method"], "gpus": row["gpus"], "strategy": row["strategy"], "seq": row["seq_len"],
                "published_fits": row["fits"], "planned": False, "why": skip["why"],
                "reason": " ".join(skip["reason"].split())}
    out = pvb.evaluate_row(index, row, spec, spec["row_settings"].get(index))
    if not out["planned"]:  # a model or card the planner refused: its own words are the reason
        out["why"] = "refused by the planner"
    return {"row": index, "part": part, **{k: v for k, v in out.items() if k != "row"}}


def summary(rows: list[dict]) -> dict:
    """The first blind set's figures over `rows`, with the median signed memory error and the out-of-memory runs
    the planner said would fit."""
    s = pvb.summary(rows)
    errors = [r["error"] for r in rows if r.get("planned") and "error" in r]
    s["memory"]["median_error"] = round(statistics.median(errors), 4) if errors else None
    v = s["verdicts"]
    v["oom_predicted_fit"] = v["oom_rows"] - v["oom_right"]
    return s


def evaluate(spec: dict) -> dict:
    """Every row; the rows not planned with their reasons and a count per reason; the summary per part."""
    rows = [evaluate_row(i, row, spec) for i, row in enumerate(spec["rows"], start=1)]
    skipped = [r for r in rows if not r["planned"]]
    return {"set": str(SET.relative_to(BENCH.parent)), "rows": rows,
            "not_planned": [{k: r[k] for k in ("row", "part", "source", "model", "why", "reason")} for r in skipped],
            "not_planned_by_reason": dict(Counter(r["why"] for r in skipped).most_common()),
            "parts": {p: summary([r for r in rows if r["part"] == p]) for p in PARTS},
            "summary": summary(rows)}


def markdown(result: dict) -> str:
    """Every planned row, then the rows not planned."""
    lines = ["| row | part | model | method | GPUs | strategy | seq | published | predicted GiB | error | verdict | "
             "tok/s published | predicted | error |", "|" + "---|" * 14]
    for r in result["rows"]:
        if not r["planned"]:
            continue
        mem = r.get("published", "OOM" if r["published_fits"] is False else "fits")
        tok = (f"{r['published_tokens_per_s']:,.0f} | {r['predicted_tokens_per_s']:,.0f} | {r['tokens_error']:+.1%}"
               if "tokens_error" in r else "- | - | -")
        err = f"{r['error']:+.1%}" if "error" in r else "-"
        gib = r.get("predicted_read_gib", r["predicted_total_gib"])
        lines.append(f"| {r['row']} | {r['part']} | {r['planner_model']} | {r['method']} | {r['gpus']} | "
                     f"{r['planner_strategy']} | {r.get('planned_seq', r['seq'])} | {mem} | {gib:.1f} | {err} | "
                     f"{'right' if r['verdict_right'] else 'WRONG'} | {tok} |")
    lines.append("")
    lines += [f"not planned: row {r['row']} ({r['part']}, {r['why']}): {r['model']}" for r in result["not_planned"]]
    return "\n".join(lines)


def docs_table(result: dict) -> str:
    """The figures table of docs/planning.md ("MoE models, measured by outsiders"), written from `result` so that
    the test can check the documented figures against a fresh run."""
    lines = ["| part | rows planned | memory rows | median \\|error\\| | median error | p90 \\|error\\| | "
             "under by > 5 % | verdicts right | OOM runs predicted to fit | tokens/s rows | median \\|error\\| |",
             "|" + "---|" * 11]
    names = {"test": "**test (headline)**", "dev": "dev"}
    for p in PARTS:
        s = result["parts"][p]
        m, v, t = s["memory"], s["verdicts"], s["tokens_per_s"]
        share = "-" if m["n"] == 0 else f"{m['under_predicted']}/{m['n']}"
        verdicts = "-" if v["n"] == 0 else f"{v['right']}/{v['n']}"
        ooms = "-" if v["oom_rows"] == 0 else f"{v['oom_predicted_fit']}/{v['oom_rows']}"
        signed = "-" if m["median_error"] is None else f"{m['median_error']:+.1%}"
        lines.append(f"| {names[p]} | {s['planned']}/{s['rows']} | {m['n']} | {pvb._pct(m['median_abs_error'])} | "
                     f"{signed} | {pvb._pct(m['p90_abs_error'])} | {share} | {verdicts} | {ooms} | {t['n']} | "
                     f"{pvb._pct(t['median_abs_error'])} |")
    return "\n".join(lines)


def reasons_line(result: dict) -> str:
    """The not-planned count per reason, as docs/planning.md states it."""
    counts = result["not_planned_by_reason"]
    return f"{sum(counts.values())} rows not planned: " + ", ".join(f"{why} {n}" for why, n in counts.items())


def main(argv: list[str] | None = None) -> None:
    pvb.run(argv, __doc__.split("\n\n")[0], SET, OUT, evaluate, [markdown, docs_table, reasons_line])


if __name__ == "__main__":
    main()
