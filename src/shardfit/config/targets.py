"""LoRA targets that name no module of any model, as peft reads a list of them: shardfit's own `lora.targets`
and the other tools' target keys (foreign/targets.py) are refused by this one rule before a run would fail in
peft's "Target modules ... not found"."""

from __future__ import annotations

import re

# A module name is dotted identifiers (`model.layers.0.self_attn.q_proj`).
MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# The projections' short names (workload.LORA_TARGETS): peft compares whole dotted parts, so `q` is no q_proj.
SHORT_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def names_no_module(entry: str) -> bool:
    """Whether a list entry of targets matches no module of a transformers decoder's blocks whatever the model:
    it is no module name (`q_proj,v_proj`, `.*\\.q_proj`: a list entry is no regular expression), or a
    projection's short name, bare or under self_attn/mlp (`q`, `self_attn.q`), except `gate` and `mlp.gate`: a
    mixture's router (Qwen-MoE's, Mixtral's, DeepSeek's `mlp.gate`)."""
    if not MODULE_NAME.fullmatch(entry):
        return True
    head, _, last = entry.rpartition(".")
    if last == "gate" and head in ("", "mlp"):
        return False
    return last in SHORT_NAMES and head in ("", "self_attn", "mlp")


def targets_fix(entries: list[str]) -> str:
    """What to give instead of entries that name no module: the projections the short names mean, and a list of
    names for what is no name."""
    names = [t for t in entries if MODULE_NAME.fullmatch(t)]
    longer = [f"{t}_proj" if t.rpartition(".")[2] in SHORT_NAMES else t for t in names]
    out = f"Name the projections: {', '.join(longer)}." if longer != names else ""
    odd = [t for t in entries if not MODULE_NAME.fullmatch(t)]
    if odd:
        out += (f" {odd[0]!r} is no module name (a name is dotted letters, digits and _; a list entry is not a "
                f"regular expression, and one string holds one name): give a list of names such as "
                f"[q_proj, v_proj].")
    return out.strip()


def targets_problem(targets: str | list[str]) -> str | None:
    """What is wrong with a list of LoRA targets whatever the model, or None: entries that name no module. The one
    rule for shardfit's own `lora.targets` and the other tools' target keys (foreign/targets.py), which both exit
    2 on it: a list whose entries all name no module makes peft raise; one of several is skipped silently by peft,
    so it is refused too (the run would train fewer adapters than asked). A string is one regular expression,
    which only a model's module names can judge."""
    if isinstance(targets, str):
        return None
    bad = [t for t in targets if names_no_module(t)]
    if not bad:
        return None
    verb = "names" if len(bad) == 1 else "name"
    return (f"has {', '.join(bad)}, which {verb} no module: peft matches a list entry on the end of a module's "
            f"name (model.layers.0.self_attn.q_proj), so the run would fail or skip it. {targets_fix(bad)}")
