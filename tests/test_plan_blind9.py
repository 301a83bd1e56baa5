"""bench/published_blind9.yaml and bench/plan_vs_blind9.py: the ninth blind set loads as collected, every row maps
onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not, and
each source's era block (its own `unknown`, decided from its date, versions and tool) reaches its rows' cases without
changing any earlier set's. Nothing here predicts: how accurate the planner is on the set is the bench's
measurement."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.blind_sets import (
    ERA_ROW_KEYS,
    ROW_KEYS,
    cases,
    check_committed,
    check_mapping,
    check_readings_and_defaults,
    check_rows,
    check_unmapped_strings_raise,
    set_fixtures,
)
from tests.helpers import load_bench

# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"bastile-qwen3-8b": 14, "peft-vs-torchtune-lora-single": 2, "peft-vs-torchtune-qlora-single": 2,
           "peft-vs-torchtune-lora-fsdp": 2, "peft-vs-answerai-qlora-fsdp": 2, "optimum-benchmark-llamas-2023-12": 25,
           "optimum-benchmark-llamas-2023-08": 3, "lambda-guide-405b": 1, "lambda-guide-fsdp": 4,
           "juejin-qwen2-rtx4060": 1, "modelscope-ulysses-ring": 2, "arkin-qwen25-notebook": 1}
LIGER_ROWS = range(8, 15)
SGD_ROWS = range(15, 51)
OPTIMUM_ROWS = range(59, 87)


bench, blind, fresh, by_row = set_fixtures("plan_vs_blind9")


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """112 rows of 20 sources (both collectors' rows but the second's copy of fms-fsdp's table), each row the
    collector's fields with its date, versions and tool, and the url of exactly one source; the defaults are the
    other blind sets'."""
    assert len(blind["rows"]) == 112 and len(blind["sources"]) == 20
    check_rows(blind, bench.pvb.pvp, ERA_ROW_KEYS, bench.pvb.source_of)
    assert ERA_ROW_KEYS - ROW_KEYS == {"source_date", "versions", "tool"}
    as_text = [json.dumps(row, sort_keys=True) for row in blind["rows"]]
    assert len(set(as_text)) == len(as_text)
    assert sum("fms-fsdp" in row["source_url"] for row in blind["rows"]) == 3
    check_readings_and_defaults(blind, 112)
    assert bench.OUT.name == "plan_vs_blind9.json" and bench.SET.name == "published_blind9.yaml"


def test_a_speed_the_collector_derived_from_samples_is_not_kept(blind) -> None:
    """optimum-benchmark published samples/s; the collector's tokens/s (x 256) is left out, as the earlier sets left
    such products out, and the published figure stays in the quote."""
    for i in OPTIMUM_ROWS:
        row = blind["rows"][i - 1]
        assert row["tokens_per_s"] is None and "samples/s" in row["source_text"], i


def test_every_source_has_an_era_block_of_workload_keys(bench, blind) -> None:
    """Each source carries its own `unknown`, Workload keys only; a source with no date, versions or tool keeps the
    set's defaults (an empty block)."""
    keys = bench.pvb.pvp.WORKLOAD_KEYS
    for name, src in blind["sources"].items():
        assert isinstance(src.get("unknown"), dict), name
        assert set(src["unknown"]) <= keys, (name, set(src["unknown"]) - keys)
    empty = [name for name, src in blind["sources"].items() if not src["unknown"]]
    assert empty == ["hpc-tech-rtx-pro-6000"]


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare (an unnamed card's `assumed` note aside); a row not planned carries its
    reason."""
    check_mapping(bench, blind, PLANNED, {"assumed"})
    assert sum(PLANNED.values()) == 59


def test_the_era_reaches_the_case_below_what_the_row_states(by_row) -> None:
    """optimum-benchmark's December 2023 sweep under transformers 4.35 attends eagerly, its fp16 LoRA adapters are
    16-bit (peft 0.6-0.11) but its 4-bit QLoRA's stay fp32, without double quantization or fp32 frozen layers;
    ms-swift's September 2025 run checkpoints (its default) and steps the fused AdamW (transformers >= 4.54), with the
    flash attention its row names; a stated fused AdamW and a stated kernel win over their era's default."""
    lora, qlora, full = by_row[59], by_row[64], by_row[69]
    assert lora["attention"] == "eager" and lora["adapters_16bit"] and lora["pure_16bit"], lora
    assert lora["grad_ckpt"] == "none" and lora["fused_adamw"] is False and lora["lora_targets"] == ["q", "v"]
    assert qlora["quant_backend"] == "bnb" and not qlora["adapters_16bit"] and not qlora["double_quant"], qlora
    assert not qlora["frozen_fp32"] and qlora["precision"] == "fp16"
    assert full["method"] == "full" and full["precision"] == "fp16" and full["seq"] == 256
    swift = by_row[102]
    assert swift["grad_ckpt"] == "full" and swift["fused_adamw"] and swift["attention"] == "flash", swift
    assert swift["strategy"] == "ddp" and by_row[101]["sequence_parallel"] == 2
    assert by_row[87]["fused_adamw"] and by_row[87]["nodes"] == 8 and by_row[87]["strategy"] == "zero3_offload"
    assert by_row[110]["precision"] == "fp32" and by_row[110]["attention"] == "sdpa" and by_row[110]["lora_rank"] == 4
    assert by_row[96]["grad_ckpt"] == "full" and by_row[96]["assumed"] and by_row[96]["quant_backend"] == "bnb"


def test_row_settings_and_tables_reach_the_case(by_row) -> None:
    """Liger's fused cross-entropy, torchtune's default length, fsdp_qlora's kept logits and the Lambda guide's
    length cap reach their rows; the PEFT notebooks' bf16 adapters and torchtune's pure bf16 come from the rows'
    precisions."""
    assert all(by_row[i]["loss"] == "chunked" for i in LIGER_ROWS) and by_row[1]["loss"] == "full"
    assert by_row[1]["model"] == "Qwen/Qwen3-8B" and by_row[1]["reading"] == "allocated" and by_row[1]["pure_16bit"]
    assert by_row[51]["seq"] == 512 and by_row[51]["adapters_16bit"] and by_row[51]["reading"] == "reserved"
    assert all(by_row[i]["seq"] == 512 for i in (52, 54, 56)) and by_row[52]["grad_ckpt"] == "full"
    assert by_row[54]["quant_backend"] == "torchao" and not by_row[54]["frozen_fp32"]
    assert by_row[55]["fsdp1"] and by_row[55]["strategy"] == "zero3" and by_row[56].get("fsdp1") is None
    assert all(by_row[i]["keeps_logits"] and by_row[i]["strategy"] == "zero3_offload" for i in (57, 58))
    assert all(by_row[i]["seq"] == 1024 for i in range(89, 93))
    assert all(by_row[i]["reading"] == "allocated" for i in range(89, 92)) and "reading" not in by_row[92]
    assert by_row[92]["strategy"] == "zero3" and by_row[91]["model"] == "meta-llama/Llama-2-70b-hf"


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind, by_row) -> None:
    """SGD, FMS's own pretraining, tensor parallelism, ring attention, Unsloth and the rows that state too little are
    not planned, with their reasons, though the columns alone would plan some of them."""
    assert all("SGD" in by_row[i] for i in SGD_ROWS)
    assert all("FMS" in by_row[i] for i in (93, 94, 95)) and "tensor parallelism" in by_row[88]
    assert all("ring attention" in by_row[i] for i in (99, 100)) and "Unsloth" in by_row[112]
    assert all("GPUs are not stated" in by_row[i] for i in (97, 98)) and "card table" in by_row[111]
    assert all("no strategy" in by_row[i] for i in range(106, 110)) and "wall time" in by_row[103]
    without = {**blind, "row_reasons": {}}
    with pytest.raises(ValueError, match="SGD"):
        bench.settings_of(15, blind["rows"][14], without)
    for i in (93, 103, 112):
        with pytest.raises(KeyError):
            bench.settings_of(i, blind["rows"][i - 1], without)


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess; an `unknown` attention is the era's default and leaves the row's reading as mapped."""
    check_unmapped_strings_raise(bench, blind, 1, "nvml", "allocated")


def test_an_era_block_changes_no_dev_set_and_sits_below_the_row(bench) -> None:
    """No source of the dev sets (the first and third) has an era block, so their cases are as before it existed
    (built with an empty block on every source they are the same); a block given to every source of the third set
    takes each row's unstated key and leaves a stated one to the row."""
    pvb = bench.pvb
    specs = {n: yaml.safe_load((pvb.BENCH / f"published_blind{n}.yaml").read_text()) for n in ("", 3)}
    assert not [n for n, spec in specs.items() for src in spec["sources"].values() if "unknown" in src]
    first = specs[""]

    def first_cases(spec: dict) -> list:
        return [pvb.case_of(r, spec["sources"][pvb.source_of(r, spec)], spec) for r in spec["rows"]]

    empty = copy.deepcopy(first)
    for src in empty["sources"].values():
        src["unknown"] = {}
    assert first_cases(empty) == first_cases(first)
    third = load_bench("plan_vs_blind3")
    spec = specs[3]
    era = copy.deepcopy(spec)
    for src in era["sources"].values():
        src["unknown"] = {"grad_accum": 7}
    before, after = cases(third, spec), cases(third, era)
    assert cases(third, {**spec, "sources": {k: {**v, "unknown": {}} for k, v in spec["sources"].items()}}) == before
    changed = 0
    for (i, _, old), (_, _, new) in zip(before, after, strict=True):
        if isinstance(old, str):
            assert new == old, i
            continue
        row = spec["rows"][i - 1]
        stated = pvb.known(row["grad_accum"]) or "grad_accum" in spec.get("row_settings", {}).get(i, {})
        assert new == ({**old} if stated else {**old, "grad_accum": 7}), i
        changed += not stated
    assert changed > 0


def test_an_era_block_sits_above_the_qlora_defaults(bench) -> None:
    """A source's era block is applied after the set's QLoRA defaults (`unknown_qlora`): on the third set (dev data),
    a block saying `double_quant: false` turns off the double quantization a QLoRA row leaves unstated, and changes
    no other key of any row."""
    pvb, third = bench.pvb, load_bench("plan_vs_blind3")
    spec = yaml.safe_load((pvb.BENCH / "published_blind3.yaml").read_text())
    era = copy.deepcopy(spec)
    for src in era["sources"].values():
        src["unknown"] = {"double_quant": False}
    flipped = 0
    for (i, _, old), (_, _, new) in zip(cases(third, spec), cases(third, era), strict=True):
        if isinstance(old, str):
            continue
        assert {k: v for k, v in new.items() if k != "double_quant"} == \
            {k: v for k, v in old.items() if k != "double_quant"}, i
        flipped += old.get("double_quant") is True and new["double_quant"] is False
    assert flipped > 0


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind9.json is what the script computes now and docs/planning.md shows its table (the
    README states the pooled line, test_plan_blind_pooled.py): rerun `python bench/plan_vs_blind9.py` and
    `bench/plan_vs_blind_pooled.py` and paste both after any change to the planner."""
    check_committed(bench, bench.evaluate(blind), bench.pvb.docs_table)
