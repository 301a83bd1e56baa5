"""A channel between ranks that does not go through the process group: a few keys in the rendezvous TCPStore.

While a rank's main thread is blocked inside a collective, its process group cannot carry anything else; the
store can. Ranks use it to say "I failed, here is why" (so the others stop within seconds instead of waiting out
the collective timeout) and for the watchdog's "dump your stacks" requests. Every operation is short and bounded.
Keys live under a prefix per torchrun attempt, so a restarted group never reads the previous attempt's failure.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

FAILURES = "failures"
EVENTS = "watchdog/events"
POKES = "watchdog/pokes"


class SideChannel:
    """Failure reports and watchdog events of one group of ranks, over `store`."""

    def __init__(self, store: dist.Store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._lock = threading.Lock()  # the main thread (failure) and the watchdog thread share the connection

    @classmethod
    def connect(cls, rank: int, world: int, timeout_s: float = 10.0) -> SideChannel | None:
        """A client of the rendezvous store torchrun (or rank 0) serves at MASTER_ADDR:MASTER_PORT; None when
        there is none to reach (a single process, or a launcher without one)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world < 2 or not addr or not port:
            return None
        try:
            store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError):  # DistNetworkError and friends derive from RuntimeError
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"shardfit/side/attempt-{attempt}", store), rank, world)

    def _count(self, key: str, by: int = 0) -> int:
        with self._lock:
            return int(self.store.add(key, by))

    def _set(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self.store.set(key, json.dumps(value))

    def _get(self, key: str, wait_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self.store.check([key]):
                    return json.loads(self.store.get(key))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    # -- failures --------------------------------------------------------------------------------------------------
    def report_failure(self, host: str, message: str, kind: str = "error") -> int:
        """Record this rank's failure; returns its order among the group's failures (1: the first)."""
        n = self._count(FAILURES, 1)
        self._set(f"failure/{n}", {"rank": self.rank, "host": host, "message": message, "kind": kind,
                                   "time": time.time()})
        return n

    def first_failure(self, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The group's first failure, waiting up to `wait_s` for one to be reported."""
        deadline = time.monotonic() + wait_s
        while self._count(FAILURES) == 0:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return self._get("failure/1", wait_s=5.0)  # its record follows its count within milliseconds

    # -- watchdog events -------------------------------------------------------------------------------------------
    def poke(self) -> None:
        """Ask rank 0 to start a watchdog event (this rank's own timer fired)."""
        self._count(POKES, 1)

    def pokes(self) -> int:
        return self._count(POKES)

    def start_event(self) -> int:
        """Rank 0: open a new event; every rank answers it with its state."""
        return self._count(EVENTS, 1)

    def latest_event(self) -> int:
        return self._count(EVENTS)

    def post_state(self, event: int, state: dict[str, Any]) -> None:
        self._set(f"watchdog/{event}/rank-{self.rank}", state)

    def collect_states(self, event: int, wait_s: float) -> dict[int, dict[str, Any] | None]:
        """Every rank's answer to `event`, waiting up to `wait_s` in all; None for ranks that did not answer."""
        deadline = time.monotonic() + wait_s
        out: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world):
            out[r] = self._get(f"watchdog/{event}/rank-{r}", wait_s=max(0.0, deadline - time.monotonic()))
        return out
