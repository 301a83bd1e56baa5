"""The planner against the seventh blind set (bench/published_blind7.yaml): published figures of real fine-tuning and
training runs, collected by two people who never saw this project's code nor a prediction; an out-of-sample
measure, not tuned on.

    python bench/plan_vs_blind7.py         # prints the tables, writes bench/results/plan_vs_blind7.json

The method is the fourth to sixth blind sets' (bench/plan_vs_blind4.py, whose functions this reuses): each row is
predicted with what it states, the YAML's `unknown` defaults where it states nothing, its source's mapping of
model, GPUs, strategy, precision, optimizer and attention, the set's `readings` and `row_settings` (what a row's text
states beyond its columns); a row in `row_reasons` (a run the planner does not model, or a figure it cannot compare)
is not planned, with that reason. The figures are the first blind set's: memory error against the peak as read,
fits-or-not verdicts, tokens/s error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_vs_blind3 as pvb3  # noqa: E402
import plan_vs_blind4 as pvb4  # noqa: E402

pvb = pvb3.pvb  # the first set's functions, which the tests reach through each set's script
settings_of = pvb4.settings_of  # a row's reason from `row_reasons` first, else the third set's reading
SET, OUT, evaluate, main = pvb3.set_script(7, __doc__, settings_of)


if __name__ == "__main__":
    main()
