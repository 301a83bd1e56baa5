"""The training watchdog: one thread per rank that notices a phase (a step, an evaluation, a checkpoint save)
running far longer than the recent steps, has every rank write its stacks and collective state into the run
directory, and has rank 0 print one line naming the stuck rank. It also stops a rank within seconds when another
rank has failed, instead of leaving it in a collective until the process group's timeout.

Coordination goes through the rendezvous store (parallel/sidechannel.py), never the process group, which is
exactly what is blocked. Rank 0 opens an event (its timer fired, or another rank asked); every rank answers with
its state; rank 0 summarises (parallel/hang.py). Then the run keeps waiting, or aborts (`watchdog_action`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from shardfit.errors import ShardfitError
from shardfit.parallel.env import DistEnv
from shardfit.parallel.hang import HangSummary, RankState, summarize
from shardfit.parallel.sidechannel import SideChannel
from shardfit.parallel.stacks import all_stacks, flight_recorder, main_thread_frame, where_is

log = logging.getLogger("shardfit")
# Errors of a rank whose peer died: worth waiting a moment for the peer's own report, which names the cause.
_CONSEQUENCE = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "nccl", "gloo",
                "processgroup", "socket")


@dataclass(frozen=True)
class WatchdogSettings:
    """When a phase counts as stuck: longer than max(min_s, factor x the median of the last `window` steps)."""

    factor: float = 10.0
    min_s: float = 300.0
    action: str = "wait"
    window: int = 20

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class PeerFailure(ShardfitError):
    """This rank stopped because another rank failed first; the message points at that rank's error."""


@dataclass
class _Phase:
    name: str
    t0: float
    step: bool
    fired: bool = False


