"""The modules a tool puts LoRA adapters on (axolotl's `lora_target_modules`, LLaMA-Factory's `lora_target`,
ms-swift's `--target_modules`, peft's `target_modules`), planned as the adapters on those modules only.

Targets are matched as peft matches them, on the module names of the job's own model: a list entry names the
modules whose name is it or ends with "." and it (`q_proj`, `self_attn.q_proj`; `q` is no suffix of `q_proj`), a
string is one regular expression that must match a module's whole name."""

from __future__ import annotations

import dataclasses
import re

from shardfit.errors import UserError
from shardfit.foreign.job import ForeignJob
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import LORA_TARGETS


def block_modules(shape: ModelShape) -> dict[str, list[str]]:
    """The projections of `shape`'s decoder blocks that the planner counts adapters on (LORA_TARGETS names), each
    with its module names as transformers builds the model: `model.layers.N.self_attn.q_proj` for a text model,
    under `model.language_model` for one with a vision or audio tower; an MLP of two matrices has no gate_proj."""
    prefix = "model.language_model.layers" if shape.multimodal else "model.layers"
    out = {}
    for name in LORA_TARGETS:
        if name == "gate" and shape.two_matrix:
            continue
        parent = "self_attn" if name in ("q", "k", "v", "o") else "mlp"
        out[name] = [f"{prefix}.{i}.{parent}.{name}_proj" for i in range(shape.layers)]
    return out


def _matches(target: str, module: str) -> bool:
    """peft's rule for one entry of a list of target modules."""
    return module == target or module.endswith("." + target)


def plan_targets(job: ForeignJob, key: str, targets: str | list[str], shape: ModelShape) -> str:
    """Plan the job's adapters on `targets` (module names, or one regular expression over them as peft reads a
    string; not all-linear) of `shape`'s modules, and return the effect the plan shows beside `key`. Targets that
    reach none of the projections the planner counts (other modules, a pattern over another model's names) leave
    the adapters on every linear layer, said in a note, and return "" (the key is then not modelled). A list whose
    every entry is a projection's short name that matches nothing (`q` for `q_proj`) is a UserError: peft refuses
    targets that match no module."""
    modules = block_modules(shape)
    if isinstance(targets, str):
        try:
            rx = re.compile(targets)
        except re.error as e:  # peft would fail on it when it builds the adapters
            raise UserError(f"{job.source}: {key} {targets!r} is not a regular expression ({e}); give module names "
                            f"or a valid regular expression over module names.") from None
        planned = tuple(n for n, names in modules.items() if any(rx.fullmatch(m) for m in names))
        missed: list[str] = []
        unknown = not planned
    else:
        planned = tuple(n for n, names in modules.items() if any(_matches(t, m) for t in targets for m in names))
        missed = [t for t in targets if not any(_matches(t, m) for names in modules.values() for m in names)]
        unknown = any(t.split(".")[-1] not in LORA_TARGETS for t in missed)
    shown = targets if isinstance(targets, str) else ", ".join(targets)
    if unknown or not planned and not missed:
        example = modules[next(iter(modules))][0]
        what = "matches none" if isinstance(targets, str) else "names modules beyond those"
        job.notes.append(f"{key} {shown}: {what} of the q/k/v/o/gate/up/down projections of {job.model}'s blocks "
                         f"(named as {example}); planned as adapters on every linear layer (an over-estimate; peft "
                         f"refuses targets that match no module of the model at all)")
        return ""
    if missed:
        fix = ", ".join(f"{t}_proj" if t in LORA_TARGETS else t for t in missed)
        if not planned:
            example = modules.get(missed[0].split(".")[-1], next(iter(modules.values())))[0]
            raise UserError(f"{job.source}: {key} {shown} matches no module of {job.model}: peft matches a name on "
                            f"the module name's last parts ({example}), and refuses "
                            f"targets that match none. Name the projections: {fix}.")
        job.notes.append(f"{key}: {', '.join(missed)} matches no module (peft compares the end of the module's "
                         f"name: {fix}), so peft adapts only the others")
    job.workload = dataclasses.replace(job.workload, lora_targets=planned)
    on = ", ".join(f"{name}_proj" for name in planned)
    if isinstance(targets, str):
        return f"a regular expression: adapters on {on} of every block it names"
    return f"adapters on {on}"
