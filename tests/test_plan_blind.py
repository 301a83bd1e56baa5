"""bench/published_blind.yaml and bench/plan_vs_blind.py: the blind set loads, every row is either planned or
says why not, and the committed results and the figures in docs/planning.md are those a fresh run computes.
How accurate the planner is on the set is the bench's measurement, not asserted here."""

from __future__ import annotations

import pytest

from tests.blind_sets import check_committed, check_planned_or_reasoned, check_rows, set_fixtures

ROW_KEYS = {"source_url", "source_text", "model", "method", "lora_rank", "seq_len", "micro_batch", "grad_accum",
            "grad_ckpt", "gpus", "strategy", "precision", "optimizer", "peak_memory", "tokens_per_s", "fits"}


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """41 rows of five sources, each row the collector's fields and the url of exactly one source."""
    assert len(blind["rows"]) == 41 and len(blind["sources"]) == 5
    check_rows(blind, bench.pvp, ROW_KEYS, bench.source_of)

def test_every_row_is_planned_or_says_why_not(fresh) -> None:
    """No row is dropped: a planned row has a prediction and a verdict (and an error for each published figure),
    a row not planned has its reason."""
    check_planned_or_reasoned(fresh, 41)
    s = fresh["summary"]
    assert s["memory"]["n"] > 0 and s["verdicts"]["n"] == s["planned"]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs its source does not map fails loudly rather than being planned on a guess."""
    row = next(r for r in blind["rows"] if "vertex" in r["source_url"])
    name = bench.source_of(row, blind)
    with pytest.raises(KeyError):
        bench.case_of({**row, "gpus": "3xMystery"}, blind["sources"][name], blind)
    assert bench.number("8 (per repo config)") == 8 and bench.number(16) == 16


def test_committed_results_and_docs_match_a_fresh_run(bench, fresh) -> None:
    """bench/results/plan_vs_blind.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind.py` and paste its table
    after any change to the planner."""
    check_committed(bench, fresh, bench.docs_table)
    stored = bench.OUT.read_text()
    assert '"sources"' in stored and '"in_sample"' in stored
