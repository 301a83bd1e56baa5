"""How many intra-op (OpenMP) threads a process computes with, decided once from the cores it may use.

PyTorch's default is one thread per CPU the process may run on. On a machine whose cores are shared (a laptop, a
CI runner, several ranks, another job) those threads wait for each other at every parallel op, and a thread that
is not scheduled holds all the others: a step took 10x as long with two threads on a busy 2-core machine as with
one (docs/benchmarks.md, Threads). So the count comes from the cores this process may really use: its CPU
affinity, the cgroup's CPU quota, the ranks that share the node, and the cores the machine's load already takes.
The user's own OMP_NUM_THREADS always wins.

Torch-free: `choose` is a pure function of what `cpu_budget` reads; `apply` sets the environment (read by child
ranks, and by OpenMP when torch loads) and, if torch is already loaded, `torch.set_num_threads`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("shardfit")

# Set beside OMP_NUM_THREADS when shardfit chose the value (not the user): a child (a re-executed process, a rank
# that finds a GPU) may then change it, which it never does to a user's value.
OMP_DEFAULTED = "SHARDFIT_OMP_DEFAULTED"
# Why shardfit chose the count (its own choice only), for the run's start line; set beside OMP_DEFAULTED.
OMP_REASON = "SHARDFIT_OMP_REASON"
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
LOADAVG = Path("/proc/loadavg")
# Load average above this many times the usable cores: the machine is oversubscribed, said in one warning.
BUSY_FACTOR = 1.5
# Waiting OpenMP threads sleep instead of spinning when the process runs several threads: a spinning thread takes
# the core the thread it waits for needs (2.0x the steps per second with two threads on a busy machine, and no
# measurable loss on an idle one: docs/benchmarks.md, Threads).
WAIT_POLICY = "PASSIVE"


@dataclass(frozen=True)
class CpuBudget:
    """What bounds this process's CPU use: the CPUs it may run on (affinity), the cgroup's quota in cores (None:
    no quota) and the work of other processes on them (`load`, in cores; None: unknown)."""

    cpus: int
    quota: float | None = None
    load: float | None = None

    @property
    def cores(self) -> int:
        """Cores this process may use: the affinity, bounded by the quota (a quota of 1.5 cores allows 1 thread
        without stalls; at least 1)."""
        n = self.cpus if self.quota is None else min(self.cpus, math.floor(self.quota))
        return max(1, n)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads per process and why; `busy` is the one-line warning for an oversubscribed machine (or None)."""

    threads: int
    source: str  # "user": OMP_NUM_THREADS was set; "shardfit": chosen here; "parent": chosen by a shardfit parent
    why: str
    passive: bool = False  # OMP_WAIT_POLICY=PASSIVE for this process (never over the user's own setting)
    busy: str | None = None


