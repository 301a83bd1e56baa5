"""Where the wait before the first trained step goes: start, data, tokenizer, model, setup, the first step.

Counted from the process's own start (Linux /proc), so the interpreter, the imports and the config ("start"; in the
demo also the base model's answers) are in it, as a user's stopwatch would see it; where /proc does not say, from
when the recipe starts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started, or None where /proc does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): start time after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)


@dataclass
class StartupTimer:
    """Phases in the order they ran, each in seconds; `mark(name)` closes the phase that ends now."""

    phases: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        age = process_age_s()
        if age is not None:
            self.phases["start"] = round(age, 2)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._last, 2)
        self._last = now

    @property
    def total(self) -> float:
        return round(sum(self.phases.values()), 2)

    def describe(self) -> str:
        """`12.3 s (start 2.1, data 0.4, ...)`."""
        return f"{self.total:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items()) + ")"
