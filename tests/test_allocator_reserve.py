"""The caching allocator's reserve in a plan: fitted to public OOM messages (bench/allocator_reserve.yaml) by
bench/allocator_reserve.py, and the planner's constant and its plan line held to that fit."""

from __future__ import annotations

import importlib.util
import json

import pytest

from shardfit.cli.main import main
from shardfit.plan.estimate import ALLOCATOR_RESERVE
from tests.helpers import ROOT


def _bench():  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location("allocator_reserve", ROOT / "bench" / "allocator_reserve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
DATA = BENCH.load()
FIT = BENCH.fit(DATA["cases"])
TENSORS = ("weights", "grads", "optimizer", "activations", "logits", "temporaries")


def test_the_data_are_distinct_training_runs_that_fill_their_cards() -> None:
    """60 threads or more, one case each; what PyTorch says it holds fits the card, an old message's reserved total
    is allocated + unallocated, and a failed request exists."""
    cases = DATA["cases"]
    assert len(cases) >= 60 and len({c["url"] for c in cases}) == len(cases)
    for c in cases:
        assert 0 <= c["unallocated_gib"] and 0 < c["allocated_gib"] and 0 < c["request_gib"], c["url"]
        assert c["allocated_gib"] + c["unallocated_gib"] <= c["gpu_gib"], c["url"]
        assert c["torch_message"] in ("old", "new") and c["expandable"] in (None, True, False), c["url"]
        if c["torch_message"] == "old":
            assert c["reserved_gib"] - c["allocated_gib"] == pytest.approx(c["unallocated_gib"], abs=1e-6), c["url"]


def test_the_planners_reserve_is_the_median_of_the_data() -> None:
    """ALLOCATOR_RESERVE is what bench/allocator_reserve.py fits to the YAML, so neither can drift from the other;
    half the cases lie above it."""
    assert ALLOCATOR_RESERVE == FIT
    ratios = [BENCH.reserve_ratio(c) for c in DATA["cases"]]
    assert abs(sum(r > FIT for r in ratios) - sum(r < FIT for r in ratios)) <= 2


def test_the_plan_line_is_the_fit_of_the_tensor_peak(capsys: pytest.CaptureFixture) -> None:
    """Every candidate's `allocator_reserve` in `shardfit plan --json` is the fitted fraction of its tensor peak,
    and the table's legend states that fraction."""
    args = ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpus", "2xH100", "--method", "lora", "--seq", "2048"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for c in plan["candidates"]:
        g = c["per_gpu_gib"]
        tensors = sum(g[k] for k in TENSORS)
        assert g["allocator_reserve"] == pytest.approx(tensors * FIT, rel=1e-3, abs=1e-3), c["strategy"]
        assert g["total"] == pytest.approx(tensors * (1 + FIT) + g["runtime_overhead"], abs=0.01), c["strategy"]
    assert main(args) == 0
    assert f"{100 * FIT:.1f} %" in capsys.readouterr().out
