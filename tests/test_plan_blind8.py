"""bench/published_blind8.yaml and bench/plan_vs_blind8.py: the eighth blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not.
Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

import json

import pytest

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
PLANNED = {"databricks-llama2-7b-deepspeed": 2, "databricks-llama2-13b-deepspeed": 1, "databricks-llama2-70b-qlora": 1,
           "databricks-llama2-13b-qlora": 2, "databricks-llama2-7b-qlora": 1, "databricks-mistral-7b-qlora": 1,
           "determined-llm-finetuning-3": 1, "llm-action-training-performance": 16, "ai-learner-peft-examples": 9,
           "gemma2b-lora-qlora-experiments": 2}
# Sources whose era nothing decides (own engines, or not dated within the time box): an empty `unknown` block.
NO_ERA = {"sagarsrc-lora-experiments", "360-llama-factory", "dgx-spark-benchmarks", "aws-fsdp-mixtral",
          "nvidia-workbench-llama2", "nvidia-workbench-llama3", "usamec-lowmem-finetuning",
          "silencelamb-xtuner-handover", "jack31098-llm-training-demo", "scicom-small-ablation"}
RING_ROWS = range(5, 14)
DPO_ROWS = range(8, 14)
XTUNER_ROWS = range(43, 52)
LLM_ACTION_MB_ROWS = [*range(61, 69), *range(73, 77)]


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind8")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """92 rows of 24 sources (both collectors' rows, none repeated, none dropped), each row the collector's fields and
    the url of exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 92 and len(blind["sources"]) == 24
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    check_readings_and_defaults(blind, 92)
    assert bench.OUT.name == "plan_vs_blind8.json" and bench.SET.name == "published_blind8.yaml"


def test_units_are_renamed_not_converted_and_a_derived_speed_is_not_kept(blind) -> None:
    """llm-action's "显存占用(MB)" is MiB and the gemma-2-2b project's "GB" GiB (bytes / 1024**2 and / 1024**3), the
    numbers as collected; the AWS Mixtral row's tokens/s, the collector's product of samples/s and a length, is left
    out (its figure stays in the quote), as the earlier sets left samples/s out."""
    rows = blind["rows"]
    for i in LLM_ACTION_MB_ROWS:
        peak = rows[i - 1]["peak_memory"]
        assert peak is None or peak["unit"] == "MiB", i
        assert peak is None or blind["readings"][peak["reading"]] == {"reading": "total"}, i
    assert rows[60]["peak_memory"]["value"] == 15075.9375
    for i in (90, 91, 92):
        peak = rows[i - 1]["peak_memory"]
        assert peak["unit"] == "GiB" and blind["readings"][peak["reading"]] == {"reading": "allocated"}, i
    assert rows[25]["tokens_per_s"] is None and "14.50 samples/sec" in rows[25]["source_text"]


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only (added by the ninth set's rules by a reader who saw
    no prediction of this set); a source nothing dates or places keeps the set's defaults (an empty block)."""
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, NO_ERA)


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """Databricks' 2023 notebooks under transformers 4.31/4.34 attend eagerly and TRL's SFTTrainer checkpoints a 4-bit
    model; Determined's TRL 0.8.1 run checkpoints nothing; the gemma-2-2b project's peft 0.10 keeps its bf16 LoRA
    adapters 16-bit while its 4-bit QLoRA's stay fp32; a row's stated kernel and checkpointing win."""
    for i in (18, 20, 21, 22, 24, 25):
        assert by_row[i]["attention"] == "eager" and by_row[i]["grad_ckpt"] == "full", (i, by_row[i])
    assert not by_row[21]["adapters_16bit"] and not by_row[18]["fused_adamw"]
    assert by_row[42]["grad_ckpt"] == "none" and by_row[42]["attention"] == "sdpa"
    assert by_row[91]["adapters_16bit"] and not by_row[90]["adapters_16bit"] and by_row[90]["attention"] == "eager"
    assert by_row[83]["attention"] == "flash" and not by_row[83]["adapters_16bit"]
    assert by_row[61]["loss"] == "full" and by_row[69]["adapters_16bit"] is False


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare (an unnamed card's `assumed` note aside, as in the fourth and fifth sets);
    a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, {"assumed"})
    assert sum(PLANNED.values()) == 36


