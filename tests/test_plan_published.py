"""bench/plan_vs_published.py and bench/published_memory.yaml: the structure of the published cases, the fixed
dev/test split, and that every case is predicted. Accuracy is reported by the script, not asserted here."""


from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import yaml

PATH = Path(__file__).resolve().parent.parent / "bench" / "plan_vs_published.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("plan_vs_published", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_is_sha256_parity_of_the_source_name() -> None:
    """A source is dev when the first hex digit of sha256(name) is even: the rule fixed before any error."""
    mod = load_bench()
    for name in ("unsloth-context", "qwen1-profiling", "torchtitan-fsdp", "x", "y"):
        digit = int(hashlib.sha256(name.encode()).hexdigest()[0], 16)
        assert mod.part(name) == ("dev" if digit % 2 == 0 else "test")


def test_published_cases_are_complete() -> None:
    """Every source names its URL and family; every case has what its kind needs; every key is either read by
    the comparison, a Workload field, or recorded as not modelled; each part has several families."""
    mod = load_bench()
    data = yaml.safe_load(mod.CASES.read_text())
    allowed = mod.CASE_KEYS | mod.WORKLOAD_KEYS | mod.RECORDED_ONLY
    families: dict[str, set[str]] = {"dev": set(), "test": set()}
    total = 0
    for name, src in data["sources"].items():
        assert "https://" in src["text"] and src["family"], name
        families[mod.part(name)].add(src["family"])
        for case in src["cases"]:
            c = {**src["defaults"], **case}
            assert set(c) <= allowed, (name, set(c) - allowed)
            assert c["kind"] in ("measured", "max_context", "oom") and "model" in c and "gpu" in c
            if c["kind"] == "measured":
                assert c["peak"] > 0 and c["unit"] in mod.UNITS
            total += 1
    assert total >= 70
    assert len(families["dev"]) >= 3 and len(families["test"]) >= 3


def test_every_case_is_predicted_and_summarised() -> None:
    """The script predicts every case (the planner says OOM where nothing ran) and summarises each part per
    family."""
    mod = load_bench()
    data = yaml.safe_load(mod.CASES.read_text())
    result = mod.evaluate(data)
    assert len(result["cases"]) == sum(len(src["cases"]) for src in data["sources"].values())
    for row in result["cases"]:
        assert row["predicted_total_gib"] > 0 and isinstance(row["verdict_right"], bool)
        assert ("error" in row) == (row["kind"] != "oom")
    assert all(row["verdict_right"] for row in result["cases"] if row["kind"] == "oom")
    for part in ("dev", "test"):
        summary = result["parts"][part]
        assert summary["verdicts"] == sum(f["verdicts"] for f in summary["families"].values())
