"""One measured child process: whole-process wall time, peak resident set, and the machine's load when it began.

The peak comes from the kernel's own account (wait4's ru_maxrss): the largest resident set of the child or of any
process it waited for, so under torchrun it is the largest rank's (or the launcher's) peak, with no sampling gap.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Measured:
    """What one child process cost."""

    returncode: int
    wall_s: float
    peak_rss_gib: float
    load_avg_1m: float
    output_tail: str


def run_measured(cmd: list[str], env: dict[str, str], timeout_s: float = 1800.0) -> Measured:
    """Run `cmd` to completion (killed after `timeout_s`), its output kept in a file, not a pipe (a full pipe
    would stall the child and count as its time)."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile(mode="w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + timeout_s
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    os.killpg(proc.pid, 9)
                time.sleep(0.05)
        except BaseException:  # the bench stopped (Ctrl-C): its own session would outlive it otherwise
            os.killpg(proc.pid, 9)
            raise
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read()[-4000:]
    return Measured(proc.returncode, wall, usage.ru_maxrss / 2**20, load, tail)