def read_cpu_quota(path: Path = CPU_MAX) -> float | None:
    """The cgroup v2 CPU quota in cores (`cpu.max`: "QUOTA PERIOD", or "max PERIOD" for none); None without one."""
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def runnable_now(path: Path = LOADAVG, samples: int = 5) -> int | None:
    """Processes runnable right now besides this one (/proc/loadavg's running count, the median of a few reads
    10 ms apart), or None where the file is not there."""
    counts = []
    for i in range(samples):
        try:
            counts.append(int(path.read_text().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        if i < samples - 1:
            time.sleep(0.01)
    return max(0, sorted(counts)[len(counts) // 2])


def other_load(load_1m: float | None, runnable: int | None, cores: int, online: int) -> float | None:
    """The cores other processes keep busy on this process's share of the machine. The 1-minute load average lags
    (a run that ended seconds ago still counts as a whole core), the running count is a snapshot: the smaller of
    the two. Both are the whole machine's; where this process may use only `cores` of `online` CPUs (a container,
    taskset), its share of them."""
    seen = [x for x in (load_1m, runnable) if x is not None]
    if not seen:
        return None
    return min(seen) * min(1.0, cores / max(online, 1))


def cpu_budget() -> CpuBudget:
    """This process's CPU budget, read now."""
    online = os.cpu_count() or 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = online
    try:
        load_1m: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load_1m = None
    quota = read_cpu_quota()
    cores = CpuBudget(cpus, quota).cores
    return CpuBudget(cpus, quota, other_load(load_1m, runnable_now(), cores, online))


def _user_threads(env: Mapping[str, str]) -> int | None:
    """The user's OMP_NUM_THREADS (its first number: OpenMP also takes a list per nesting level), or None."""
    value = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def choose(budget: CpuBudget, ranks_per_node: int = 1, env: Mapping[str, str] | None = None) -> ThreadChoice:
    """Threads for each of `ranks_per_node` processes: the usable cores shared between the ranks, fewer where
    other processes already keep some busy (rounded, at least one). OMP_NUM_THREADS set by the user
    wins; one set by a shardfit parent (OMP_DEFAULTED) is kept."""
    env = os.environ if env is None else env
    ranks = max(1, ranks_per_node)
    cores = budget.cores
    busy = None
    if budget.load is not None and budget.load > BUSY_FACTOR * cores:
        busy = (f"this machine is oversubscribed: other processes keep {budget.load:.1f} cores busy of the {cores} "
                "this process may use; training and generation run several times slower than on a quiet machine "
                "(the plan's times assume one)")
    given = _user_threads(env)
    if given is not None:
        source = "parent" if env.get(OMP_DEFAULTED) == "1" else "user"
        return ThreadChoice(given, source, "OMP_NUM_THREADS", passive=False, busy=busy)
    share = max(1, cores // ranks)
    idle = cores - (budget.load or 0.0)  # the load is read before this process computes: others' work
    threads = max(1, min(share, round(idle / ranks)))
    parts = [f"{budget.cpus} CPU(s) in this process's affinity"]
    if budget.quota is not None:
        parts.append(f"a cgroup quota of {budget.quota:g} cores")
    if ranks > 1:
        parts.append(f"{ranks} ranks on the node")
    if threads < share:
        parts.append(f"{budget.load:.1f} cores busy with other work")
    return ThreadChoice(threads, "shardfit", ", ".join(parts), passive=threads > 1, busy=busy)


def child_env(choice: ThreadChoice, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the choice in it, as a child process or rank starts with it (the user's settings untouched)."""
    out = dict(env)
    if choice.source == "shardfit":
        out.update({"OMP_NUM_THREADS": str(choice.threads), OMP_DEFAULTED: "1", OMP_REASON: choice.why})
    if choice.passive and "OMP_WAIT_POLICY" not in env:
        out["OMP_WAIT_POLICY"] = WAIT_POLICY
    return out


def apply(choice: ThreadChoice) -> None:
    """Make `choice` this process's: the environment (OpenMP reads it when torch loads; children inherit it) and,
    when torch is already loaded, its thread pool. The wait policy only takes effect before torch loads."""
    os.environ.update(child_env(choice, os.environ))
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)


def ranks_per_node(env: Mapping[str, str]) -> int:
    """The ranks a launcher started on this node (torchrun's LOCAL_WORLD_SIZE), or 1 for a plain process."""
    value = env.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def configure(quiet: bool = False) -> ThreadChoice:
    """Decide and apply this process's threads (call it before the command imports torch); warn, once, when the
    machine is oversubscribed. A rank's share was decided by the process that launched it (launch_env)."""
    choice = choose(cpu_budget(), ranks_per_node(os.environ))
    apply(choice)
    if choice.busy and not quiet and choice.source != "parent":
        log.warning("%s (%d thread(s) per process: %s)", choice.busy, choice.threads,
                    "your OMP_NUM_THREADS" if choice.source == "user" else
                    f"chosen from {choice.why}; OMP_NUM_THREADS overrides")
    return choice


def thread_reason(env: Mapping[str, str] | None = None) -> str:
    """What decided this process's threads, in words: the user's OMP_NUM_THREADS, or what shardfit chose from."""
    env = os.environ if env is None else env
    if env.get(OMP_DEFAULTED) == "1":
        return "from " + env.get(OMP_REASON, "the cores")
    return "OMP_NUM_THREADS" if _user_threads(env) is not None else ""
