"""The modules a tool puts LoRA adapters on (axolotl's `lora_target_modules`, LLaMA-Factory's `lora_target`,
ms-swift's `--target_modules`), planned as the adapters on those modules only."""

from __future__ import annotations

import dataclasses
import re

from shardfit.errors import UserError
from shardfit.foreign.job import ForeignJob
from shardfit.plan.workload import lora_targets_of


def plan_targets(job: ForeignJob, key: str, targets: str | list[str]) -> str:
    """Plan the job's adapters on `targets` (module names, or one regular expression over them as peft reads a
    string; not all-linear) and return the effect the plan shows beside `key`. Names the planner does not know
    leave the adapters on every linear layer, said in a note, and return "" (the key is then not modelled)."""
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:  # peft would fail on it when it builds the adapters
            raise UserError(f"{job.source}: {key} {targets!r} is not a regular expression ({e}); give module names "
                            f"or a valid regular expression over module names.") from None
    planned = lora_targets_of(targets)
    shown = targets if isinstance(targets, str) else ", ".join(targets)
    if planned is None:
        job.notes.append(f"{key} {shown}: no q/k/v/o/gate/up/down projection the planner knows by these names; "
                         "planned as adapters on every linear layer (an over-estimate)")
        return ""
    job.workload = dataclasses.replace(job.workload, lora_targets=planned)
    on = ", ".join(f"{name}_proj" for name in planned)
    if isinstance(targets, str):
        return f"a regular expression: adapters on {on} of every block it names"
    return f"adapters on {on}"
