"""bench/published_blind4.yaml and bench/plan_vs_blind4.py: the fourth blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model, a card, a strategy, Workload keys, a reading) or says why not.
Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from shardfit.plan.workload import ATTENTIONS, LORA_TARGETS, OPTIMIZERS, QUANT_BACKENDS
from tests.helpers import load_bench

ROOT = Path(__file__).resolve().parent.parent

ROW_KEYS = {"source_url", "source_text", "model", "method", "lora_rank", "lora_targets", "seq_len", "micro_batch",
            "grad_accum", "grad_ckpt", "gpus", "strategy", "precision", "optimizer", "attention", "peak_memory",
            "tokens_per_s", "fits"}
STRATEGIES = {"single", "ddp", "zero2", "zero3", "zero3_offload", "model_parallel"}
READINGS = {"total", "reserved", "allocated"}
# The defaults every blind set plans a row that states nothing with.
UNKNOWN = {"grad_ckpt": "full", "optimizer": "adamw", "precision": "bf16", "micro_batch": 1, "grad_accum": 1,
           "lora_rank": 8, "lora_dropout": 0.0, "loss": "full", "attention": "sdpa", "adapters_16bit": False}
# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"easycontext": 1, "openr1-readme": 1, "halo-30": 2, "openr1-506": 1, "openr1-446": 1, "soup-378": 4,
           "liger-677": 1, "verl-798": 1, "thunder-1528": 1, "qwen2vl-ft-23": 2, "vectorlm-5": 1,
           "qwen-vl-series-122": 1}


@pytest.fixture(scope="module")
def bench():
    return load_bench("plan_vs_blind4")


@pytest.fixture(scope="module")
def blind(bench) -> dict:
    return yaml.safe_load(bench.SET.read_text())


def cases(bench, blind: dict) -> list[tuple[int, str, dict | str]]:
    """(row number, source, case or reason) of every row: the mapping alone, no prediction."""
    out = []
    for i, row in enumerate(blind["rows"], start=1):
        name = bench.pvb.source_of(row, blind)
        settings = bench.settings_of(i, row, blind)
        case = settings if isinstance(settings, str) else \
            bench.pvb.case_of(row, blind["sources"][name], blind, settings)
        out.append((i, name, case))
    return out


def test_the_set_loads_with_every_row_tied_to_one_source(bench, blind) -> None:
    """107 rows of 38 sources (both collectors' rows; none duplicated or excluded), each row the collector's fields
    and the url of exactly one source; the defaults are the other blind sets'."""
    assert len(blind["rows"]) == 107 and len(blind["sources"]) == 38
    for row in blind["rows"]:
        assert set(row) == ROW_KEYS, set(row) ^ ROW_KEYS
        assert sum(src["url"] == row["source_url"] for src in blind["sources"].values()) == 1
        if row["peak_memory"]:
            assert row["peak_memory"]["unit"] in bench.pvb.pvp.UNITS and row["peak_memory"]["value"] > 0
            assert row["peak_memory"]["reading"] in blind["readings"]
        rate = row["tokens_per_s"]
        if rate:
            assert rate["value"] > 0 and (rate.get("unit") == "s/it" or rate["per"] in ("gpu", "total"))
    assert blind["unknown"] == UNKNOWN and blind["unknown_qlora"] == {"frozen_fp32": True, "double_quant": True}
    assert set(blind["unknown"]) <= bench.pvb.pvp.WORKLOAD_KEYS and blind["unknown_seq_len"] > 0
    assert set(blind["row_settings"]) | set(blind["row_reasons"]) <= set(range(1, 108))
    assert bench.OUT.name == "plan_vs_blind4.json" and bench.SET.name == "published_blind4.yaml"


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model, a card the planner parses, one of its strategies, Workload keys it
    accepts and a reading it can compare; a row not planned carries its reason."""
    pvp = bench.pvb.pvp
    planned: Counter = Counter()
    for i, name, case in cases(bench, blind):
        if isinstance(case, str):
            assert len(case) > 20, (i, case)
            continue
        planned[name] += 1
        shape, hw = pvp.throughput_shape(case), pvp.hardware(case)
        w = pvp.workload(case, case["seq"])
        assert shape.layers > 0 and hw.world >= 1 and w.seq_len == case["seq"] > 0, i
        assert case["strategy"] in STRATEGIES and case.get("reading", "total") in READINGS, (i, case)
        assert w.method in ("full", "lora", "qlora") and w.attention in ATTENTIONS, (i, w)
        assert w.optimizer in OPTIMIZERS and w.quant_backend in QUANT_BACKENDS, (i, w)
        assert w.lora_targets is None or set(w.lora_targets) <= set(LORA_TARGETS), (i, w)
        assert set(case) - {"strategy", "deepspeed", "reading", "assumed"} <= pvp.WORKLOAD_KEYS | pvp.CASE_KEYS
        if "deepspeed" in case:
            ds = bench.pvb.ZeroSettings(**case["deepspeed"])
            assert ds.strategy == case["strategy"], (i, case)
    assert dict(planned) == PLANNED
    assert sum(PLANNED.values()) == 17


def test_row_settings_come_from_what_the_row_states(bench, blind) -> None:
    """What a row's text states beyond its columns reaches the case: a length written "64K", four packed examples
    as one row, Liger's fused loss, torch.compile, a trained vision tower, the peak's reading, a card assumed from
    the source where the row does not restate it."""
    by_row = {i: case for i, _, case in cases(bench, blind)}
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


def test_a_row_reason_keeps_out_a_run_the_planner_does_not_model(bench, blind) -> None:
    """Rows of another training engine or an on-policy objective are not planned, with their reason, though their
    columns alone would plan; the reasons of models, strategies and methods reach the rows they cover."""
    by_row = {i: case for i, _, case in cases(bench, blind)}
    assert "Unsloth" in by_row[1] and "Surogate" in by_row[3] and "GRPO" in by_row[67]
    assert "TransformerEngine" in by_row[85] and "host" in by_row[96]
    without = {**blind, "row_reasons": {}}
    assert isinstance(bench.settings_of(3, blind["rows"][2], without), dict)
    assert "Megatron" in by_row[36] and "catalog" in by_row[25] and "method 'other'" in by_row[42]
    assert "ring" in by_row[17] and "strategy" in by_row[51]


def test_an_unmapped_string_is_an_error_not_a_silent_default(bench, blind) -> None:
    """A planned row whose GPUs, attention or reading its source does not map fails loudly rather than being
    planned on a guess."""
    row = blind["rows"][74]
    name = bench.pvb.source_of(row, blind)
    with pytest.raises(KeyError):
        bench.pvb.case_of({**row, "gpus": "3xMystery"}, blind["sources"][name], blind)
    with pytest.raises(KeyError):
        bench.settings_of(75, {**row, "attention": "a mystery kernel"}, blind)
    with pytest.raises(KeyError):
        bench.settings_of(75, {**row, "peak_memory": {**row["peak_memory"], "reading": "rocm-smi"}}, blind)
    assert bench.settings_of(75, {**row, "attention": "unknown"}, blind)["reading"] == "total"


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind4.json is what the script computes now, docs/planning.md shows its table and the
    README its headline: rerun `python bench/plan_vs_blind4.py` and paste both after any change to the planner."""
    fresh = json.loads(json.dumps(bench.evaluate(blind)))
    assert json.loads(bench.OUT.read_text()) == fresh
    assert bench.pvb.docs_table(fresh) in (ROOT / "docs" / "planning.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(bench.pvb.headline(fresh).split()) in readme
