"""bench/published_blind3.yaml and bench/plan_vs_blind3.py: the third blind set loads as collected, and every row
maps onto the planner's vocabulary (a catalog model or inline shape, a card, a strategy, Workload keys, a reading)
or says why not. Nothing here predicts: how accurate the planner is on the set is the bench's measurement."""

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
# The mapping as written before any prediction: rows planned per source (the rest say why not).
PLANNED = {"fms-accel-a100": 10, "glm4-finetune-demo": 2, "glm4-finetune": 2, "llama-recipes-pr41": 3,
           "llama-recipes-issue100": 1, "llama-recipes-issue120": 2, "fms-accel-moe": 2, "hf-blog-fsdp70b": 1,
           "philschmid-fsdp-qlora-llama3": 1, "alpaca-280": 2, "platypus-10": 2}


@pytest.fixture(scope="module")
def bench():
    return load_bench("plan_vs_blind3")


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
    """53 rows of 19 sources, each row the collector's fields and the url of exactly one source; the defaults are
    the first blind set's."""
    assert len(blind["rows"]) == 53 and len(blind["sources"]) == 19
    for row in blind["rows"]:
        assert set(row) == ROW_KEYS, set(row) ^ ROW_KEYS
        assert sum(src["url"] == row["source_url"] for src in blind["sources"].values()) == 1
        if row["peak_memory"]:
            assert row["peak_memory"]["unit"] in bench.pvb.pvp.UNITS and row["peak_memory"]["value"] > 0
    first = yaml.safe_load((ROOT / "bench" / "published_blind.yaml").read_text())
    assert blind["unknown"] == first["unknown"] and blind["unknown_qlora"] == first["unknown_qlora"]
    assert set(blind["unknown"]) <= bench.pvb.pvp.WORKLOAD_KEYS and blind["unknown_seq_len"] > 0
    assert bench.OUT.name == "plan_vs_blind3.json"


def test_every_row_maps_onto_the_planner_or_says_why_not(bench, blind) -> None:
    """A planned row resolves to a catalog model or an inline shape, a card the planner parses, one of its
    strategies, Workload keys it accepts and a reading it can compare; a row not planned carries its reason."""
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
        assert set(case) - {"strategy", "deepspeed", "reading"} <= pvp.WORKLOAD_KEYS | pvp.CASE_KEYS | {"shape"}
        if "deepspeed" in case:
            ds = bench.pvb.ZeroSettings(**case["deepspeed"])
            assert ds.strategy == case["strategy"], (i, case)
    assert dict(planned) == PLANNED
    assert sum(PLANNED.values()) == 28


def test_row_settings_come_from_what_the_row_states(bench, blind) -> None:
    """The columns beyond the first set's reach the case: flash attention, named targets, a reserved reading, the
    logits kept alive before llama-recipes' fix, and a length the row leaves unknown."""
    by_row = {i: case for i, _, case in cases(bench, blind)}
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
    row = blind["rows"][0]
    name = bench.pvb.source_of(row, blind)
    with pytest.raises(KeyError):
        bench.pvb.case_of({**row, "gpus": "3xMystery"}, blind["sources"][name], blind)
    with pytest.raises(KeyError):
        bench.settings_of(1, {**row, "attention": "a mystery kernel"}, blind)
    with pytest.raises(KeyError):
        bench.settings_of(1, {**row, "peak_memory": {**row["peak_memory"], "reading": "rocm-smi"}}, blind)
    assert bench.settings_of(1, {**row, "attention": "unknown"}, blind)["reading"] == "total"


def test_committed_results_and_docs_match_a_fresh_run(bench, blind) -> None:
    """bench/results/plan_vs_blind3.json is what the script computes now, docs/planning.md shows its table and the
    README its headline: rerun `python bench/plan_vs_blind3.py` and paste both after any change to the planner."""
    fresh = json.loads(json.dumps(bench.evaluate(blind)))
    assert json.loads(bench.OUT.read_text()) == fresh
    assert bench.pvb.docs_table(fresh) in (ROOT / "docs" / "planning.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(bench.pvb.headline(fresh).split()) in readme
