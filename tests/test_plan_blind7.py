"""bench/published_blind7.yaml and bench/plan_vs_blind7.py: the seventh blind set loads as collected, and every row
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
PLANNED = {"torchao-lowbit-optim": 3, "torchao-float8-training": 3}
# Sources whose era nothing decides (own engines, own code not read, or not dated): an empty `unknown` block.
NO_ERA = {"opentau-pr429", "opentau-pr273", "opentau-issue264", "opentau-pr265", "galore-readme",
          "theailabs-a100-walkthrough", "torchao-quantized-training", "llmq-readme", "rwkv-peft",
          "internevo-performance", "aquila2-readme-cn", "telechat2-deepspeed", "chatglm6b-ptuning-notes",
          "lomo-readme-zh", "onlybooks-llm-ch5"}
LLMQ_ROWS = range(64, 106)
TORCHTITAN_ROWS = range(42, 54)


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind7")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """181 rows of 20 sources (both collectors' rows, none repeated), each row the collector's fields and the url of
    exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 181 and len(blind["sources"]) == 20
    check_rows(blind, bench.pvb.pvp, ROW_KEYS, bench.pvb.source_of)
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    check_readings_and_defaults(blind, 181)
    assert bench.OUT.name == "plan_vs_blind7.json" and bench.SET.name == "published_blind7.yaml"


def test_torchtitan_peaks_are_read_as_gib_reserved(blind) -> None:
    """torchtitan logs max_memory_reserved in GiB: the float8 page's "GB" is kept as GiB (the one unit renamed) and
    read as `reserved`, like the MoE page's GiB; the torchtune peaks beside them stay GB, read as `allocated`."""
    rows = blind["rows"]
    for i in TORCHTITAN_ROWS:
        peak = rows[i - 1]["peak_memory"]
        assert peak["unit"] == "GiB" and blind["readings"][peak["reading"]] == {"reading": "reserved"}, i
    assert all(rows[i - 1]["peak_memory"]["unit"] == "GiB" for i in range(60, 64))
    for i in range(38, 42):
        peak = rows[i - 1]["peak_memory"]
        assert peak["unit"] == "GB" and blind["readings"][peak["reading"]] == {"reading": "allocated"}, i


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only (added by the ninth set's rules by a reader who saw
    no prediction of this set); a source nothing dates or places keeps the set's defaults (an empty block)."""
    check_era_blocks(blind, bench.pvb.pvp.WORKLOAD_KEYS, NO_ERA)


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """torchtune at 52d1b838 checkpoints, attends without a mask and runs its chunked-output loss; torchtitan steps
    its fused AdamW by default; a row's stated fused AdamW and the strategy's maskless SDPA still win."""
    for i in (38, 39, 40):
        assert by_row[i]["loss"] == "chunked_output" and by_row[i]["attention"] == "flash", by_row[i]
        assert by_row[i]["grad_ckpt"] == "full", by_row[i]
    assert by_row[38]["fused_adamw"] and "fused_adamw" not in by_row[39]
    for i in (42, 43, 45):
        assert by_row[i]["fused_adamw"] and by_row[i]["grad_ckpt"] == "selective" and by_row[i]["loss"] == "full", i


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    check_mapping(bench, blind, PLANNED, set())
    assert sum(PLANNED.values()) == 6


def test_row_settings_and_tables_reach_the_case(blind, by_row) -> None:
    """What a row and its source state reaches the case: torchtune's full-bf16 fine-tune with torch's fused AdamW,
    bitsandbytes' and torchao's 8-bit AdamW at the set's length; torchtitan's FSDP2 with torch.compile, op-level
    selective checkpointing, its full-logits loss and maskless SDPA, tensor-wise float8, on H100s and MI300Xs."""
    assert by_row[38]["pure_16bit"] and by_row[38]["fused_adamw"] and by_row[38]["optimizer"] == "adamw"
    assert by_row[38]["seq"] == blind["unknown_seq_len"] and by_row[38]["model"] == "meta-llama/Llama-2-7b-hf"
    assert by_row[39]["optimizer"] == "adamw8bit" and by_row[39]["bnb_optimizer"]
    assert by_row[40]["optimizer"] == "adamw8bit" and by_row[40]["torchao_optimizer"]
    assert by_row[38]["reading"] == "allocated" and by_row[38]["gpu"] == "A100"
    for i in (42, 43, 45):
        case = by_row[i]
        assert case["strategy"] == "zero3" and case["compile"] and case["grad_ckpt"] == "selective", i
        assert case["loss"] == "full" and case["attention"] == "flash" and case["reading"] == "reserved", i
        assert case["seq"] == 8192 and case["model"] == "meta-llama/Meta-Llama-3-8B", i
    assert by_row[43]["float8"] and not by_row[42].get("float8") and by_row[45]["gpu"] == "8xMI300X"


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """llm.q's engine, float8 recipes other than tensor-wise, float8 on the MI300X, power-limited B200s, a 4-bit
    AdamW, GaLore, LOMO and a reading that is not a peak are not planned, with their reasons, though the columns
    alone would plan some of them or fail on a string no table maps."""
    assert all("llm.q" in by_row[i] for i in LLMQ_ROWS)
    assert all("power-limited" in by_row[i] for i in range(49, 54))
    assert "row-wise float8" in by_row[44] and all("MI300X" in by_row[i] for i in (46, 47, 48))
    assert "4-bit AdamW" in by_row[41] and "GaLore" in by_row[36] and "LOMO" in by_row[172]
    assert all("not a peak" in by_row[i] for i in range(175, 182))
    without = {**blind, "row_reasons": {}}
    assert bench.settings_of(49, blind["rows"][48], without)["reading"] == "reserved"
    with pytest.raises(KeyError):
        bench.settings_of(44, blind["rows"][43], without)
    # A model missing from the catalog is the reason given first, before its engine's (InternEvo) or its method's.
    assert "catalog" in by_row[106] and by_row[129].startswith("InternLM 7B") and "own engine" not in by_row[129]
    assert by_row[167].startswith("the first ChatGLM-6B") and "P-Tuning" in by_row[167]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess; an `unknown` attention is the set's default and leaves the row's reading as mapped (row
    42 reads `reserved`: no planned row of this set reads `total`)."""
    check_unmapped_strings_raise(bench, blind, 42, "nvml", mapped_reading="reserved")


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind7.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind7.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
