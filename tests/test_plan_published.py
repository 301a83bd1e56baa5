"""bench/plan_vs_published.py: the planner against published peak-memory measurements."""


from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml


def test_published_measurements_script_verdicts() -> None:
    """bench/plan_vs_published.py reads every published case of every source; the planner says OOM where nothing
    ran; where a run just fit its card it predicts that peak within 5%; reported peaks within 20% (Qwen-1.8B's
    short rows sit 15-18% under, unexplained); the median error over all cases within 10% (the issue's target) and
    of each source within 15% (torchtitan's FSDP runs sit 8-12% under their reserved memory)."""

    path = Path(__file__).resolve().parent.parent / "bench" / "plan_vs_published.py"
    spec = importlib.util.spec_from_file_location("plan_vs_published", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = yaml.safe_load(mod.CASES.read_text())
    result = mod.evaluate(data)
    assert len(data["sources"]) >= 2
    assert len(result["cases"]) == sum(len(src["cases"]) for src in data["sources"].values()) >= 20
    for row in result["cases"]:
        assert row["source"] in data["sources"] and row["predicted_total_gib"] > 0
    assert all(row["verdict_right"] for row in result["cases"] if row["kind"] == "oom")
    assert all(abs(row["error"]) < 0.05 for row in result["cases"] if row["kind"] == "max_context")
    assert all(abs(row["error"]) < 0.20 for row in result["cases"] if row["kind"] == "measured")
    assert all(s["median_abs_error"] < 0.15 for s in result["sources"].values())
    assert result["median_abs_error"] < 0.10
    reserved = [row for row in result["cases"] if row.get("reading") == "reserved"]
    assert reserved and all(row["verdict_right"] for row in reserved)
