"""The order in which each rank runs its compute under torch.distributed.pipelining's schedules, read from torch's
own schedule builders without a process group, and the idle share of a step that follows from it (the bubble).

Torch builds interleaved 1F1B's and zero bubble's per-rank action lists (`pipeline_order`) in the constructor from
the stage counts alone (`_calculate_single_rank_operations`, and zero bubble's `_add_bubbles_to_actions`): those are
called here on an object that holds only those counts. 1F1B's runtime does not read its displayed action list (whose
micro-batch numbering is off on the later ranks): its order is the one `Schedule1F1B._step_microbatches` runs,
min(micro-batches, stages - rank) forwards, then a backward and a forward in turn, then the remaining backwards.

`bubble` replays those orders with unit costs (a forward 1; a full backward 2, the input-gradient pass 1 and the
weight-gradient pass 1, as the zero-bubble paper's schedules assume) under the pipeline's dependencies: a forward
waits for the previous stage's forward of its micro-batch, an input gradient for the next stage's (the last stage's
for its own forward), a weight gradient for its own input gradient. The idle share is 1 - busy / (ranks x span).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _ComputationType

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
# The unit costs: a full backward is the input-gradient and the weight-gradient passes together.
COST = {"F": 1, "B": 2, "I": 1, "W": 1}
_KIND = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
         _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True)
class Op:
    """One compute action: `kind` (F, B, I, W) of micro-batch `micro` on global stage `stage`."""

    kind: str
    stage: int
    micro: int


def rank_orders(schedule: str, stages: int, micro_batches: int, per_rank: int = 1) -> list[list[Op]]:
    """Each of `stages` ranks' compute actions in the order torch's `schedule` runs them (`per_rank` looped stages
    per rank under interleaved 1F1B and zero bubble)."""
    if schedule == "1f1b":
        return [_one_f_one_b(r, stages, micro_batches) for r in range(stages)]
    cls = {"interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
           "zero_bubble": torch_schedules.ScheduleInterleavedZeroBubble}[schedule]
    built = object.__new__(cls)  # the constructor's counts only: no stages, no process group
    built.pp_group_size, built.n_local_stages, built._n_microbatches = stages, per_rank, micro_batches
    built.number_of_rounds = max(1, micro_batches // stages)
    built.microbatches_per_round = micro_batches // built.number_of_rounds
    built.pipeline_order = {r: built._calculate_single_rank_operations(r) for r in range(stages)}
    if schedule == "zero_bubble":
        built.pipeline_order = built._add_bubbles_to_actions(stages * per_rank)
    return [[Op(_KIND[a.computation_type], a.stage_index, a.microbatch_index)
             for a in built.pipeline_order[r] if a is not None and a.computation_type in _KIND]
            for r in range(stages)]


def _one_f_one_b(rank: int, stages: int, m: int) -> list[Op]:
    """`Schedule1F1B._step_microbatches`'s order on `rank`: warm-up forwards, then backward and forward in turn."""
    warm = min(m, stages - rank)
    ops = [Op("F", rank, i) for i in range(warm)]
    for i in range(m):
        ops.append(Op("B", rank, i))
        if warm + i < m:
            ops.append(Op("F", rank, warm + i))
    return ops


def _ready(op: Op, last: int) -> tuple[str, int, int] | None:
    """The action `op` waits for (kind, stage, micro), None for the first stage's forwards."""
    if op.kind == "F":
        return ("F", op.stage - 1, op.micro) if op.stage > 0 else None
    if op.kind == "W":
        return ("I", op.stage, op.micro)
    return ("F", op.stage, op.micro) if op.stage == last else ("I", op.stage + 1, op.micro)


def bubble(orders: list[list[Op]]) -> float:
    """The idle share of the step the `orders` run (unit costs, `COST`), each rank starting an action as soon as
    its previous action and the action it waits for have ended."""
    last = max(op.stage for ops in orders for op in ops)
    done: dict[tuple[str, int, int], int] = {}
    free = [0] * len(orders)
    nxt = [0] * len(orders)
    while any(n < len(ops) for n, ops in zip(nxt, orders, strict=True)):
        moved = False
        for r, ops in enumerate(orders):
            while nxt[r] < len(ops):
                op = ops[nxt[r]]
                need = _ready(op, last)
                key = (need[0], need[1], need[2]) if need else None
                if key is not None and key[0] == "I" and key not in done:  # a full backward also yields the input's
                    key = ("B", key[1], key[2])
                if key is not None and key not in done:
                    break
                start = max(free[r], done[key] if key else 0)
                free[r] = start + COST[op.kind]
                done[(op.kind, op.stage, op.micro)] = free[r]
                nxt[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the orders wait on each other: not a schedule")
    busy = sum(COST[op.kind] for ops in orders for op in ops)
    return 1 - busy / (len(orders) * max(free))
