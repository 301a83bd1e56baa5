"""What every blind planner set's tests check, written once: the set loads as collected, each row maps onto the
planner's vocabulary or says why not, and the committed results, docs table and README headline are a fresh run's.
The sets' own tests (test_plan_blind*.py, test_plan_moe_blind.py) bind its fixtures (`set_fixtures`) and add what is
particular to each set."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from shardfit.plan.optimizer_kinds import OPTIMIZERS
from shardfit.plan.workload import ATTENTIONS, LORA_TARGETS, QUANT_BACKENDS
from tests.helpers import load_bench

ROOT = Path(__file__).resolve().parent.parent
# The collectors' fields of a row in the third and later sets (the first and MoE sets have fewer or other columns).
ROW_KEYS = {"source_url", "source_text", "model", "method", "lora_rank", "lora_targets", "seq_len", "micro_batch",
            "grad_accum", "grad_ckpt", "gpus", "strategy", "precision", "optimizer", "attention", "peak_memory",
            "tokens_per_s", "fits"}
# ... and the ninth set's, whose collectors also gave each row's date, stated library versions and tool (the era that
# decides its source's `unknown` block); the earlier sets keep ROW_KEYS exactly.
ERA_ROW_KEYS = ROW_KEYS | {"source_date", "versions", "tool"}
STRATEGIES = {"single", "ddp", "zero2", "zero3", "zero3_offload", "model_parallel"}
READINGS = {"total", "reserved", "allocated"}
# The defaults the fourth and later sets plan a row that states nothing with (the earlier sets' own).
UNKNOWN = {"grad_ckpt": "full", "optimizer": "adamw", "precision": "bf16", "micro_batch": 1, "grad_accum": 1,
           "lora_rank": 8, "lora_dropout": 0.0, "loss": "full", "attention": "sdpa", "adapters_16bit": False}


def set_fixtures(script: str) -> tuple[Any, Any, Any, Any]:
    """A blind set's module fixtures, bound by its test module as `bench, blind, fresh, by_row =
    set_fixtures("plan_vs_blind9")`: `bench` is bench/<script>.py loaded, `blind` the set its SET names as read,
    `fresh` bench.evaluate of that set (every row predicted), `by_row` each row number's case or reason as
    `cases` maps it (no prediction; the sets read through a `settings_of`, the third on). Each is built once per
    module, and only where a test asks for it."""

    @pytest.fixture(scope="module")
    def bench() -> ModuleType:
        return load_bench(script)

    @pytest.fixture(scope="module")
    def blind(bench: ModuleType) -> dict:
        return yaml.safe_load(bench.SET.read_text())

    @pytest.fixture(scope="module")
    def fresh(bench: ModuleType, blind: dict) -> dict:
        return bench.evaluate(blind)

    @pytest.fixture(scope="module")
    def by_row(bench: ModuleType, blind: dict) -> dict:
        return {i: case for i, _, case in cases(bench, blind)}

    return bench, blind, fresh, by_row


def check_rows(blind: dict, pvp: ModuleType, row_keys: set[str], source_of) -> None:  # noqa: ANN001
    """Each row holds exactly the collector's fields and belongs to one source (`source_of` raises otherwise, or
    returns it); a peak has a unit the bench converts and a positive value; the set's defaults are Workload keys."""
    for row in blind["rows"]:
        assert set(row) == row_keys, set(row) ^ row_keys
        source_of(row, blind)
        if row["peak_memory"]:
            assert row["peak_memory"]["unit"] in pvp.UNITS and row["peak_memory"]["value"] > 0
    assert set(blind["unknown"]) <= pvp.WORKLOAD_KEYS


def check_readings_and_defaults(blind: dict, rows: int) -> None:
    """A set of the fourth kind: each peak's reading is in the set's `readings`, each rate a positive tokens/s per
    GPU or in total (or s/it), the defaults are UNKNOWN's, and `row_settings`/`row_reasons` name rows it holds."""
    for row in blind["rows"]:
        if row["peak_memory"]:
            assert row["peak_memory"]["reading"] in blind["readings"]
        rate = row["tokens_per_s"]
        if rate:
            assert rate["value"] > 0 and (rate.get("unit") == "s/it" or rate["per"] in ("gpu", "total"))
    assert blind["unknown"] == UNKNOWN and blind["unknown_qlora"] == {"frozen_fp32": True, "double_quant": True}
    assert blind["unknown_seq_len"] > 0
    assert set(blind["row_settings"]) | set(blind["row_reasons"]) <= set(range(1, rows + 1))


def cases(bench: ModuleType, blind: dict) -> list[tuple[int, str, dict | str]]:
    """(row number, source, case or reason) of every row of a set read through `bench.settings_of`: the mapping
    alone, no prediction."""
    out = []
    for i, row in enumerate(blind["rows"], start=1):
        name = bench.pvb.source_of(row, blind)
        settings = bench.settings_of(i, row, blind)
        case = settings if isinstance(settings, str) else \
            bench.pvb.case_of(row, blind["sources"][name], blind, settings)
        out.append((i, name, case))
    return out


def check_mapping(bench: ModuleType, blind: dict, planned: dict[str, int], case_keys: set[str]) -> None:
    """A planned row resolves to a catalog model (or inline shape), a card the planner parses, one of its
    strategies, Workload keys it accepts (beyond `case_keys`) and a reading it can compare; a row not planned
    carries its reason; the rows planned per source are `planned`, as written before any prediction."""
    pvp = bench.pvb.pvp
    counted: Counter = Counter()
    for i, name, case in cases(bench, blind):
        if isinstance(case, str):
            assert len(case) > 20, (i, case)
            continue
        counted[name] += 1
        shape, hw = pvp.throughput_shape(case), pvp.hardware(case)
        w = pvp.workload(case, case["seq"])
        assert shape.layers > 0 and hw.world >= 1 and w.seq_len == case["seq"] > 0, i
        assert case["strategy"] in STRATEGIES and case.get("reading", "total") in READINGS, (i, case)
        assert w.method in ("full", "lora", "qlora") and w.attention in ATTENTIONS, (i, w)
        assert w.optimizer in OPTIMIZERS and w.quant_backend in QUANT_BACKENDS, (i, w)
        assert w.lora_targets is None or set(w.lora_targets) <= set(LORA_TARGETS), (i, w)
        assert set(case) - {"strategy", "deepspeed", "reading"} - case_keys <= pvp.WORKLOAD_KEYS | pvp.CASE_KEYS
        if "deepspeed" in case:
            assert bench.pvb.ZeroSettings(**case["deepspeed"]).strategy == case["strategy"], (i, case)
    assert dict(counted) == planned


def check_era_blocks(blind: dict, workload_keys: set[str], empty: set[str], planned: dict[str, int] | None = None
                     ) -> None:
    """Each source carries its era's `unknown` block (its date, versions and tool decide it: the ninth set's
    rules), Workload keys only; a block is empty only for the sources named in `empty` (not dated, tool unread, or
    no row planned; their comment says why), and every source of `planned` outside `empty` has keys."""
    for name, src in blind["sources"].items():
        assert isinstance(src.get("unknown"), dict), name
        assert set(src["unknown"]) <= workload_keys, (name, set(src["unknown"]) - workload_keys)
    assert {name for name, src in blind["sources"].items() if not src["unknown"]} == empty
    assert all(blind["sources"][name]["unknown"] for name in planned or {} if name not in empty)


def check_planned_or_reasoned(fresh: dict, rows: int) -> None:
    """No row is dropped: a planned row has a prediction and a verdict (and an error for each published figure it
    compares), a row not planned its reason; the summary's counts add up."""
    assert len(fresh["rows"]) == rows
    for r in fresh["rows"]:
        if r["planned"]:
            assert r["predicted_total_gib"] > 0 and isinstance(r["verdict_right"], bool)
            assert ("error" in r) == ("published_gib" in r)
            assert ("tokens_error" in r) == ("published_tokens_per_s" in r)
        else:
            assert len(r["reason"]) > 20, r
    s = fresh["summary"]
    assert s["planned"] + s["not_planned"] == rows and len(fresh["not_planned"]) == s["not_planned"]


def check_committed(bench: ModuleType, fresh: dict, docs_table, headline=None) -> None:  # noqa: ANN001
    """bench/results/<set>.json is what the script computes now, docs/planning.md shows its table and (where the
    set has one) the README its headline: rerun the bench script and paste both after any change to the planner."""
    fresh_json = json.loads(json.dumps(fresh))
    stored = json.loads(bench.OUT.read_text())
    assert stored["summary"] == fresh_json["summary"]
    assert stored == fresh_json
    assert docs_table(fresh) in (ROOT / "docs" / "planning.md").read_text()
    if headline is not None:
        assert " ".join(headline(fresh).split()) in " ".join((ROOT / "README.md").read_text().split())


def check_unmapped_strings_raise(bench: ModuleType, blind: dict, number: int, reading: str,
                                 mapped_reading: str = "total") -> None:
    """A planned row (`number`, 1-based) whose GPUs, attention or peak reading (`reading`, a name the set does not
    map) its source does not map fails loudly rather than being planned on a guess; `unknown` attention is the
    set's default and leaves the row's peak read as mapped (`mapped_reading`)."""
    row = blind["rows"][number - 1]
    name = bench.pvb.source_of(row, blind)
    with pytest.raises(KeyError):
        bench.pvb.case_of({**row, "gpus": "3xMystery"}, blind["sources"][name], blind)
    with pytest.raises(KeyError):
        bench.settings_of(number, {**row, "attention": "a mystery kernel"}, blind)
    with pytest.raises(KeyError):
        bench.settings_of(number, {**row, "peak_memory": {**row["peak_memory"], "reading": reading}}, blind)
    assert bench.settings_of(number, {**row, "attention": "unknown"}, blind)["reading"] == mapped_reading