def test_row_settings_and_tables_reach_the_case(by_row) -> None:
    """What a row and its source state reaches the case: Databricks' ZeRO-3 with both offloads and its bitsandbytes
    QLoRA (fp16 compute, paged 32-bit AdamW, every projection); llm-action's rank-64 adapters with dropout 0.05;
    an unnamed 32 GB card and the RTX 3060 planned by their memory, `assumed`; the peaks' readings."""
    assert by_row[18]["strategy"] == "zero3_offload" and by_row[18]["seq"] == 256 and by_row[18]["micro_batch"] == 24
    assert by_row[18]["deepspeed"] == {"stage": 3, "offload_optimizer": True, "offload_param": True}
    assert by_row[20]["gpu"] == "8xA10G" and by_row[20]["model"] == "meta-llama/Llama-2-13b-hf"
    case = by_row[21]
    assert case["method"] == "qlora" and case["quant_backend"] == "bnb" and case["precision"] == "fp16", case
    assert case["bnb_optimizer"] and case["optimizer"] == "adamw" and case["lora_rank"] == 64, case
    assert set(case["lora_targets"]) == {"q", "k", "v", "o", "gate", "up", "down"}, case
    assert by_row[42]["strategy"] == "zero2" and by_row[42]["gpu"] == "2xA100" and by_row[42]["seq"] == 4096
    assert by_row[65]["lora_dropout"] == 0.05 and by_row[65]["quant_backend"] == "bnb"
    assert by_row[65]["model"] == "baichuan-inc/Baichuan2-7B-Base" and by_row[73]["model"] == "THUDM/chatglm3-6b"
    assert by_row[69]["precision"] == "fp16" and by_row[69]["reading"] == "total"
    assert by_row[80]["gpu"] == "1x32GB" and by_row[80]["assumed"] and by_row[80]["attention"] == "eager"
    assert by_row[83]["attention"] == "flash" and by_row[85]["precision"] == "bf16"
    assert by_row[90]["gpu"] == "1x12GB" and by_row[90]["assumed"] and by_row[90]["double_quant"]
    assert by_row[90]["reading"] == "allocated" and by_row[91]["method"] == "lora"


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """Ring-attention sequence parallelism (its DPO rows too, an objective the planner models), xtuner v1's MoE
    engine, the GB10, a classification head, frozen embeddings and fused Adafactor, DeepSpeed's pipeline on MI100s, an
    unstated weight dtype and a peak past the card are not planned, with their reasons, though the columns alone would
    plan some of them or fail on a string no table maps."""
    assert all("ring attention" in by_row[i] and by_row[i].startswith("Qwen2.5-") for i in RING_ROWS)
    assert all("DPO" in by_row[i] for i in DPO_ROWS) and "DPO" not in by_row[5]
    assert all("xtuner v1" in by_row[i] for i in XTUNER_ROWS)
    assert all("GB10" in by_row[i] for i in range(14, 18)) and "classification" in by_row[1]
    assert "Adafactor" in by_row[30] and all("fused into backward" in by_row[i] for i in (31, 32))
    assert all("pipeline" in by_row[i] and "MI100" in by_row[i] for i in range(52, 61))
    assert "activations offloaded" in by_row[26] and "NeMo" in by_row[27] and "paged AdamW" in by_row[28]
    assert all(by_row[i].startswith("Mistral-7B-Instruct-v0.2") for i in range(33, 42))
    assert "dtype" in by_row[81] and "evaluation step" in by_row[92]
    without = {**blind, "row_reasons": {}}
    assert bench.settings_of(92, blind["rows"][91], without)["reading"] == "allocated"
    with pytest.raises(KeyError):
        bench.settings_of(81, blind["rows"][80], without)
    with pytest.raises(KeyError):
        bench.settings_of(14, blind["rows"][13], without)


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess; an `unknown` attention is the set's default and leaves the row's reading as mapped (row 80
    reads `total`)."""
    check_unmapped_strings_raise(bench, blind, 80, "nvml")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind8.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind8.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
