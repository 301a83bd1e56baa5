"""Threads per process (parallel/threads.py): from the affinity, the cgroup quota, the ranks per node and the load;
the user's OMP_NUM_THREADS always wins."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from shardfit.parallel import threads
from shardfit.parallel.threads import CpuBudget, choose

NO_ENV: dict[str, str] = {}


def test_all_the_cores_of_a_quiet_machine() -> None:
    c = choose(CpuBudget(8, None, 0.2), 1, NO_ENV)
    assert (c.threads, c.source, c.passive, c.busy) == (8, "shardfit", True, None)
    assert c.why == "8 CPU(s) in this process's affinity"


def test_affinity_and_quota_bound_the_cores() -> None:
    """taskset/cpuset limit the CPUs; a cgroup quota (docker --cpus 2.5) limits them further, rounded down."""
    assert choose(CpuBudget(4, None, 0.0), 1, NO_ENV).threads == 4
    c = choose(CpuBudget(16, 2.5, 0.0), 1, NO_ENV)
    assert c.threads == 2 and "a cgroup quota of 2.5 cores" in c.why
    assert choose(CpuBudget(16, 0.5, 0.0), 1, NO_ENV).threads == 1  # under one core: still one thread
    assert choose(CpuBudget(2, 8.0, 0.0), 1, NO_ENV).threads == 2  # a quota above the affinity changes nothing


def test_ranks_share_the_cores() -> None:
    assert choose(CpuBudget(16, None, 0.0), 4, NO_ENV).threads == 4
    assert choose(CpuBudget(2, None, 0.0), 2, NO_ENV).threads == 1
    c = choose(CpuBudget(2, None, 0.0), 8, NO_ENV)  # more ranks than cores: one each, never zero
    assert c.threads == 1 and not c.passive and "8 ranks on the node" in c.why


def test_the_load_of_other_processes_takes_cores() -> None:
    """The case of issue 49: a 2-core machine with another job on it (load 1.4) gets one thread, not two."""
    c = choose(CpuBudget(2, None, 1.4), 1, NO_ENV)
    assert c.threads == 1 and "1.4 cores busy with other work" in c.why and c.busy is None
    assert choose(CpuBudget(16, None, 6.0), 1, NO_ENV).threads == 10
    assert choose(CpuBudget(16, None, 6.0), 2, NO_ENV).threads == 5
    assert choose(CpuBudget(2, None, None), 1, NO_ENV).threads == 2  # no load average (not Linux): the cores


def test_other_load_from_the_load_average_and_the_running_count(tmp_path: Path) -> None:
    """The smaller of the lagging average and the snapshot (a run that just ended is not load); a share of the
    machine (taskset, a container) sees its share of the load."""
    assert threads.other_load(1.0, 0, 2, 2) == 0.0  # the previous run ended seconds ago
    assert threads.other_load(1.2, 1, 2, 2) == 1.0  # a busy loop that has run for a while
    assert threads.other_load(40.0, 50, 4, 64) == 2.5  # 4 of a 64-CPU host's cores
    assert threads.other_load(None, 3, 2, 2) == 3 and threads.other_load(None, None, 2, 2) is None
    f = tmp_path / "loadavg"
    f.write_text("1.35 1.40 1.40 3/512 4242\n")
    assert threads.runnable_now(f, samples=2) == 2  # this process is one of the three running
    assert threads.runnable_now(tmp_path / "absent") is None


def test_an_oversubscribed_machine_is_said() -> None:
    c = choose(CpuBudget(2, None, 7.5), 1, NO_ENV)
    assert c.threads == 1 and c.busy is not None and "keep 7.5 cores busy of the 2 this process may use" in c.busy
    assert choose(CpuBudget(2, None, 2.9), 1, NO_ENV).busy is None  # busy, but not well above the cores


def test_the_users_threads_win() -> None:
    """OMP_NUM_THREADS set by the user is kept even on an oversubscribed machine (which is still said); one set by
    a shardfit parent is kept as the parent's."""
    c = choose(CpuBudget(2, None, 9.0), 1, {"OMP_NUM_THREADS": "6"})
    assert (c.threads, c.source, c.passive) == (6, "user", False) and c.busy is not None
    assert choose(CpuBudget(2, None, 0.0), 1, {"OMP_NUM_THREADS": "3,2"}).threads == 3  # OpenMP's nested list
    assert choose(CpuBudget(4, None, 0.0), 1, {"OMP_NUM_THREADS": "junk"}).source == "shardfit"
    c = choose(CpuBudget(8, None, 0.0), 1, {"OMP_NUM_THREADS": "2", threads.OMP_DEFAULTED: "1"})
    assert (c.threads, c.source) == (2, "parent")


def test_child_env_keeps_the_users_settings() -> None:
    mine = choose(CpuBudget(4, None, 0.0), 1, NO_ENV)
    env = threads.child_env(mine, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert env["OMP_NUM_THREADS"] == "4" and env["OMP_WAIT_POLICY"] == "ACTIVE" and env[threads.OMP_DEFAULTED] == "1"
    users = choose(CpuBudget(4, None, 0.0), 1, {"OMP_NUM_THREADS": "2"})
    assert threads.child_env(users, {"OMP_NUM_THREADS": "2"}) == {"OMP_NUM_THREADS": "2"}
    assert threads.thread_reason(env) == "from 4 CPU(s) in this process's affinity"
    assert threads.thread_reason({"OMP_NUM_THREADS": "2"}) == "OMP_NUM_THREADS"


def test_cgroup_quota_file(tmp_path: Path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert threads.read_cpu_quota(f) == 1.5
    f.write_text("max 100000\n")
    assert threads.read_cpu_quota(f) is None
    assert threads.read_cpu_quota(tmp_path / "absent") is None
    f.write_text("garbage")
    assert threads.read_cpu_quota(f) is None


def test_ranks_per_node_from_the_launcher() -> None:
    assert threads.ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert threads.ranks_per_node({}) == 1


def test_configure_applies_and_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(threads, "cpu_budget", lambda: CpuBudget(2, None, 8.0))
    for name in ("OMP_NUM_THREADS", threads.OMP_DEFAULTED, threads.OMP_REASON, "OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="shardfit"):
            c = threads.configure()
            threads.configure()  # a child, or a second call: the first choice stands, said once
        assert c.threads == 1 and os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
        busy = [r for r in caplog.records if "oversubscribed" in r.getMessage()]
        assert len(busy) == 1 and "OMP_NUM_THREADS overrides" in busy[0].getMessage()
    finally:
        torch.set_num_threads(before)
