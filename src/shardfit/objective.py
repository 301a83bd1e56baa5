"""What each training objective means, in one table beside the method and strategy tables: the data it reads,
whether it needs a reference model, and what its loss is a mean over. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import UserError


@dataclass(frozen=True)
class Objective:
    """One row of the table."""

    name: str
    summary: str
    data: str = "sft"  # sft (conversations) | pairs (chosen + rejected) | unpaired (answer + desirable)
    reference: bool = False  # compares the policy with the reference model (the weights before training)

    @property
    def preference(self) -> bool:
        return self.data != "sft"

    @property
    def sequences(self) -> int:
        """Forwarded sequences per example: both answers of a pair, one answer otherwise."""
        return 2 if self.data == "pairs" else 1


TABLE: tuple[Objective, ...] = (
    Objective("sft", "supervised fine-tuning: next-token loss on the answers"),
    Objective("dpo", "direct preference optimisation on chosen/rejected pairs against the reference", "pairs",
              reference=True),
    Objective("orpo", "odds-ratio preference optimisation: SFT on chosen plus a log-odds term, no reference",
              "pairs"),
    Objective("simpo", "simple preference optimisation: length-normalised margin, no reference", "pairs"),
    Objective("kto", "Kahneman-Tversky optimisation on unpaired answers labelled desirable or not", "unpaired",
              reference=True),
)

BY_NAME: dict[str, Objective] = {o.name: o for o in TABLE}
NAMES: tuple[str, ...] = tuple(BY_NAME)
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


def get(name: str) -> Objective:
    """The row for `name`; a UserError naming the choices for anything else."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown objective '{name}'; choose one of {', '.join(NAMES)}.") from None


def reference_of(objective: str, adapters: bool, precompute: bool | str) -> str | None:
    """How a run gets its reference log-probabilities: "precomputed" (once, before the first step), "adapters_off"
    (each step, the policy with its adapters switched off) or None (the objective needs none). `auto` precomputes
    for methods without adapters, where switching adapters off is not a reference."""
    if not get(objective).reference:
        return None
    if precompute == "auto":
        return "adapters_off" if adapters else "precomputed"
    return "precomputed" if precompute else "adapters_off"


def micro_batch_problem(name: str, micro_batch: int) -> str | None:
    """Why objective `name` cannot train at `micro_batch` rows a micro-batch, or None. KTO's reference point is the
    policy/reference log-ratio over the micro-batch's rows (TRL's KL term, shardfit's mean): with one row it is that
    row's own, and the loss stops moving (TRL's KTOTrainer refuses a batch of 1 for the same reason). Shared by
    shardfit's config checks and `--from` jobs, so plan, check and convert refuse alike."""
    if name == "kto" and micro_batch < 2:
        return ("objective kto takes its reference point from the rows of a micro-batch: with one row it is that "
                "row's own log-ratio and the loss stops moving")
    return None
