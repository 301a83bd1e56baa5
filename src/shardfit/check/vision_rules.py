"""Preflight rules of vision-language models: what breaks or silently misbehaves when a VL model is sharded."""

from __future__ import annotations

from torch import nn

from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.models.anatomy import vision_units
from shardfit.strategy import Strategy


def vision_unit_rules(model: nn.Module, cfg: Config, s: Strategy, fix: bool) -> list[Finding]:
    """A vision block or merger that mixes trainable and frozen weights (a partial freeze_modules pattern, or
    freeze_trainable reaching into the tower). FSDP1 and DeepSpeed ZeRO-3 refuse such a unit or train it
    wrongly; FSDP2 accepts it but reduces gradients for the whole unit. shardfit makes the unit uniform: frozen
    while freeze_vision_tower is true, trainable otherwise."""
    if not s.sharded:
        return []
    mixed = [(i, u) for i, u in enumerate(vision_units(model))
             if len({p.requires_grad for p in u.parameters()}) > 1]
    if not mixed:
        return []
    train = not cfg.freeze_vision_tower
    if fix:
        for _, unit in mixed:
            for p in unit.parameters():
                p.requires_grad_(train)
    names = ", ".join(f"vision unit {i} ({type(u).__name__})" for i, u in mixed[:3])
    return [Finding("vision_unit_mixed_requires_grad", "warning", names,
                    f"{len(mixed)} vision FSDP unit(s) mix trainable and frozen weights under {s.name}; "
                    f"{'trained' if train else 'frozen'} whole (freeze_vision_tower: {str(not train).lower()})",
                    "freeze or train whole vision blocks: freeze_vision_tower, train_projector (the merger), or "
                    "freeze_modules patterns that name whole blocks (visual.blocks.0)", fix)]
