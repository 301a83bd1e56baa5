"""bench/published_blind.yaml and bench/plan_vs_blind.py: the blind set loads, every row is either planned or
says why not, and the committed results and the figures in docs/planning.md are those a fresh run computes.
How accurate the planner is on the set is the bench's measurement, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import load_bench

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"source_url", "source_text", "model", "method", "lora_rank", "seq_len", "micro_batch", "grad_accum",
            "grad_ckpt", "gpus", "strategy", "precision", "optimizer", "peak_memory", "tokens_per_s", "fits"}


@pytest.fixture(scope="module")
def bench():
    return load_bench("plan_vs_blind")


@pytest.fixture(scope="module")
def blind(bench) -> dict:
    return yaml.safe_load(bench.SET.read_text())


@pytest.fixture(scope="module")
def fresh(bench, blind) -> dict:
    return bench.evaluate(blind)


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """41 rows of five sources, each row the collector's fields and the url of exactly one source."""
    assert len(blind["rows"]) == 41 and len(blind["sources"]) == 5
    for row in blind["rows"]:
        assert set(row) == ROW_KEYS, set(row) ^ ROW_KEYS
        assert sum(src["url"] == row["source_url"] for src in blind["sources"].values()) == 1
        if row["peak_memory"]:
            assert row["peak_memory"]["unit"] in bench.pvp.UNITS and row["peak_memory"]["value"] > 0
    assert set(blind["unknown"]) <= bench.pvp.WORKLOAD_KEYS


def test_every_row_is_planned_or_says_why_not(fresh) -> None:
    """No row is dropped: a planned row has a prediction and a verdict (and an error for each published figure),
    a row not planned has its reason."""
    assert len(fresh["rows"]) == 41
    for r in fresh["rows"]:
        if r["planned"]:
            assert r["predicted_total_gib"] > 0 and isinstance(r["verdict_right"], bool)
            assert ("error" in r) == ("published_gib" in r)
            assert ("tokens_error" in r) == ("published_tokens_per_s" in r)
        else:
            assert len(r["reason"]) > 20, r
    s = fresh["summary"]
    assert s["planned"] + s["not_planned"] == 41 and len(fresh["not_planned"]) == s["not_planned"]
    assert s["memory"]["n"] > 0 and s["verdicts"]["n"] == s["planned"]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs its source does not map fails loudly rather than being planned on a guess."""
    row = next(r for r in blind["rows"] if "vertex" in r["source_url"])
    name = bench.source_of(row, blind)
    with pytest.raises(KeyError):
        bench.case_of({**row, "gpus": "3xMystery"}, blind["sources"][name], blind)
    assert bench.number("8 (per repo config)") == 8 and bench.number(16) == 16


def test_committed_results_and_docs_match_a_fresh_run(bench, fresh) -> None:
    """bench/results/plan_vs_blind.json is what the script computes now, docs/planning.md shows its table and the
    README its headline: rerun `python bench/plan_vs_blind.py` and paste both after any change to the planner or the
    set."""
    stored = json.loads(bench.OUT.read_text())
    fresh_json = json.loads(json.dumps(fresh))
    assert stored["summary"] == fresh_json["summary"]
    assert stored["sources"] == fresh_json["sources"] and stored["in_sample"] == fresh_json["in_sample"]
    assert stored == fresh_json
    assert bench.docs_table(fresh) in (ROOT / "docs" / "planning.md").read_text()
    assert " ".join(bench.headline(fresh).split()) in " ".join((ROOT / "README.md").read_text().split())
