"""Preflight rules of multimodal models: what breaks or silently misbehaves when a VL or Omni model is sharded."""

from __future__ import annotations

from torch import nn

from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.models.anatomy import audio_units, vision_units
from shardfit.strategy import Strategy


def vision_unit_rules(model: nn.Module, cfg: Config, s: Strategy, fix: bool) -> list[Finding]:
    """A vision block or merger, or an audio tower layer, that mixes trainable and frozen weights (a partial
    freeze_modules pattern, or freeze_trainable reaching into a tower). FSDP1 and DeepSpeed ZeRO-3 refuse such a
    unit or train it wrongly; FSDP2 accepts it but reduces gradients for the whole unit. shardfit makes the unit
    uniform: frozen while freeze_vision_tower (freeze_audio_tower) is true, trainable otherwise."""
    if not s.sharded:
        return []
    return [f for f in (_uniform(vision_units(model), "vision", not cfg.freeze_vision_tower, s, fix,
                                 "freeze_vision_tower, train_projector (the merger), or freeze_modules patterns that "
                                 "name whole blocks (visual.blocks.0)"),
                        _uniform(audio_units(model), "audio", not cfg.freeze_audio_tower, s, fix,
                                 "freeze_audio_tower, or freeze_modules patterns that name whole layers "
                                 "(audio_tower.layers.0)"))
            if f is not None]


def _base_params(unit: nn.Module) -> list[nn.Parameter]:
    """A unit's own weights: LoRA adapters beside frozen weights are what LoRA is, not a mixed unit."""
    return [p for n, p in unit.named_parameters() if "lora_" not in n]


def _uniform(units: list[nn.Module], tower: str, train: bool, s: Strategy, fix: bool, how: str) -> Finding | None:
    mixed = [(i, u) for i, u in enumerate(units) if len({p.requires_grad for p in _base_params(u)}) > 1]
    if not mixed:
        return None
    if fix:
        for _, unit in mixed:
            for p in _base_params(unit):
                p.requires_grad_(train)
    names = ", ".join(f"{tower} unit {i} ({type(u).__name__})" for i, u in mixed[:3])
    return Finding(f"{tower}_unit_mixed_requires_grad", "warning", names,
                   f"{len(mixed)} {tower} FSDP unit(s) mix trainable and frozen weights under {s.name}; "
                   f"{'trained' if train else 'frozen'} whole (freeze_{tower}_tower: {str(not train).lower()})",
                   f"freeze or train whole {tower} blocks: {how}", fix)
