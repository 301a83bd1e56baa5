"""What each training method means, in one table beside the strategy table (`shardfit/strategy.py`).

A method says what trains and what is stored how: adapters over frozen weights (LoRA), the same over 4-bit frozen
weights (QLoRA), every weight (full), or chosen modules (freeze). The config, the planner, the model builder, the
recipe and export read these columns instead of writing method names in tuples. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import UserError


@dataclass(frozen=True)
class Method:
    """One row of the table."""

    name: str
    summary: str
    adapters: bool = False  # low-rank adapters (peft) train; the base weights stay frozen
    quantized: bool = False  # the frozen base weights are stored in 4 bits (torchao NF4)
    trains_base: bool = False  # every base weight trains (fp32 master weights, the head's gradient included)
    needs: str | None = None  # the optional package the method needs installed (found, not imported)
    # Strategy engines it cannot train under (strategy.py): 4-bit weights are quantized where they load, so a
    # device map that splits them over GPUs cannot train them.
    refuses_engines: tuple[str, ...] = ()

    def allows(self, engine: str) -> bool:
        """Whether a strategy of `engine` can train this method."""
        return engine not in self.refuses_engines

    @property
    def saves(self) -> str:
        """What a finished run writes: an adapter folder, or a whole model folder."""
        return "adapter" if self.adapters else "model"


TABLE: tuple[Method, ...] = (
    Method("lora", "low-rank adapters over frozen weights in the compute precision", adapters=True),
    Method("qlora", "low-rank adapters over frozen weights stored in 4 bits (NF4)", adapters=True, quantized=True,
           needs="torchao", refuses_engines=("device_map",)),
    Method("full", "every weight trains", trains_base=True),
    Method("freeze", "the modules named by freeze_trainable train, the rest stays frozen"),
)

BY_NAME: dict[str, Method] = {m.name: m for m in TABLE}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def get(name: str) -> Method:
    """The row for `name`; a UserError naming the choices for anything else."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown method '{name}'; choose one of {', '.join(NAMES)}.") from None
