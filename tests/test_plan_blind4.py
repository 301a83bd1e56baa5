"""bench/published_blind4.yaml and bench/plan_vs_blind4.py: the fourth blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not.
Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

from tests.blind_sets import (
    ROW_KEYS,
    check_committed,
    check_era_blocks,
    check_mapping,
    check_readings_and_defaults,
    check_rows,
    check_unmapped_strings_raise,
    set_fixtures,
)

# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"easycontext": 1, "openr1-readme": 1, "halo-30": 2, "openr1-506": 1, "openr1-446": 1, "soup-378": 4,
           "liger-677": 1, "verl-798": 1, "thunder-1528": 1, "qwen2vl-ft-23": 2, "vectorlm-5": 1,
           "qwen-vl-series-122": 1}


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind4")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """107 rows of 38 sources (both collectors' rows; none duplicated or excluded), each row the collector's fields
    and the url of exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 107 and len(blind["sources"]) == 38
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    check_readings_and_defaults(blind, 107)
    assert bench.OUT.name == "plan_vs_blind4.json" and bench.SET.name == "published_blind4.yaml"


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only; it is empty for a source with no row planned (not
    dated) and for halo-30, whose own engine was not read."""
    unplanned = set(blind["sources"]) - set(PLANNED)
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, unplanned | {"halo-30"}, PLANNED)


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """Liger's April 2025 Colab run attends by SDPA without checkpointing or the fused AdamW (transformers 4.51, the
    plain Trainer); thunder's benchmark steps a fused AdamW; EasyContext's stated flash attention stays."""
    liger, thunder, easy = by_row[79], by_row[84], by_row[16]
    assert liger["attention"] == "sdpa" and liger["grad_ckpt"] == "none" and liger["fused_adamw"] is False, liger
    assert thunder["fused_adamw"] is True and thunder["grad_ckpt"] == "none", thunder
    assert easy["attention"] == "flash" and easy["grad_ckpt"] == "full" and easy["loss"] == "full", easy


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, {"assumed"})
    assert sum(PLANNED.values()) == 17


def test_row_settings_come_from_what_the_row_states(blind, by_row) -> None:
    """What a row's text states beyond its columns reaches the case: a length written "64K", four packed examples
    as one row, Liger's fused loss, torch.compile, a trained vision tower, the peak's reading, a card assumed from
    the source where the row does not restate it."""
    assert by_row[16]["seq"] == 65536 and by_row[16]["strategy"] == "zero3_offload"
    assert by_row[16]["attention"] == "flash" and by_row[16]["method"] == "full"
    assert by_row[65]["micro_batch"] == 1 and by_row[65]["seq"] == 16384 and by_row[65]["adapters_16bit"] is True
    assert by_row[66]["reading"] == "allocated" and "assumed" in by_row[66] and by_row[66]["grad_accum"] == 16
    assert by_row[75]["loss"] == "full" and by_row[75]["attention"] == "sdpa" and by_row[75]["lora_rank"] == 16
    assert by_row[78]["loss"] == "chunked" and by_row[78]["attention"] == "flash"
    assert by_row[79]["reading"] == "total" and by_row[79]["seq"] == 128
    assert by_row[84]["float8"] is True and by_row[84]["compile"] is True and by_row[84]["strategy"] == "zero2"
    assert by_row[104]["vision_trainable"] is True and by_row[104]["seq"] == blind["unknown_seq_len"]
    assert by_row[82]["fsdp1"] is True and by_row[82]["strategy"] == "zero3"


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """Rows of another training engine or an on-policy objective are not planned, with their reason, though their
    columns alone would plan; the reasons of models, strategies and methods reach the rows they cover."""
    assert "Unsloth" in by_row[1] and "Surogate" in by_row[3] and "GRPO" in by_row[67]
    assert "TransformerEngine" in by_row[85] and "host" in by_row[96]
    without = {**blind, "row_reasons": {}}
    assert isinstance(bench.settings_of(3, blind["rows"][2], without), dict)
    assert "Megatron" in by_row[36] and "catalog" in by_row[25] and "method 'other'" in by_row[42]
    assert "ring" in by_row[17] and "strategy" in by_row[51]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess."""
    check_unmapped_strings_raise(bench, blind, 75, "rocm-smi")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind4.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind4.py`, paste its table
    after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
