"""Test-only fault injection: make one rank stall or raise at a chosen step, to prove the watchdog names it and
the other ranks stop in seconds. Off unless SHARDFIT_TEST_FAULT is set; never set it in a real run.

    SHARDFIT_TEST_FAULT=stall:rank=1:step=4:seconds=20    rank 1 sleeps 20 s in the data loader of step 4
    SHARDFIT_TEST_FAULT=raise:rank=1:step=3               rank 1 raises RuntimeError there
    SHARDFIT_TEST_FAULT=stall:rank=1:step=2:seconds=9,raise:rank=1:step=4   both, in turn
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from shardfit.errors import UserError

VARIABLE = "SHARDFIT_TEST_FAULT"
KINDS = ("stall", "raise")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 60.0


def _one(text: str, whole: str) -> Fault:
    kind, *parts = text.strip().split(":")
    fields: dict[str, str] = {}
    for part in parts:
        key, _, value = part.partition("=")
        fields[key] = value
    try:
        if kind not in KINDS or not {"rank", "step"} <= fields.keys() or fields.keys() - {"rank", "step", "seconds"}:
            raise ValueError
        return Fault(kind, int(fields["rank"]), int(fields["step"]), float(fields.get("seconds", 60.0)))
    except ValueError:
        raise UserError(f"{VARIABLE}={whole}: expected stall:rank=R:step=S[:seconds=T] or raise:rank=R:step=S, "
                        "comma-separated (a test-only switch; unset it for real runs).") from None


def from_env(environ: Mapping[str, str] | None = None) -> list[Fault]:
    """The faults SHARDFIT_TEST_FAULT describes (none when unset); a UserError names a malformed value."""
    text = (environ if environ is not None else os.environ).get(VARIABLE, "").strip()
    return [_one(part, text) for part in text.split(",") if part.strip()]


def inject(faults: list[Fault], rank: int, step: int) -> None:
    """Stall or raise here for each fault that targets this rank and step."""
    for fault in faults:
        if fault.rank != rank or fault.step != step:
            continue
        if fault.kind == "stall":
            time.sleep(fault.seconds)
        else:
            raise RuntimeError(f"injected fault ({VARIABLE}): rank {rank} raises at step {step}")
