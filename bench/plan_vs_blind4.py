"""The planner against the fourth blind set (bench/published_blind4.yaml): published figures of real fine-tuning
runs, collected by two people who never saw this project's code nor a prediction; an out-of-sample measure, not
tuned on.

    python bench/plan_vs_blind4.py         # prints the tables, writes bench/results/plan_vs_blind4.json

The method is the third blind set's (bench/plan_vs_blind3.py, whose functions this reuses): each row is predicted
with what it states, the YAML's `unknown` defaults where it states nothing, its source's mapping of model, GPUs,
strategy, precision, attention and LoRA targets, the set's `readings`, and `row_settings` (what a row's text states
beyond its columns). This set adds `row_reasons`: a row whose columns the planner could read, but whose run it does
not model (another training engine, an on-policy objective), is not planned, with that reason. The figures are the
first blind set's: memory error against the peak as read, fits-or-not verdicts, tokens/s error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_vs_blind3 as pvb3  # noqa: E402

pvb = pvb3.pvb  # the first set's functions, which the tests reach through each set's script


def settings_of(index: int, row: dict, spec: dict) -> dict | str | None:
    """Row `index`'s settings as the third set reads them (plan_vs_blind3.settings_of), or the reason it is not
    planned: its entry in the set's `row_reasons` first, a column its source marks `not_planned` next; None for a
    row case_of already does not plan."""
    reason = spec.get("row_reasons", {}).get(index)
    if reason:
        return " ".join(str(reason).split())
    return pvb3.settings_of(index, row, spec)


SET, OUT, evaluate, main = pvb3.set_script(4, __doc__, settings_of)


if __name__ == "__main__":
    main()
