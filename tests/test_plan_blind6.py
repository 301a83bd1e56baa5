"""bench/published_blind6.yaml and bench/plan_vs_blind6.py: the sixth blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not.
Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

import json

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
PLANNED = {"arctic-h100-8b-baseline": 2, "arctic-h200-8b-baseline": 1, "arctic-h200-8b-liger": 1,
           "arctic-h200-8b-liger-b801": 1, "lit-llama-lora": 1, "lit-llama-full": 1, "rocm-llama-qlora": 3,
           "skythought-sky-t1": 1, "flagperf-llama2-7b-lora": 1, "flagperf-llama2-7b-h800": 1,
           "flagperf-llama2-7b-a800": 1, "qwen3-804": 1, "scris-llama3-torchtune": 1,
           # mapped on 2026-11-30, after the catalog gained their models, by a reader who saw no prediction
           "flagperf-chatglm3-6b": 1, "flagperf-baichuan2-13b": 3, "deepspeed-zero-4090": 7}
# The on-policy RL runs (PPO/GRPO trainers with an inference engine's rollouts): rllm, simpleRL, TinyZero,
# Search-R1, simple_GRPO and Trinity-RFT.
RL_ROWS = (35, 36, *range(42, 49), *range(90, 94), *range(101, 116))


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind6")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """116 rows of 53 sources (both collectors' rows, none repeated), each row the collector's fields and the url of
    exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 116 and len(blind["sources"]) == 53
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    check_readings_and_defaults(blind, 116)
    assert bench.OUT.name == "plan_vs_blind6.json" and bench.SET.name == "published_blind6.yaml"


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only; every planned source has keys, and a source with no
    row planned is empty unless it shares a planned source's commit and tool."""
    shared = {name for name in blind["sources"] if name.startswith("arctic-")} | {"lit-llama-adapter",
                                                                                  "rocm-llama2-qlora-mi250"}
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, set(blind["sources"]) - set(PLANNED) - shared, PLANNED)


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """Sky-T1's LLaMA-Factory under transformers 4.46 copies the shifted fp32 logits; torchtune's October 2024 LoRA
    config chunks its loss and fuses its AdamW; a January 2026 HF Trainer steps adamw_torch_fused while the row's
    stated checkpointing stays."""
    assert by_row[41]["loss"] == "full_shift" and by_row[41]["grad_ckpt"] == "full", by_row[41]
    assert by_row[116]["loss"] == "chunked" and by_row[116]["fused_adamw"] is True, by_row[116]
    assert by_row[94]["fused_adamw"] is True and by_row[94]["grad_ckpt"] == "none", by_row[94]


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, set())
    assert sum(PLANNED.values()) == 27


def test_row_settings_and_tables_reach_the_case(blind, by_row) -> None:
    """What a row and its source state reaches the case: ArcticTraining's ZeRO-3 offload with DeepSpeed's CPUAdam
    and Liger's fused loss, lit-llama's bf16-true LoRA on q and v and its FSDP1, an fp32 and a 4-bit run on an
    MI300X read by rocm-smi, LoRA dropout, a pinned-memory choice and a length the row leaves unknown."""
    assert by_row[1]["strategy"] == "zero3_offload" and by_row[1]["deepspeed"]["ds_optimizer"] is True
    assert by_row[1]["loss"] == "full" and by_row[6]["loss"] == "chunked" and by_row[10]["seq"] == 350000
    assert by_row[5]["gpu"] == "H200" and by_row[5]["attention"] == "flash"
    assert by_row[22]["pure_16bit"] and by_row[22]["lora_targets"] == ["q", "v"] and by_row[22]["grad_ckpt"] == "none"
    assert by_row[24]["strategy"] == "zero3" and by_row[24]["fsdp1"] is True
    assert by_row[37]["precision"] == "fp32" and by_row[37]["gpu"] == "MI300X" and by_row[37]["reading"] == "total"
    assert by_row[39]["quant_backend"] == "bnb" and by_row[39]["precision"] == "fp16"
    assert by_row[39]["lora_dropout"] == 0.1 and by_row[74]["lora_dropout"] == 0.05
    assert by_row[87]["deepspeed"]["pin_memory"] is False and by_row[87]["model"] == "Qwen/Qwen2-72B-Instruct"
    assert by_row[80]["seq"] == blind["unknown_seq_len"] and by_row[116]["pure_16bit"]


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """RL runs, ALST's tiled MLP and host-offloaded checkpoints, KTransformers' and Unsloth's engines, an MI250 and
    lengths given only as truncation limits are not planned, with their reasons, though the columns alone would
    plan some of them; the reasons of models and strategies reach the rows they cover."""
    assert all("PPO/GRPO" in by_row[i] for i in RL_ROWS)
    assert all("tiled MLP" in by_row[i] for i in (3, 4, 8, 9, 12, 13, 14, 15))
    assert "host memory" in by_row[7] and "host memory" in by_row[11]
    assert all("KTransformers" in by_row[i] for i in (18, 19, 20, 21)) and "Unsloth" in by_row[17]
    assert "MI250" in by_row[40] and all("truncation" in by_row[i] for i in range(65, 74))
    without = {**blind, "row_reasons": {}}
    assert bench.settings_of(7, blind["rows"][6], without)["attention"] == "flash"
    assert "catalog" in by_row[25] and "Megatron" in by_row[85]
    assert by_row[94]["model"] == "deepseek-ai/deepseek-math-7b-base"  # a catalog twin since 2026-11-30


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess."""
    check_unmapped_strings_raise(bench, blind, 1, "nvml")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind6.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind6.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
