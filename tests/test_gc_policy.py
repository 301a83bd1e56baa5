"""The process's collector policy: off during start-up, start-up objects out of later collections."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

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


def test_end_of_startup_frees_the_cycles_start_up_left_before_freezing() -> None:
    class Node:
        pass

    gc.disable()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle, as a model load can leave one, unreachable once dropped
    alive = weakref.ref(a)
    del a, b
    end_of_startup()
    assert alive() is None


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
