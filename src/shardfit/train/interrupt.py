"""What a run stopped by Ctrl-C leaves behind, in words: the checkpoint that survives (or that none does) and the
command that continues from it."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from shardfit.train.checkpoint import intact, list_checkpoints


def interrupted_message(run_dir: Path, resume: str, command: Sequence[str]) -> str:
    """The lines to print after Ctrl-C: `run_dir` is the run's output_dir, `resume` its resume setting, `command`
    the shardfit command line that started it."""
    again = shlex.join(command)
    survivor = next(((step, path) for step, path in reversed(list_checkpoints(run_dir)) if intact(path) is None),
                    None)
    half = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob(".tmp-step-*"))
    partial = f" (the save of {half[-1].removeprefix('.tmp-')} was cut short and is ignored)" if half else ""
    if survivor is None:
        return (f"No checkpoint of this run survives in {Path(run_dir) / 'checkpoints'}{partial}; the steps trained "
                f"so far are lost. Start again with: {again}")
    step, path = survivor
    if resume != "auto":  # the run was told not to resume (the demo's resume: never): the command must say so
        again += " --set resume=auto"
    return (f"The checkpoint of step {step} survives ({path}){partial}; later steps are lost. Continue from it "
            f"with: {again}")
