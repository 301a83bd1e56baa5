"""A command whose output is piped into a reader that stops early (`shardfit plan ... | head`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    # stdout's reader closes before the command prints (torch alone takes longer to import than this takes), so
    # its print meets a broken pipe every time: as cat or grep, it stops with 128 + SIGPIPE and says nothing.
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "plan", "--model", "Qwen/Qwen3-8B", "--gpus",
                             "1xH100", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "unexpected" not in err and "Broken pipe" not in err, err


PLAN = ("plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpus", "1x24GB")
BAD = ("plan", "--model", "nope/nope", "--gpus", "1x24GB")  # a user error: exit 2


def _shell(redirect: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m shardfit ARGS REDIRECT` through sh, for redirections subprocess cannot make (a closed stdout)."""
    return subprocess.run(["sh", "-c", f'"$0" -m shardfit "$@" {redirect}', sys.executable, *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("redirect", "args", "says"), [
    (">&-", PLAN, "stdout is closed"), (">&-", ("--version",), "stdout is closed"),
    ("> /dev/full", PLAN, "No space left on device"),
])
def test_output_that_cannot_be_written_fails_with_one_line(redirect: str, args: tuple[str, ...], says: str) -> None:
    """`shardfit plan ... >&-` exited 0 having written nothing (Python drops prints to a closed stdout), and
    `> /dev/full` called itself a bug: the output is lost, so exit 1 with one line on stderr saying why."""
    if redirect.endswith("/dev/full") and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    proc = _shell(redirect, *args)
    assert proc.returncode == 1, proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr and "ignored" not in proc.stderr


@pytest.mark.parametrize(("args", "code"), [(PLAN, 0), (BAD, 2)])
def test_a_closed_stderr_keeps_the_exit_code_and_stdout_clean(args: tuple[str, ...], code: int) -> None:
    """With stderr closed (`2>&-`) a user error's message went to stdout (print's target when sys.stderr is None):
    it is dropped now, the exit code is the run's own, and the output on stdout is the plan alone."""
    proc = _shell("2>&-", *args)
    assert proc.returncode == code and ("error" not in proc.stdout) and bool(proc.stdout) == (code == 0), proc.stdout


@pytest.mark.parametrize(("args", "code"), [(PLAN, 0), (BAD, 2)])
def test_a_stderr_whose_reader_went_away_keeps_the_exit_code(args: tuple[str, ...], code: int) -> None:
    """stderr into a pipe nobody reads any more: a user error's message met a broken pipe in the error handler and
    left as an unhandled exception, exit 1. Messages are dropped now; the run's own code is the exit code."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", *args], stdout=subprocess.PIPE, stderr=write)
    os.close(write)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=120) == code, out
    assert bool(out) == (code == 0) and "Traceback" not in out


def test_diagnose_from_a_closed_stdin_is_a_user_error() -> None:
    """`shardfit diagnose - <&-` called itself a bug (sys.stdin is None then), exit 1: it is the user's input, so
    exit 2 with one line saying to pipe the log in or name the file."""
    proc = _shell("<&-", "diagnose", "-")
    assert proc.returncode == 2, proc.stderr
    assert "stdin" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr and "bug" not in proc.stderr
