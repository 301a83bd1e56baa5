"""bench/plan_vs_blind_pooled.py: every blind set's counted rows pooled; the committed result, the docs table and
the README's headline, counts and range are what a fresh pooling of the committed per-set results gives."""

from __future__ import annotations

import json

from tests.blind_sets import ROOT, check_committed, set_fixtures

bench = set_fixtures("plan_vs_blind_pooled")[0]  # it pools committed results: no set of its own to load


def test_the_pool_is_the_sum_of_the_sets(bench) -> None:
    """Every set's counted rows reach the pool once: its counts are the sets' sums, and the MoE set gives its test
    part only (its dev part was looked at while its rules were written)."""
    fresh = bench.evaluate()
    sets, pooled = fresh["sources"], fresh["summary"]
    for key in ("rows", "planned"):
        assert pooled[key] == sum(s[key] for s in sets.values())
    assert pooled["memory"]["n"] == sum(s["memory"]["n"] for s in sets.values())
    assert pooled["verdicts"]["oom_rows"] == sum(s["verdicts"]["oom_rows"] for s in sets.values())
    moe = json.loads((bench.RESULTS / "plan_vs_moe_blind.json").read_text())
    assert sets["MoE (test part)"]["rows"] == moe["parts"]["test"]["rows"] < len(moe["rows"])
    eighth = json.loads((bench.RESULTS / "plan_vs_blind8.json").read_text())
    assert sets["eighth"] == eighth["summary"]
    # The former blind sets (dev data since 2026-11-30) are shown apart and pooled nowhere.
    assert set(fresh["former"]) == {"first", "third"} and not set(fresh["former"]) & set(sets)
    first = json.loads((bench.RESULTS / "plan_vs_blind.json").read_text())
    assert fresh["former"]["first"] == first["summary"]
    assert "former blind, now dev (in-sample): first |" in bench.docs_table(fresh)


def test_committed_results_and_docs_match_a_fresh_pooling(bench) -> None:
    """Rerun `python bench/plan_vs_blind_pooled.py` after any blind set's results change, and paste its table into
    docs/planning.md and its headline into the README."""
    fresh = bench.evaluate()
    check_committed(bench, fresh, bench.docs_table, bench.pvb.headline)
    pooled = fresh["summary"]
    medians = [s["memory"]["median_abs_error"] for s in fresh["sources"].values() if s["memory"]["n"]]
    readme = " ".join((ROOT / "README.md").read_text().split())
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}
    assert f"Pooled over {words[len(bench.SETS)]} blind sets ({pooled['rows']} published rows, " \
           f"{pooled['planned']} plannable" in readme
    assert f"(memory {min(medians):.0%} to {max(medians):.0%};" in readme.replace(" %", "%")
