"""The blind sets' scripts from the third on share one runner (bench/plan_vs_blind3.py `set_runner`): each passes its
own set and results paths and row reader. Checked with the first set's evaluate and run replaced, so no set is read
and no prediction is made here (tests/test_plan_blind*.py run the sets)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import load_bench


@pytest.mark.parametrize("name", ["plan_vs_blind3", "plan_vs_blind4", "plan_vs_blind5", "plan_vs_blind6",
                                  "plan_vs_blind7", "plan_vs_blind8", "plan_vs_blind9", "plan_vs_blind10"])
def test_each_set_runs_through_the_one_runner_with_its_own_paths(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(name)
    assert bench.pvb is sys.modules["plan_vs_blind"]
    seen: dict[str, tuple] = {}
    monkeypatch.setattr(bench.pvb, "evaluate", lambda spec, path, one_row: seen.setdefault("evaluate",
                                                                                          (spec, path, one_row)))
    monkeypatch.setattr(bench.pvb, "run", lambda argv, title, path, out, evaluate, outputs: seen.setdefault(
        "run", (argv, title, path, out, evaluate)))
    bench.evaluate({"rows": []})
    bench.main(["--check"])
    spec, path, one_row = seen["evaluate"]
    assert spec == {"rows": []} and path == bench.SET and callable(one_row)
    argv, title, path, out, evaluate = seen["run"]
    assert (argv, path, out, evaluate) == (["--check"], bench.SET, bench.OUT, bench.evaluate)
    assert title == bench.__doc__.split("\n\n")[0]
    assert bench.evaluate.__qualname__ == "set_runner.<locals>.evaluate"
    assert bench.evaluate.__module__ in ("plan_vs_blind3", name)
    number = name.removeprefix("plan_vs_blind")  # each script reads its own set and writes its own results
    assert (bench.SET.name, bench.OUT.name) == (f"published_blind{number}.yaml", f"plan_vs_blind{number}.json")
