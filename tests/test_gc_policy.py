"""The process's collector policy: off during start-up, start-up objects out of later collections."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from shardfit.gc_policy import end_of_startup, process_entry


@pytest.fixture(autouse=True)
def _restore_collector():
    yield
    gc.unfreeze()
    gc.enable()


def test_process_entry_runs_main_with_the_collector_off_and_freezes_at_exit() -> None:
    seen: dict[str, bool] = {}

    def main() -> int:
        seen["enabled"] = gc.isenabled()
        return 3

    assert process_entry(main) == 3
    assert seen["enabled"] is False
    assert gc.get_freeze_count() > 0


def test_end_of_startup_turns_the_collector_back_on_for_long_commands() -> None:
    gc.disable()
    end_of_startup()
    assert gc.isenabled()
    assert gc.get_freeze_count() > 0


def test_end_of_startup_leaves_an_in_process_caller_alone() -> None:
    gc.unfreeze()
    end_of_startup()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_the_module_entry_uses_the_policy() -> None:
    code = ("import gc, sys\n"
            "import shardfit.cli.main as m\n"
            "m.main = lambda: print(gc.isenabled()) or 0\n"
            "sys.exit(m.entry())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
