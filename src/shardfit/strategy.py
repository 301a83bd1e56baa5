"""What each strategy means, in one table that every stage reads (config, plan, parallel, check, train).

A strategy is a choice of engine and of what is replicated or sharded across ranks. Adding one means adding a row
here and its branch in `parallel/parallelize.py`; the planner, the preflight and the recipe read the columns.
No torch here: `shardfit plan` and config validation import this without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import UserError


@dataclass(frozen=True)
class Strategy:
    """One row of the table. `engine` names what runs it: plain PyTorch on one device, DDP, FSDP2 `fully_shard`,
    or a device map over the local GPUs of one process."""

    name: str
    summary: str  # what is replicated / sharded, in words
    engine: str  # plain | ddp | fsdp2 | device_map
    shards_params: bool = False
    shards_grads: bool = False
    shards_optimizer: bool = False
    reshard_after_forward: bool = False  # FSDP2: free the gathered parameters after each unit's forward
    offload: bool = False  # shards live in host memory between uses
    speed_rank: int = 0  # the recommendation's order when several fit: lower is faster

    @property
    def multi_rank(self) -> bool:
        """Runs one process per GPU under torchrun, and its ranks communicate."""
        return self.engine in ("ddp", "fsdp2")

    @property
    def sharded(self) -> bool:
        """Parameters (or their gradients and optimizer states) are split across ranks by FSDP2."""
        return self.engine == "fsdp2"

    @property
    def autocast(self) -> bool:
        """Low precision through torch.autocast; FSDP2 casts the parameters itself (MixedPrecisionPolicy)."""
        return not self.sharded

    @property
    def simulable(self) -> bool:
        """`plan --simulate` can run its step on fake tensors (a fake process group stands in for the ranks)."""
        return self.engine in ("plain", "ddp", "fsdp2") and not self.offload


TABLE: tuple[Strategy, ...] = (
    Strategy("single", "one device holds everything", "plain", speed_rank=0),
    Strategy("ddp", "full replica per rank, gradients all-reduced", "ddp", speed_rank=1),
    Strategy("zero2", "params replicated during compute; grads + optimizer state sharded", "fsdp2",
             shards_grads=True, shards_optimizer=True, speed_rank=2),
    Strategy("zero3", "params, grads, optimizer state all sharded", "fsdp2", shards_params=True, shards_grads=True,
             shards_optimizer=True, reshard_after_forward=True, speed_rank=3),
    Strategy("zero3_offload", "as zero3, shards kept in CPU memory", "fsdp2", shards_params=True, shards_grads=True,
             shards_optimizer=True, reshard_after_forward=True, offload=True, speed_rank=5),
    Strategy("model_parallel", "one process, layers split across local devices (what device_map does), "
             "device-safe loss", "device_map", speed_rank=4),
)

BY_NAME: dict[str, Strategy] = {s.name: s for s in TABLE}
NAMES: tuple[str, ...] = tuple(BY_NAME)
CHOICES: tuple[str, ...] = ("auto", *NAMES)  # what the config's `strategy` key accepts
SPEED_ORDER: tuple[str, ...] = tuple(s.name for s in sorted(TABLE, key=lambda s: s.speed_rank))
MULTI_RANK: tuple[str, ...] = tuple(s.name for s in TABLE if s.multi_rank)


def get(name: str) -> Strategy:
    """The row for `name`; a UserError naming the choices for anything else ('auto' is resolved before this)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown strategy '{name}'; choose one of {', '.join(NAMES)}.") from None
