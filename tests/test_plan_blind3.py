"""bench/published_blind3.yaml and bench/plan_vs_blind3.py: the third blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model or inline shape, a card, a strategy, Workload keys, a reading)
or says why not. Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

import yaml

from tests.blind_sets import (
    ROOT,
    ROW_KEYS,
    check_committed,
    check_mapping,
    check_rows,
    check_unmapped_strings_raise,
    set_fixtures,
)

# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"fms-accel-a100": 10, "glm4-finetune-demo": 2, "glm4-finetune": 2, "llama-recipes-pr41": 3,
           "llama-recipes-issue100": 1, "llama-recipes-issue120": 2, "fms-accel-moe": 2, "hf-blog-fsdp70b": 1,
           "philschmid-fsdp-qlora-llama3": 1, "alpaca-280": 2, "platypus-10": 2}


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind3")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """53 rows of 19 sources, each row the collector's fields and the url of exactly one source; the defaults are
    the first blind set's."""
    assert len(blind["rows"]) == 53 and len(blind["sources"]) == 19
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    first = yaml.safe_load((ROOT / "bench" / "published_blind.yaml").read_text())
    assert blind["unknown"] == first["unknown"] and blind["unknown_qlora"] == first["unknown_qlora"]
    assert blind["unknown_seq_len"] > 0 and bench.OUT.name == "plan_vs_blind3.json"


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model or an inline shape, a card the planner parses, one of its
    strategies, Workload keys it accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, {"shape"})
    assert sum(PLANNED.values()) == 28


def test_row_settings_come_from_what_the_row_states(blind, by_row) -> None:
    """The columns beyond the first set's reach the case: flash attention, named targets, a reserved reading, the
    logits kept alive before llama-recipes' fix, and a length the row leaves unknown."""
    assert by_row[1]["attention"] == "flash" and by_row[1]["reading"] == "total"
    assert by_row[4]["lora_targets"] == ["q", "k", "v", "o"] and by_row[4]["lora_rank"] == 16
    assert by_row[22]["reading"] == "reserved" and by_row[22]["keeps_logits"] is True
    assert "keeps_logits" not in by_row[24] and by_row[24]["lora_targets"] == ["q", "v"]
    assert by_row[25]["attention"] == "eager" and by_row[25]["seq"] == blind["unknown_seq_len"]
    assert by_row[29]["expert_parallel"] == 8 and by_row[29]["strategy"] == "zero3"
    assert "modules_to_save" in by_row[42] and "freeze" in by_row[44]
    assert "FP8" in by_row[16] and "InternVL2" in by_row[36]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or targets its source does not map fails loudly rather than being
    planned on a guess."""
    check_unmapped_strings_raise(bench, blind, 1, "rocm-smi")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind3.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind3.py`, paste its table
    after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
