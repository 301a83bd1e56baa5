"""The planner over every blind set at once: the rows of each set's committed results, pooled, so that the headline
does not rest on the handful of peaks one set happens to hold.

    python bench/plan_vs_blind_pooled.py   # prints the table, writes bench/results/plan_vs_blind_pooled.json

Each blind set's own script computes its rows (bench/plan_vs_blind4.py to plan_vs_blind10.py, plan_vs_moe_blind.py);
this reads their committed results and nothing else, so it predicts nothing itself. The MoE set contributes its
test part only: its dev part was looked at while the planner's MoE rules were written. Every set was collected by
people who never saw a prediction. The first and third sets (bench/plan_vs_blind.py, plan_vs_blind3.py) were blind
until 2026-11-30, when they became dev data for the planner's misses: the table shows them apart, as in-sample, and
the headline leaves them out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import plan_vs_blind as pvb  # noqa: E402

RESULTS = BENCH / "results"
OUT = RESULTS / "plan_vs_blind_pooled.json"
# (name shown, results file, the part of it that counts: None for every row).
SETS = (("fourth", "plan_vs_blind4.json", None), ("fifth", "plan_vs_blind5.json", None),
        ("sixth", "plan_vs_blind6.json", None), ("seventh", "plan_vs_blind7.json", None),
        ("eighth", "plan_vs_blind8.json", None), ("ninth", "plan_vs_blind9.json", None),
        ("tenth", "plan_vs_blind10.json", None), ("MoE (test part)", "plan_vs_moe_blind.json", "test"))
# Former blind sets, dev data since their last blind scores: shown, never pooled into the headline.
FORMER = (("first", "plan_vs_blind.json", None), ("third", "plan_vs_blind3.json", None))

def rows_of(result: dict, part: str | None) -> list[dict]:
    """The rows of one set's results that count: all, or those of `part`."""
    return [r for r in result["rows"] if part is None or r.get("part") == part]


def evaluate(results: Path = RESULTS) -> dict:
    """The summary of every counted row pooled, and each set's over its own: in the shape of one set's result, so
    that plan_vs_blind's table and headline read it (its `sources` are the sets here; no in-sample part), plus the
    former blind sets' own summaries (`former`), outside the pool."""
    per_set, pooled = {}, []
    for name, file, part in SETS:
        rows = rows_of(json.loads((results / file).read_text()), part)
        per_set[name] = pvb.summary(rows)
        pooled += rows
    former = {name: pvb.summary(rows_of(json.loads((results / file).read_text()), part))
              for name, file, part in FORMER}
    return {"summary": pvb.summary(pooled), "sources": per_set, "in_sample": None, "former": former}


def docs_table(result: dict) -> str:
    """docs/planning.md's pooled table: plan_vs_blind's, the former blind sets below it, labelled in-sample."""
    table = pvb.docs_table(result)
    former = pvb.docs_table({"summary": result["summary"], "in_sample": None,
                             "sources": result["former"]}).splitlines()[3:]
    return "\n".join([table] + [line.replace("| blind: ", "| former blind, now dev (in-sample): ", 1)
                                 for line in former])

def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    result = evaluate()
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(docs_table(result))
    print(pvb.headline(result))


if __name__ == "__main__":
    main()
