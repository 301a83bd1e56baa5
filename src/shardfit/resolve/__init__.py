"""Resolve: what one job's `auto` settings and launch become, decided once before the launch (torch-free).

`resolve_job` turns a config, the job's hardware and the facts of its device into a `Resolved`: the strategy and
the processes per node, the method, the precision and autocast, compile, the attention kernel policy, the row shape
and the loss chunk. `train` computes it before deciding whether and how to relaunch, and its ranks read it instead
of deciding again; `check` and `plan` print the same object; summary.json records it.
"""

from shardfit.resolve.decide import resolve, resolve_job
from shardfit.resolve.job import DeviceFacts, Resolved, RowShape

__all__ = ["DeviceFacts", "Resolved", "RowShape", "resolve", "resolve_job"]
