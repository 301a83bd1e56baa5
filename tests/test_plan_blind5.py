"""bench/published_blind5.yaml and bench/plan_vs_blind5.py: the fifth blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not.
Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

import json

from tests.blind_sets import (
    ROW_KEYS,
    cases,
    check_committed,
    check_era_blocks,
    check_mapping,
    check_readings_and_defaults,
    check_rows,
    check_unmapped_strings_raise,
    set_fixtures,
)

# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"alignment-handbook-22": 1, "flash-sample-pack": 2, "exxact-lora": 2, "accelerate-3647": 2,
           "hf-blog-4bit": 10, "self-llm-qwen3-moe": 1, "belle-faq": 1, "accessory-91": 1, "self-llm-93": 1,
           "limo-10": 2,
           "chatglm2-ft-1": 1}  # mapped on 2026-11-30 after the catalog gained chatglm2-6b (no prediction seen)


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind5")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """115 rows of 48 sources (both collectors' rows, a run both recorded kept once), each row the collector's
    fields and the url of exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 115 and len(blind["sources"]) == 48
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    check_readings_and_defaults(blind, 115)
    assert bench.OUT.name == "plan_vs_blind5.json" and bench.SET.name == "published_blind5.yaml"


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only; it is empty for a source with no row planned (not
    dated) and for exxact-lora, whose blog's date was not found."""
    unplanned = set(blind["sources"]) - set(PLANNED)
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, unplanned | {"exxact-lora"}, PLANNED)


def test_the_era_reaches_the_case_below_what_the_row_states(bench, blind) -> None:
    """LIMO's LLaMA-Factory under transformers 4.48 copies the shifted fp32 logits and attends with the yaml's fa2;
    self-llm's April 2024 LoRA keeps its adapters in the bf16 base's dtype (peft 0.10)."""
    by_row = {i: case for i, name, case in cases(bench, blind) if not isinstance(case, str)}
    limo = [c for i, c in by_row.items() if blind["rows"][i - 1]["source_url"].endswith("LIMO/issues/10")]
    assert limo and all(c["loss"] == "full_shift" and c["attention"] == "flash" for c in limo), limo
    assert by_row[103]["adapters_16bit"] is True and by_row[103]["grad_ckpt"] == "full", by_row[103]


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, {"assumed"})
    assert sum(PLANNED.values()) == 24


def test_row_settings_come_from_what_the_row_states(blind, by_row) -> None:
    """What a row's text states beyond its columns reaches the case: a DPO objective, Liger's fused loss, torchtune's
    chunked loss under FSDP2 offload, nested quantization, LoRA dropout, a length written in words and no
    checkpointing; a card known only by its memory is marked assumed; a length the row leaves unknown is the set's."""
    assert by_row[3]["objective"] == "dpo" and by_row[3]["strategy"] == "zero3"
    assert by_row[3]["model"] == "mistralai/Mistral-7B-v0.1" and by_row[3]["deepspeed"] == {"stage": 3}
    assert by_row[31]["loss"] == "chunked" and by_row[31]["attention"] == "flash" and by_row[31]["fused_adamw"]
    assert by_row[32]["micro_batch"] == 2 and by_row[32]["seq"] == 65536
    assert by_row[43]["fsdp1"] is True and by_row[43]["loss"] == "full"
    assert by_row[44]["strategy"] == "zero3_offload" and by_row[44]["loss"] == "chunked" and by_row[44]["pure_16bit"]
    assert by_row[59]["double_quant"] is False and by_row[60]["double_quant"] is True
    assert by_row[57]["precision"] == "fp16" and by_row[57]["quant_backend"] == "bnb"
    assert by_row[61]["lora_targets"] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert by_row[61]["lora_dropout"] == 0.1 and by_row[61]["reading"] == "total"
    assert by_row[100]["seq"] == 512 and by_row[100]["grad_ckpt"] == "none" and by_row[100]["strategy"] == "zero2"
    assert "assumed" in by_row[33] and by_row[34]["gpu"] == "4x32GB"
    assert by_row[86]["seq"] == blind["unknown_seq_len"] and by_row[86]["model"] == "meta-llama/Llama-2-7b-hf"
    assert by_row[108]["deepspeed"]["offload_param"] is True and by_row[107]["strategy"] == "zero3"


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """GRPO runs, BAdam, an LLM.int8 base, a length given only as truncation limits and a peak not said to be one
    GPU's are not planned, with their reasons, though the columns alone would plan some of them; the reasons of
    models and strategies reach the rows they cover."""
    assert all("GRPO" in by_row[i] for i in (36, 68, 69, 109, 110))
    assert "BAdam" in by_row[1] and "LLM.int8" in by_row[47] and "truncation" in by_row[37]
    assert "device_map" in by_row[63]
    without = {**blind, "row_reasons": {}}
    assert bench.settings_of(63, blind["rows"][62], without)["lora_targets"] == ["q", "k", "v", "o", "gate", "up",
                                                                                 "down"]
    assert "catalog" in by_row[16] and "catalog" in by_row[70] and "tensor parallelism" in by_row[9]
    assert "not stated" in by_row[10] and "host memory" in by_row[11]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess."""
    check_unmapped_strings_raise(bench, blind, 61, "rocm-smi")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind5.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind5.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
