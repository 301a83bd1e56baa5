"""A command whose output is piped into a reader that stops early (`shardfit plan ... | head`)."""

from __future__ import annotations

import subprocess
import sys


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
