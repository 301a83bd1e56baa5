"""One measured child process: whole-process wall time, peak resident set, and the machine's load when it began.

The peak is the largest VmHWM (a process's own high-water resident set, /proc/PID/status) of any process of the
child's session, read every 50 ms while it runs: under torchrun, the largest rank's or the launcher's. Not wait4's
ru_maxrss: Linux carries that across exec, so every child of this driver (which holds torch and the tokenised
data) would report at least the driver's own resident set.
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
        peaks: dict[int, int] = {}
        try:
            while True:
                session_hwm_kib(proc.pid, peaks)
                pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
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
    return Measured(proc.returncode, wall, max(peaks.values(), default=0) / 2**20, load, tail)


def session_hwm_kib(sid: int, peaks: dict[int, int]) -> None:
    """Update `peaks` (pid -> VmHWM in KiB) with every live process of session `sid`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # after the name: state, ppid, pgrp, session
                continue
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                hwm = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
        except (OSError, ValueError, IndexError):  # the process ended between the listing and the read
            continue
        peaks[int(entry.name)] = max(peaks.get(int(entry.name), 0), hwm)
