"""bench/published_blind10.yaml and bench/plan_vs_blind10.py: the tenth blind set loads as collected, every row maps
onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not, and
each source's era block (its own `unknown`, decided from its date, versions and tool as the ninth set's rules say)
reaches its rows' cases. Nothing here predicts but the last test: how accurate the planner is on the set is the
bench's measurement."""

from __future__ import annotations

import json

import pytest

from tests.blind_sets import (
    ERA_ROW_KEYS,
    check_committed,
    check_era_blocks,
    check_mapping,
    check_readings_and_defaults,
    check_rows,
    set_fixtures,
)

# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"djangopeng-llm-quickstart": 1, "anyscale-templates-pr-35": 6}
# Sources of an engine of their own that no era rule reads, none of whose rows is planned: empty era blocks.
EMPTY = {"megatron-llama-issue-22", "megatron-llama-issue-27", "megatron-llama-issue-16", "megatron-llama-issue-11",
         "prolong-issue-10", "prolong-issue-16"}
# The LLM-quickstart course's ChatGLM3 QLoRA notebooks, padded to each batch's longest sample of an unprinted dataset.
CHATGLM_ROWS = [*range(9, 18), 19, 20, *range(33, 46)]
MEGATRON_ROWS = range(48, 59)
ANYSCALE_ROWS = range(71, 77)


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind10")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """85 rows of 39 sources (both collectors' rows, none dropped), each row the collector's fields with its date,
    versions and tool, and the url of exactly one source; the methods as the collectors' brief spells them; the
    defaults are the other blind sets'."""
    assert len(blind["rows"]) == 85 and len(blind["sources"]) == 39
    check_rows(blind, bench.pvb.pvp, ERA_ROW_KEYS, bench.pvb.source_of)
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    assert {row["method"] for row in blind["rows"]} == {"full", "lora", "qlora"}
    check_readings_and_defaults(blind, 85)
    assert not blind["row_settings"]
    assert bench.OUT.name == "plan_vs_blind10.json" and bench.SET.name == "published_blind10.yaml"


def test_a_repository_of_several_pages_is_one_source(bench, blind) -> None:
    """The forks whose notebooks share an era are one source each, by their repository's prefix; an issue or a pull
    request is a source of its own, even beside another of the same repository."""
    names = [bench.pvb.source_of(row, blind) for row in blind["rows"]]
    assert {names[i - 1] for i in (18, 19, 20, 33)} == {"djangopeng-llm-quickstart"}
    assert {names[i - 1] for i in range(36, 40)} == {"wang-fuxin-llm-quickstart-exec"}
    assert {names[i - 1] for i in range(25, 30)} == {"zihanwangki-llm"}
    assert len({names[i - 1] for i in MEGATRON_ROWS}) == 4 and names[63] != names[67]


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only; only the engines no rule reads (Megatron-LLaMA,
    ProLong's own model code) keep the set's defaults, and every planned source has its block."""
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, EMPTY, PLANNED)


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, set())
    assert sum(PLANNED.values()) == 7


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """The course's Llama-2 QLoRA (transformers 4.37.2) attends by SDPA, its 4-bit base keeps fp32 adapters and
    the set's fp32 frozen layers and double quantization, with the paged AdamW it states; Anyscale's January 2024
    template (peft 0.7.0 on a bf16 base) gives its LoRA adapters bf16 and checkpoints, as its rows say."""
    course = by_row[18]
    assert course["attention"] == "sdpa" and course["adapters_16bit"] is False and course["frozen_fp32"], course
    assert course["double_quant"] and course["bnb_optimizer"] and course["quant_backend"] == "bnb", course
    assert course["seq"] == 2048 and course["gpu"] == "T4" and course["lora_targets"] == ["q", "v"], course
    assert course["loss"] == "full" and course["precision"] == "bf16" and course["micro_batch"] == 3
    for i in ANYSCALE_ROWS:
        case = by_row[i]
        assert case["attention"] == "sdpa" and case["grad_ckpt"] == "full" and case["seq"] == 512, (i, case)
        assert case["fused_adamw"] is False and case["precision"] == "bf16", (i, case)
    assert by_row[74]["adapters_16bit"] and by_row[74]["lora_targets"] == ["gate", "up", "down"]


def test_a_multi_node_deepspeed_run_keeps_its_offload(by_row) -> None:
    """Anyscale's 7B and 13B runs offload optimizer and parameters (zero3_offload), the 70B runs the optimizer only
    (ZeRO-3 with its states on the host); each counts its nodes of A10Gs."""
    assert by_row[71]["gpu"] == "1xA10G" and by_row[71]["nodes"] == 16 and by_row[71]["strategy"] == "zero3_offload"
    assert by_row[72]["gpu"] == "4xA10G" and by_row[72]["nodes"] == 4 and by_row[72]["deepspeed"]["offload_param"]
    for i in (73, 76):
        assert by_row[i]["strategy"] == "zero3" and by_row[i]["nodes"] == 4, by_row[i]
        assert by_row[i]["deepspeed"] == {"stage": 3, "offload_optimizer": True}, by_row[i]


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """The ChatGLM3 notebooks' unknown lengths, Megatron-LLaMA, ProLong's own code, the GB10, GPUs not named and
    llmforge's capped lengths are not planned, with their reasons, though the columns alone would plan the
    notebooks."""
    assert all("tokens per step" in by_row[i] for i in CHATGLM_ROWS)
    assert all("Megatron-LLaMA" in by_row[i] for i in MEGATRON_ROWS)
    assert all("GB10" in by_row[i] for i in (22, 23, 24, 67)) and "ProLong" in by_row[59]
    assert all("not named" in by_row[i] for i in (*range(1, 9), 25, 26, 27, 30))
    assert all("cap" in by_row[i] for i in range(77, 86)) and "classification" in by_row[47]
    without = {**blind, "row_reasons": {}}
    for i in (9, 41, 44):
        settings = bench.settings_of(i, blind["rows"][i - 1], without)
        assert isinstance(bench.pvb.case_of(blind["rows"][i - 1], blind["sources"][bench.pvb.source_of(
            blind["rows"][i - 1], blind)], blind, settings), dict), i
    for i in (48, 59, 67):
        with pytest.raises(KeyError):
            bench.settings_of(i, blind["rows"][i - 1], without)


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or LoRA targets its source does not map fails loudly rather than being
    planned on a guess; an `unknown` attention is the era's default (no planned row states a peak, so no reading is
    mapped)."""
    row = blind["rows"][17]
    src = blind["sources"][bench.pvb.source_of(row, blind)]
    with pytest.raises(KeyError):
        bench.pvb.case_of({**row, "gpus": "3xMystery"}, src, blind)
    with pytest.raises(KeyError):
        bench.settings_of(18, {**row, "attention": "a mystery kernel"}, blind)
    with pytest.raises(KeyError):
        bench.settings_of(18, {**row, "lora_targets": "a mystery module"}, blind)
    settings = bench.settings_of(18, {**row, "attention": "unknown"}, blind)
    assert "attention" not in settings and "reading" not in settings
    assert bench.pvb.case_of(row, src, blind, settings)["attention"] == "sdpa"


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind10.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind10.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
