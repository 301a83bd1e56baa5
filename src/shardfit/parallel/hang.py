"""From every rank's state at a watchdog event to one sentence naming the stuck rank (pure: no torch, no threads).

    rank 1 is in the data loader (step 4, 6.2 s; shardfit/parallel/faults.py:52 in inject);
    rank 0 waits in all_reduce #41 (backward, step 4)

The flight recorder decides who is behind: the rank whose last issued collective is older than the others' has
not reached the collective they wait in. Without it, the ranks that are not in any collective are the stuck ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from shardfit.parallel.ranks import ranks_phrase


@dataclass
class RankState:
    rank: int
    host: str
    pid: int
    phase: str | None  # "step 4", "evaluation after step 10", ... (None: outside the training loop)
    where: str | None  # "data loader", "forward", "backward", "optimizer step", ...
    phase_s: float | None  # seconds in the phase
    collective: str | None  # from the stack
    frame: str | None  # innermost frame of ours
    pending: list[dict[str, Any]] = field(default_factory=list)  # flight recorder: {"op", "seq", "pg"}
    enqueued: dict[str, int] = field(default_factory=dict)  # flight recorder: last collective issued, per group

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankState:
        return cls(**data)

    def in_collective(self) -> str | None:
        """The collective this rank waits in, as precisely as known; None when it is in none."""
        first = self.pending[0] if self.pending else None
        seq = f" #{first['seq']}" if first else ""
        if self.collective:
            return self.collective + seq
        if first:
            return f"{first['op']}{seq}"
        return None

    def context(self) -> str:
        bits = [b for b in (self.where, self.phase) if b]
        return ", ".join(bits)

    def place(self) -> str:
        """"in all_reduce #41", "in the data loader", "in evaluation after step 10", or outside the loop."""
        coll = self.in_collective()
        if coll:
            return f"in {coll}"
        if self.where:
            return f"in the {self.where}"
        return f"in {self.phase}" if self.phase else "outside the training loop (setup or teardown)"

    def doing(self) -> str:
        """What this rank is doing, for the stuck rank's sentence."""
        place = self.place()
        details = [d for d in (self.phase, f"{self.phase_s:.1f} s" if self.phase_s is not None else None,
                               self.frame) if d]
        return place + (f" ({'; '.join(details)})" if details else "")


@dataclass
class HangSummary:
    headline: str
    stuck: list[int]
    waiting: list[int]
    silent: list[int]
    verdict: str  # behind | not_in_collective | mismatched_collectives | collective_stalled | slow_everywhere
    # | single_rank | silent

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _behind(states: dict[int, RankState]) -> list[int]:
    """Ranks whose flight recorder shows fewer collectives issued than another rank's, in some process group."""
    out: set[int] = set()
    groups = {pg for s in states.values() for pg in s.enqueued}
    for pg in groups:
        counts = {r: s.enqueued[pg] for r, s in states.items() if pg in s.enqueued}
        if len(counts) < 2:
            continue
        top = max(counts.values())
        out |= {r for r, n in counts.items() if n < top}
    return sorted(out)


def _waiting_phrase(ranks: list[int], states: dict[int, RankState]) -> str:
    by_what: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        s = states[r]
        coll = s.in_collective()
        what = f"wait in {coll}" if coll else f"are {s.place()}"
        ctx = s.context()
        by_what[what + (f" ({ctx})" if ctx else "")].append(r)
    parts = []
    for what, rs in by_what.items():
        verb = what if len(rs) > 1 else what.replace("wait in", "waits in", 1).replace("are in", "is in", 1)
        parts.append(f"{ranks_phrase(rs)} {verb}")
    return "; ".join(parts)


def summarize(states: dict[int, RankState | None]) -> HangSummary:
    """One line naming the stuck rank(s) and what the others wait in, from every rank's answer (None: silent)."""
    silent = sorted(r for r, s in states.items() if s is None)
    live = {r: s for r, s in states.items() if s is not None}
    silent_txt = (f"; {ranks_phrase(silent)} did not answer (dead, or stuck in native code holding the Python "
                  "lock)") if silent else ""
    if not live:
        return HangSummary("no rank answered" + silent_txt, [], [], silent, "silent")
    if len(states) == 1:
        (r, s), = live.items()
        return HangSummary(f"rank {r} is {s.doing()}", [r], [], [], "single_rank")
    behind = _behind(live)
    in_coll = [r for r, s in live.items() if s.in_collective()]
    if behind:
        stuck, verdict = behind, "behind"
    elif in_coll and len(in_coll) < len(live):
        stuck, verdict = sorted(set(live) - set(in_coll)), "not_in_collective"
    else:
        stuck, verdict = [], ""
    if stuck:
        waiting = sorted(set(live) - set(stuck))
        said = "; ".join(f"rank {r} is {live[r].doing()}" for r in stuck[:4])
        if len(stuck) > 4:
            said += f"; and {ranks_phrase(stuck[4:])}"
        rest = f"; {_waiting_phrase(waiting, live)}" if waiting else ""
        return HangSummary(said + rest + silent_txt, stuck, waiting, silent, verdict)
    if in_coll:
        kinds = {live[r].in_collective() for r in in_coll}
        if len(kinds) > 1:
            return HangSummary("the ranks are in different collectives (uneven code paths between ranks): "
                               + _waiting_phrase(in_coll, live) + silent_txt, [], in_coll, silent,
                               "mismatched_collectives")
        return HangSummary(f"every rank is inside {kinds.pop()} and it does not complete: the transport is stuck or "
                           "very slow (run `shardfit doctor` with the same launch flags)" + silent_txt,
                           [], in_coll, silent, "collective_stalled")
    return HangSummary("no rank is in a collective: the phase is slow on every rank ("
                       + _waiting_phrase(sorted(live), live) + ")" + silent_txt, sorted(live), [], silent,
                       "slow_everywhere")
