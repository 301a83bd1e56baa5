"""bench/blind_vs_simulate.py: the committed reading-apart of the blind rows. Its summary is what its rows give,
its rows are the pooled blind peaks (each once, with the planner's committed prediction), and docs/planning.md
states its figures."""

from __future__ import annotations

import importlib
import json
import sys

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
bvs = importlib.import_module("blind_vs_simulate")
pooled = importlib.import_module("plan_vs_blind_pooled")
RESULT = json.loads((ROOT / "bench" / "results" / "blind_vs_simulate.json").read_text())


def test_the_summary_is_what_the_rows_give() -> None:
    assert RESULT["summary"] == bvs.summary(RESULT["rows"])
    for r in RESULT["rows"]:
        assert ("simulated_read_gib" in r) != ("skipped" in r)
        if "simulated_read_gib" in r:
            assert r["planner_vs_simulated"] == round(r["planned_read_gib"] / r["simulated_read_gib"] - 1, 4)


def test_its_rows_are_the_pooled_peaks_as_planned_now() -> None:
    """Every pooled peak once, with the prediction its set's committed result holds (a planner change that moves a
    row leaves this result stale: rerun the bench)."""
    planned = {}
    for name, file, part in pooled.SETS:
        for r in pooled.rows_of(json.loads((pooled.RESULTS / file).read_text()), part):
            if "error" in r:
                planned[(name, r["row"])] = r["predicted_read_gib"]
    assert {(r["set"], r["row"]): r["planned_read_gib"] for r in RESULT["rows"]} == planned


def test_the_docs_state_its_figures() -> None:
    s = RESULT["summary"]
    text = " ".join((ROOT / "docs" / "planning.md").read_text().split())
    assert f"({s['simulated']} of {s['rows']}:" in text
    assert f"agree to a median of {s['planner_vs_simulated']:.2%}".replace("%", " %") in text
    assert f"is {s['simulated_vs_published']:.1%} from the published peaks".replace("%", " %") in text
