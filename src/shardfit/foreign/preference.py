"""Preference jobs of other tools (DPO, ORPO, SimPO, KTO) in shardfit's terms: the objective and `dpo:` keys a
reader found, what convert cannot carry, and the reference model the tool keeps beside the policy.

Each reader maps its tool's keys (LLaMA-Factory's `stage`/`pref_*`, ms-swift's `rlhf_type`, axolotl's `rl`, a TRL
script's trainer class) into a `Preference`; `apply` puts it on the job. What no shardfit objective trains (PPO,
GRPO, reward models) is a UserError when the job is read: the planner cannot count a policy, a reward model, a value
model and generation either."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardfit import objective as objectives
from shardfit.errors import UserError
from shardfit.foreign.common import as_float
from shardfit.foreign.job import ForeignJob, ReferenceCopy

TRAINED = ", ".join(objectives.NAMES)


@dataclass
class Preference:
    """What a tool's job optimises, said in shardfit's keys."""

    objective: str = "sft"
    dpo: dict[str, Any] = field(default_factory=dict)  # shardfit's dpo: keys the job sets (beta, loss, ...)
    not_carried: list[str] = field(default_factory=list)
    unconvertible: str | None = None
    reference: ReferenceCopy | None = None
    precompute: bool | None = None  # the tool precomputes the reference's log-probabilities (TRL's option)

    def number(self, name: str, value: Any, key: str, where: str) -> None:
        """Carry the tool's `key` as shardfit's dpo.`name` (a number; None leaves shardfit's default)."""
        if value is not None:
            self.dpo[name] = as_float(value, key, where)

    def drop(self, key: str, value: Any, what: str) -> None:
        """A setting convert cannot carry: `what` says what it did in the tool."""
        self.not_carried.append(f"{key}: {value} not carried: {what}")


def refuse(where: str, key: str, value: Any, what: str) -> UserError:
    """The error for a job no shardfit objective trains (PPO, GRPO, a reward model, ...)."""
    return UserError(f"{where}: '{key}' is {value!r} ({what}); shardfit trains {TRAINED}, and plans only those. "
                     f"For a preference stage, use DPO, ORPO, SimPO or KTO (docs/preference.md).")


def choice(value: Any, key: str, where: str, choices: dict[str, str]) -> str:
    """The tool's `value` looked up in `choices` (its words -> shardfit's); anything else is a UserError naming the
    tool's choices."""
    text = str(value).strip().lower()
    if text not in choices:
        raise UserError(f"{where}: '{key}' is {value!r}; expected one of {', '.join(choices)}.")
    return choices[text]


def apply(job: ForeignJob, pref: Preference) -> None:
    """Put what the reader found on the job: the workload's objective, the config keys convert writes, and the
    reference copy the as-configured plan counts."""
    if pref.objective == "sft":
        return
    changes: dict[str, Any] = {"objective": pref.objective}
    if pref.precompute is not None:
        changes["precompute_reference"] = pref.precompute
        if pref.precompute:
            pref.dpo["precompute_reference"] = True
    job.workload = dataclasses.replace(job.workload, **changes)
    job.convert["objective"] = pref.objective
    if pref.dpo:
        job.convert["dpo"] = dict(pref.dpo)
    job.not_carried += pref.not_carried
    job.unconvertible = pref.unconvertible
    needs = objectives.get(pref.objective).reference and not pref.precompute
    job.reference = pref.reference if needs else None
    if job.reference is not None and job.reference.model and job.reference.model != job.model:
        job.not_carried.append(f"reference model {job.reference.model} not carried: shardfit's reference is the "
                               "model it starts from (`model:`); train from that checkpoint, or drop the setting")
