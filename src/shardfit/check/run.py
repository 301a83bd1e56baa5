"""Run the preflight rules: on a weightless (meta) model for `shardfit check`, on the real one inside `train`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardfit.check import rules
from shardfit.check.findings import Finding
from shardfit.errors import UserError


def preflight(model: nn.Module, cfg: Any, strategy: str, world: int, plan: dict | None, fix: bool) -> list[Finding]:
    """Every rule that needs no placed model (config, unused modules, FSDP units, precision, checkpointing)."""
    out = rules.device_map_rules(cfg, strategy, world)
    out += rules.unused_module_rules(model, strategy, fix)
    out += rules.fsdp_unit_rules(model, strategy, cfg.precision, fix)
    out += rules.grad_ckpt_rules(model, cfg)
    out += rules.reentrant_ckpt_rules(model, strategy, fix)
    out += rules.precision_rules(model, cfg, fix)
    out += rules.visible_gpu_rules(strategy, world)
    out += rules.plan_rules(plan, strategy, cfg.force)
    return out


def meta_model(cfg: Any) -> nn.Module:
    """The config's model with its trainable setup, built on the meta device: structure only, no memory."""
    from transformers import AutoConfig

    from shardfit.models.adapters import apply_freeze, apply_lora
    from shardfit.models.load import DTYPES, build_from_config
    from shardfit.models.source import resolve_model

    source = resolve_model(cfg.model)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if Path(source.folder).is_dir():
        config = AutoConfig.from_pretrained(source.folder, **kwargs)
    else:
        config = _hub_config(cfg.model, kwargs)
    dtype = torch.float32 if cfg.method == "full" else DTYPES[cfg.precision]
    with torch.device("meta"):
        model = build_from_config(config, dtype, cfg.trust_remote_code)
    if cfg.method in ("lora", "qlora"):
        model = apply_lora(model, cfg.lora)
    elif cfg.method == "freeze":
        model = apply_freeze(model, cfg.freeze_trainable)
    return model


def _hub_config(model_id: str, kwargs: dict[str, Any]) -> Any:
    """A hub id's config without the network: the local HF cache, else the bundled catalog's shape as a plain
    decoder (the text model: what the sharding, precision and memory rules look at)."""
    from transformers import AutoConfig

    from shardfit.plan.shapes import catalog, resolve_shape
    from shardfit.plan.simulate import hf_config_for

    try:
        return AutoConfig.from_pretrained(model_id, local_files_only=True, **kwargs)
    except OSError:
        if model_id in catalog():
            return hf_config_for(resolve_shape(model_id), None)
    raise UserError(f"'model': {model_id} is neither a local folder, in the Hugging Face cache, nor in shardfit's "
                    "catalog (shardfit/plan/catalog.yaml); download it first (huggingface-cli download) or point "
                    "at its config.json folder.")


def check_config(cfg: Any, world: int | None = None, hw: Any = None) -> tuple[str, list[Finding]]:
    """Findings for a config as its strategy would run it on `hw` (default: this machine); returns (strategy,
    findings). `world` defaults to every GPU of `hw` for multi-rank strategies."""
    from shardfit.check.rules import MULTI_RANK
    from shardfit.plan.build import make_plan
    from shardfit.plan.choose import shape_of_config, workload_of
    from shardfit.plan.hardware import detect

    hw = hw or detect()
    strategy = cfg.strategy
    if world is None:
        world = hw.world if strategy in MULTI_RANK or strategy == "auto" else 1
    model = meta_model(cfg)
    plan = None
    try:
        shape, _ = shape_of_config(cfg)
        # model_parallel is one process over every local GPU; the others use one GPU per rank.
        per_node = hw.gpus_per_node if strategy == "model_parallel" else max(world // hw.nodes, 1)
        plan = make_plan(shape, workload_of(cfg), dataclasses.replace(hw, gpus_per_node=per_node))
    except UserError:  # a shape the planner cannot read: the other rules still run
        plan = None
    if strategy == "auto":
        strategy = (plan or {}).get("recommended") or ("single" if world == 1 else "zero3")
    findings = preflight(model, cfg, strategy, world, plan, fix=False)
    # On a meta-built model anything that is NOT meta was created on a real device by the model's own code:
    # exactly the buffers that ZeRO-3 would leave behind on the CPU.
    real = [(n, b) for n, b in list(model.named_parameters()) + list(model.named_buffers()) if not b.is_meta]
    if real:
        findings.append(Finding("buffer_on_wrong_device", "error", real[0][0],
                                f"{len(real)} tensors are created on {real[0][1].device} by the model's code "
                                f"(e.g. {real[0][0]}), outside the placement of weights: under ZeRO-3 they stay there",
                                "shardfit moves buffers to the rank's device before training", True))
    return strategy, findings


def format_findings(strategy: str, findings: list[Finding]) -> str:
    if not findings:
        return f"ok: no findings (strategy {strategy})"
    lines = [f"strategy {strategy}: {len(findings)} finding(s)"]
    for f in findings:
        mark = "fixed" if f.auto_fixed else f.severity
        lines.append(f"  [{mark:>7}] {f.rule} at {f.where}\n            {f.message}\n            fix: {f.fix}")
    return "\n".join(lines)
