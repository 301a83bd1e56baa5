"""LoRA targets that name no module, as peft reads a list of them: one rule for shardfit's own `lora.targets` and
the other tools' target keys (foreign/targets.py). peft refuses a list only when no entry matches a module
("Target modules ... not found") and skips an entry that matches nothing beside others that do; each caller says
by `skip_partial` whether such a partial miss is refused (shardfit's own config: the run would train fewer
adapters than asked) or planned as peft runs it, with a note (another tool's job, which peft trains)."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class TargetsProblem:
    """Entries of a list of targets that match no module: `message` says which and why; `refused` whether the
    caller exits 2 on it (else the plan keeps the entries that match and shows the message as a note)."""

    message: str
    refused: bool


def unmatched(entries: list[str], missed: list[str], why: str, *, skip_partial: bool) -> TargetsProblem | None:
    """The verdict on `missed`, the entries of `entries` that match no module (`why`: the reason, ending in a
    sentence), or None when none missed. With `skip_partial` (another tool's job) it is refused only when every
    entry missed, as peft raises then; a partial miss is a note, since peft skips those entries and trains the
    rest. Without it (shardfit's own `lora.targets`) any miss is refused."""
    if not missed:
        return None
    if skip_partial and len(set(missed)) < len(set(entries)):
        return TargetsProblem(f"{why} peft skips {', '.join(missed)} (it refuses a list only when no entry "
                              f"matches): planned on the other entries only", refused=False)
    return TargetsProblem(why, refused=True)


def targets_problem(targets: str | list[str], *, skip_partial: bool) -> TargetsProblem | None:
    """What is wrong with a list of LoRA targets whatever the model, or None: entries that name no module (`q` for
    q_proj, `q_proj,v_proj` as one name), judged by `unmatched` (`skip_partial`: peft's rule, for another tool's
    job; without it every such entry is refused). A string is one regular expression, which only a model's module
    names can judge."""
    if isinstance(targets, str):
        return None
    bad = [t for t in targets if names_no_module(t)]
    verb = "names" if len(bad) == 1 else "name"
    why = (f"has {', '.join(bad)}, which {verb} no module: peft matches a list entry on the end of a module's "
           f"name (model.layers.0.self_attn.q_proj), so the run would fail or skip it. {targets_fix(bad)}")
    return unmatched(targets, bad, why, skip_partial=skip_partial)