class Watchdog:
    """The watchdog of this rank. The training loop marks phases (`phase`) and places within them (`at`);
    `start` runs the thread. Unstarted, it only records (library use, tests)."""

    def __init__(self, env: DistEnv, side: SideChannel | None, *, poll_s: float = 0.25, side_poll_s: float = 2.0,
                 answer_wait_s: float = 15.0, stream: TextIO | None = None):
        self.env, self.side = env, side
        self.poll_s, self.side_poll_s, self.answer_wait_s = poll_s, side_poll_s, answer_wait_s
        self.stream = stream or sys.stderr
        self.settings = WatchdogSettings()
        self.run_dir: Path | None = None
        self.host = os.uname().nodename
        self._phase: _Phase | None = None
        self._where: str | None = None
        # The last phase and place entered, kept after the phase ends: what a failure's message names.
        self.last_place: str | None = None
        self._steps: deque[float] = deque(maxlen=self.settings.window)
        self._answered = 0
        self._answered_t = float("-inf")  # when this rank last answered an event
        self._pokes_seen = 0
        self._poked: tuple[float, int] | None = None  # when this rank asked rank 0 for an event, and the last answered
        self._next_side = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fr: dict[str, Any] = {}
        self.events: list[HangSummary] = []  # rank 0: what it printed (tests and the summary file read these)

    # -- main thread ---------------------------------------------------------------------------------------------
    def configure(self, run_dir: Path, settings: WatchdogSettings) -> None:
        self.run_dir, self.settings = Path(run_dir), settings
        self._steps = deque(self._steps, maxlen=settings.window)

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._loop, name="shardfit-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.answer_wait_s + 5)

    @contextlib.contextmanager
    def phase(self, name: str, *, step: bool = False, where: str | None = None) -> Iterator[None]:
        """Time a phase of the loop; `step` phases feed the median that sets the threshold."""
        p = _Phase(name, time.monotonic(), step)
        self._phase, self._where = p, where
        self.last_place = name + (f" ({where})" if where else "")
        try:
            yield
        finally:
            took = time.monotonic() - p.t0
            self._phase, self._where = None, None
            if step:
                self._steps.append(took)
            if p.fired and self.env.is_main:
                print(f"shardfit: watchdog: {name} finished after {took:.1f} s", file=self.stream, flush=True)

    def at(self, where: str) -> None:
        """The part of the current phase this rank is in (data loader, forward, backward, ...)."""
        self._where = where
        if self._phase is not None:
            self.last_place = f"{self._phase.name} ({where})"

    def threshold(self) -> float:
        """Seconds after which the current phase counts as stuck."""
        if not self._steps:
            return self.settings.min_s
        return max(self.settings.min_s, self.settings.factor * statistics.median(self._steps))

    def failed(self, exc: BaseException) -> BaseException:
        """This rank's main thread is failing with `exc`: tell the others, and return what to raise instead when
        another rank failed first (the cause is there, this rank's error is the consequence)."""
        if self.side is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return exc
        text = f"{type(exc).__name__}: {exc}"
        try:
            wait = 2.0 if any(k in text.lower() for k in _CONSEQUENCE) else 0.0
            first = self.side.first_failure(wait_s=wait)
            if first is None or first["rank"] == self.env.rank:
                self.side.report_failure(self.host, text[:2000])
                return exc
        except (RuntimeError, OSError):  # the store is gone (its host died): nothing more to learn from it
            return exc
        return self._peer_error(first, text, exc)

    def _peer_error(self, first: dict[str, Any], own: str, exc: BaseException) -> BaseException:
        if self.env.local_rank != 0:
            return SystemExit(1)  # one message per node, not one per rank
        if first["message"] == own[:2000]:
            return exc  # the same error on every rank (a bad config row, say): nothing to point at
        return PeerFailure(f"rank {first['rank']} on {first['host']} failed first: {first['message']}\n"
                           f"(rank {self.env.rank} stopped because of it; its own error was {own[:300]})")

    # -- the thread ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except (RuntimeError, OSError) as e:  # the store went away (shutdown, a dead node): keep the timer
                if self.side is not None:
                    log.debug("watchdog: side channel lost: %s", e)
                self.side = None

    def _tick(self) -> None:
        now = time.monotonic()
        if self.side is not None and now >= self._next_side:
            self._next_side = now + self.side_poll_s
            first = self.side.first_failure()
            if first is not None and first["rank"] != self.env.rank:
                self._stop_for(first)
            event = self.side.latest_event()
            if event > self._answered:
                self._answer(event)
            if self.env.is_main:
                pokes = self.side.pokes()
                if pokes > self._pokes_seen:
                    self._pokes_seen = pokes
                    self._event()
            else:
                self._rank0_silent(now)
        p = self._phase
        if p is None or p.fired or not self.settings.enabled or now - p.t0 <= self.threshold():
            return
        p.fired = True
        if self.side is not None and not self.env.is_main:
            if self._answered_t >= p.t0:
                return  # an event opened during this phase already holds this rank's stack
            self.side.poke()  # rank 0 opens the event; this rank answers it at its next poll
            self._poked = (now, self._answered)
        else:
            self._event()

    def _rank0_silent(self, now: float) -> None:
        """This rank asked for an event and rank 0 never opened one (rank 0 dead, or stuck holding the Python
        lock): write this rank's own state, and say so once per node."""
        if self._poked is None or self._answered > self._poked[1]:
            self._poked = None
            return
        if now - self._poked[0] < self.answer_wait_s + 2 * self.side_poll_s:
            return
        self._poked = None
        state = self._answer(f"rank{self.env.rank}-alone", post=False)
        if self.env.local_rank == 0:
            print(f"shardfit: watchdog (rank {self.env.rank}): rank 0 opened no report within "
                  f"{self.answer_wait_s + 2 * self.side_poll_s:.0f} s (it may be the stuck one); this rank is "
                  f"{state.doing()}", file=self.stream, flush=True)

    def state(self) -> RankState:
        """This rank, now: phase, place, collective (stack and flight recorder)."""
        p = self._phase
        where = where_is(main_thread_frame())
        self._fr = fr = flight_recorder() or {}
        return RankState(self.env.rank, self.host, os.getpid(), p.name if p else None, self._where,
                         round(time.monotonic() - p.t0, 1) if p else None, where.collective, where.frame,
                         fr.get("pending", []), fr.get("enqueued", {}))

    def _folder(self, event: int | str) -> Path | None:
        if self.run_dir is None:
            return None
        folder = self.run_dir / "watchdog" / f"event-{event}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _answer(self, event: int | str, post: bool = True) -> RankState:
        """Write this rank's stacks and state for `event` into the run directory and post the state."""
        if isinstance(event, int):
            self._answered, self._answered_t = event, time.monotonic()
        state = self.state()
        folder = self._folder(event)
        if folder is not None:
            lines = [f"rank {state.rank} of {self.env.world} on {state.host} (pid {state.pid})",
                     f"phase: {state.phase or '-'}; where: {state.where or '-'}; {state.phase_s or 0:.1f} s in it",
                     f"collective (stack): {state.collective or 'none'}",
                     f"flight recorder: {json.dumps(self._fr) if self._fr else 'not available'}", "", all_stacks()]
            (folder / f"rank-{state.rank}.txt").write_text("\n".join(lines) + "\n")
        if post and self.side is not None and isinstance(event, int):
            self.side.post_state(event, state.to_json())
        return state

    def _event(self) -> None:
        """Rank 0 (or a single process): gather every rank's state, print one summary, then wait or abort."""
        p = self._phase
        if p is not None:
            p.fired = True  # one event per phase: its own timer must not open a second one for the same stall
        if self.side is not None:
            event = self.side.start_event()
            self._answer(event)
            raw = self.side.collect_states(event, self.answer_wait_s)
            self._pokes_seen = self.side.pokes()  # ranks that asked meanwhile are answered by this event
            states = {r: RankState.from_json(s) if s else None for r, s in raw.items()}
        else:
            event = self._answered + 1
            states = {0: self._answer(event)}
        summary = summarize(states)
        # A phase that ended while the ranks answered was slow, not stuck: the answers are snapshots of ranks that
        # kept moving, so they name no culprit, and aborting would kill a working run.
        moved = p is not None and self._phase is not p
        took = f"{p.name} has run {time.monotonic() - p.t0:.0f} s" if p else "a rank asked"
        limit = f"(over the watchdog's {self.threshold():.0f} s)"
        where = f"; stacks in {self.run_dir / 'watchdog' / f'event-{event}'}" if self.run_dir else ""
        said = (f"slow, not stuck: {p.name} ended while the ranks answered" if moved and p else summary.headline)
        print(f"shardfit: watchdog: {took} {limit}: {said}{where}", file=self.stream, flush=True)
        folder = self._folder(event)
        if folder is not None:
            (folder / "summary.json").write_text(json.dumps(
                {"summary": summary.to_json(), "moved_on": moved,
                 "ranks": {r: s.to_json() if s else None for r, s in states.items()}}, indent=2))
        self.events.append(summary)  # once its line is printed and its files written: what a reader may rely on
        if self.settings.action == "abort" and not moved:
            if self.side is not None:
                self.side.report_failure(self.host, f"watchdog abort: {summary.headline}", kind="watchdog")
            print("shardfit: watchdog: aborting the run (watchdog_action: abort)", file=self.stream, flush=True)
            self._exit()

    def _stop_for(self, first: dict[str, Any]) -> None:
        """Another rank failed: say so once per node and exit, rather than wait in a collective for its timeout."""
        if self.env.local_rank == 0:
            print(f"shardfit: rank {self.env.rank}: stopping because rank {first['rank']} on {first['host']} "
                  f"failed: {first['message']}", file=self.stream, flush=True)
        self._exit()

    def _exit(self) -> None:
        self.stream.flush()
        os._exit(1)  # the main thread is blocked in a collective: nothing short of exiting the process frees it
