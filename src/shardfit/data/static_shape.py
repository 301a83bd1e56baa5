"""One input shape for a whole run: every training micro-batch is one row of exactly micro_batch x max_seq_len
tokens, its examples side by side (positions restarting at each; data/packing.py `pack_stream`), padded only at
the end.

Every example fits (none is longer than max_seq_len), so the micro-batch keeps its `micro_batch` examples and the
loss stays that of unpacked rows. A compiled model then meets one shape, and CUDA graphs can replay; the attention
must take the examples' boundaries from the restarts (variable-length flash attention, a flex block mask), or it
computes the whole masked square of the row (the dense path, exact, and what a CPU runs).
"""

from __future__ import annotations

import dataclasses

from shardfit.resolve.job import RowShape


def stream_shape(rows: RowShape) -> RowShape:
    """The training micro-batches' shape: one row of micro_batch x max_seq_len tokens (`rows.limit` is
    max_seq_len), never rounded."""
    budget = rows.micro_batch * rows.limit
    return dataclasses.replace(rows, limit=budget, width=budget, height=1, multiple=1)
