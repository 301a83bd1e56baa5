"""A step's micro-batches on their way to the device: collated on the host one micro-batch ahead of the compute.

On a GPU each micro-batch is collated into page-locked (pinned) host memory and copied on a stream of its own with
`non_blocking`, issued before the current micro-batch's forward is queued: the copy of micro-batch m + 1 overlaps
the compute of m, and the host never waits for a copy (a copy from ordinary, pageable memory makes it wait). The
compute stream waits for the copy stream before it reads a batch. On a CPU nothing is pinned and there is no second
stream: the same order, the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shardfit.data.loader import Batch
from shardfit.data.packing import PackedRow


@dataclass
class _InFlight:
    """A micro-batch whose copy has been issued: the device batch, and the host batch it was copied from (kept
    alive until the copy is consumed)."""

    batch: Batch
    host: Batch


class InputFeed:
    """Turns a step's micro-batches into device batches, each issued one ahead of the one handed out.

    `prepare` collates one micro-batch's rows on the host (and slices them for sequence parallelism). `pin`: the
    GPU path (pinned memory, a copy stream); None decides by the device. A test on a CPU may force it on and stand
    in for the pinning (tests/test_input_feed.py)."""

    def __init__(self, device: torch.device | str, prepare: Callable[[list[PackedRow]], Batch],
                 pin: bool | None = None):
        self.device, self.prepare = torch.device(device), prepare
        self.pin = self.device.type == "cuda" if pin is None else pin
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, micro_batches: list[list[PackedRow]]) -> Iterator[Batch]:
        """The device batches in order; micro-batch m + 1 is collated and its copy issued before m is handed out
        (so before m's forward is queued)."""
        ahead = self._issue(micro_batches[0]) if micro_batches else None
        for m in range(len(micro_batches)):
            current = ahead
            ahead = self._issue(micro_batches[m + 1]) if m + 1 < len(micro_batches) else None
            yield self._ready(current)

    def _issue(self, rows: list[PackedRow]) -> _InFlight:
        host = self.prepare(rows)
        if self.pin:
            host = host.pinned()
        if self.stream is None:
            return _InFlight(host.to(self.device), host)
        with torch.cuda.stream(self.stream):
            return _InFlight(host.to(self.device), host)

    def _ready(self, flight: _InFlight) -> Batch:
        """The batch, safe to read on the compute stream: it waits for the copy, and the caching allocator learns
        that the compute stream uses the memory (else it could hand it out again once the copy stream is done)."""
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)
            for t in flight.batch.tensors():
                if t.device.type == "cuda":
                    t.record_stream(compute)
        return flight.batch
