"""`profile_steps`: torch.profiler over a few optimizer steps of a run, written to the run directory.

The first step this process runs is left out (allocations, lazy initialisation, kernel loading: what every later
step does not pay); the next `profile_steps` are profiled, host activity always and the GPU's kernels where the run
has one. Each rank writes `profile/ops-rank<R>.txt` (the ops by their own time, the device's first where there is
one) and `profile/trace-rank<R>.json` (a Chrome trace: chrome://tracing or ui.perfetto.dev). Profiled steps run
slower than the others, and the run's tokens/s counts them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    """Starts before step `first` (numbered from 1), stops after `steps` of them or at the run's last step."""

    def __init__(self, run_dir: Path, steps: int, start_step: int, rank: int, device_type: str):
        self.folder, self.steps, self.rank, self.device_type = run_dir / "profile", steps, rank, device_type
        self.first = start_step + 2
        self.active: profile | None = None

    def before(self, step: int) -> None:
        """Called before optimizer step `step` runs."""
        if self.steps and step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self.active = profile(activities=activities)
            self.active.start()

    def after(self, step: int, last: bool) -> None:
        """Called after step `step`; `last`: the run's final step, which ends a profile still running."""
        if self.active is None or (step < self.first + self.steps - 1 and not last):
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()  # the kernels of the profiled steps, finished, in the trace
        prof, self.active = self.active, None
        prof.stop()
        sort = "self_device_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
        self.folder.mkdir(parents=True, exist_ok=True)
        ops, trace = self.folder / f"ops-rank{self.rank}.txt", self.folder / f"trace-rank{self.rank}.json"
        ops.write_text(f"steps {self.first}-{step}\n" + prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        prof.export_chrome_trace(str(trace))

    def close(self) -> None:
        """Stop a profile the run left running (a failure mid-profile); nothing is written for it."""
        if self.active is not None:
            self.active.stop()
            self.active = None
