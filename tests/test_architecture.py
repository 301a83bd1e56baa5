"""The shape of the code: no import cycles between subpackages, torch-free start-up for plan and diagnose, one
strategy table read by the config."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit import strategy
from shardfit.config.schema import CHOICES
from tests.helpers import ROOT


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles_between_subpackages() -> None:
    ig = _import_graph()
    graph = ig.graph()
    assert {"plan", "models", "parallel", "check", "train", "simulate"} <= set(graph)
    assert ig.cycles(graph) == []
    # The flow runs one way: the planner never reaches into the stages after it.
    assert not graph["plan"] & {"models", "parallel", "check", "train", "simulate", "data"}
    assert "simulate" not in graph["check"] | graph["train"]  # private torch trackers stay behind --simulate


def test_function_local_imports_of_shardfit_only_in_the_cli() -> None:
    """Lazy imports of shardfit's own modules exist only where a command loads its stage when it runs (so `plan`
    and `diagnose` start without torch); everywhere else imports are at the top."""
    local = [i for i in _import_graph().imports() if i.local and i.target.startswith("shardfit")]
    assert local and all(i.module.startswith("shardfit.cli.") for i in local), local


def test_plan_and_diagnose_start_without_torch() -> None:
    code = ("import sys; import shardfit.cli.main as m; m.build_parser(); "
            "m.main(['plan', '--model', 'meta-llama/Llama-3.1-8B', '--gpus', '8x24GB', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_command_imports_only_its_own_module(tmp_path: Path) -> None:
    """`shardfit diagnose` does not pay for the planner's and the foreign readers' imports that plan/check/convert
    need to build their parsers (cli/main.py COMMANDS)."""
    log = tmp_path / "x.log"
    log.write_text("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    code = (f"import sys; import shardfit.cli.main as m; code = m.main(['diagnose', {str(log)!r}]); "
            "heavy = sorted(n for n in sys.modules if n.startswith(('shardfit.foreign', 'shardfit.plan', "
            "'shardfit.cli.plan_', 'shardfit.cli.check_cmd'))); assert code == 0 and not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [["diagnose", "x.log", "--json"], ["--debug", "plan", "--model", "Qwen/Qwen3-8B"],
                                  ["check", "c.yaml", "--nodes", "2"], ["report", "runs/x"], ["doctor"]])
def test_a_command_parses_as_under_the_full_parser(argv: list[str]) -> None:
    from shardfit.cli.main import build_parser

    lazy, full = vars(build_parser(argv).parse_args(argv)), vars(build_parser().parse_args(argv))
    assert lazy.keys() == full.keys() and all(lazy[k] == full[k] for k in full if k != "func")
    assert lazy["func"].__module__ == full["func"].__module__


@pytest.mark.parametrize("argv", [["-h", "plan"], ["--help", "doctor"], ["--debug", "-h", "diagnose"], ["plan", "-h"],
                                  ["--debug", "report", "--help"], ["--vers", "doctor"], ["plna"]])
def test_help_and_errors_print_as_under_the_full_parser(argv: list[str]) -> None:
    """`shardfit -h plan` prints the top-level help (argparse acts on -h where it meets it): every command's line,
    as the full parser prints it; so do a command's own help and the refusals."""
    import contextlib
    import io

    from shardfit.cli.main import build_parser

    def printed(lazy: bool) -> tuple[str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            build_parser(argv if lazy else None).parse_args(argv)
        return out.getvalue(), err.getvalue()

    assert printed(lazy=True) == printed(lazy=False)


def test_config_strategies_are_the_table() -> None:
    assert CHOICES["strategy"] == ("auto", *strategy.NAMES)
    assert {s.engine for s in strategy.TABLE} <= {"plain", "ddp", "fsdp2", "device_map"}  # parallelize's branches
    assert strategy.SPEED_ORDER[0] == "single" and set(strategy.SPEED_ORDER) == set(strategy.NAMES)


def test_every_package_has_its_line_in_the_architecture_doc() -> None:
    """docs/architecture.md's table names every package and top-level module under src/shardfit, and nothing
    else."""
    src = ROOT / "src" / "shardfit"
    present = {f"{p.name}/" for p in src.iterdir() if p.is_dir() and any(p.glob("*.py"))}  # foreign/ has no __init__
    present |= {p.name for p in src.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    rows = set(re.findall(r"^\| `([\w.]+/?)` \|", (ROOT / "docs" / "architecture.md").read_text(), re.M))
    assert rows - {"package"} == present, {"missing": present - rows, "no such package": rows - present}


# Lines a module of src/shardfit may hold: just above the largest one after plan/estimate.py's activations moved
# to plan/activations.py and plan/timing.py's FLOPs, dispatch, dequantization and traffic to modules of their own.
MAX_LINES = 800


def test_no_module_outgrows_the_size_limit() -> None:
    """A module over MAX_LINES holds more than one job: split it along its seams into modules with one job each
    (as plan/activations.py came out of plan/estimate.py), and update its importers."""
    src = ROOT / "src" / "shardfit"
    sizes = {p.relative_to(src).as_posix(): len(p.read_text().splitlines()) for p in src.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, "; ".join(
        f"src/shardfit/{name} has {n} lines, over the {MAX_LINES} allowed: split it along its seams into modules "
        "with one job each (as plan/activations.py came out of plan/estimate.py)"
        for name, n in sorted(over.items()))
