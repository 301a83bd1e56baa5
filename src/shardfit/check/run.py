"""Run the preflight rules: on the weightless (meta) model for `shardfit check`, on the loaded one inside `train`.

Both build the model with `models.build.build_model` and run the same `preflight`, which fixes what it can (on a
meta model the fixes are only recorded), so `check` reports exactly the findings `train` applies.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from shardfit.check import rules
from shardfit.check.config_rules import device_map_rules, qlora_rules
from shardfit.check.findings import Finding
from shardfit.check.moe_rules import aux_loss_rules, quantized_expert_rules, router_lora_rules
from shardfit.check.vision_rules import vision_unit_rules
from shardfit.config import Config
from shardfit.data.dataset import encode_split, read_split
from shardfit.models.build import build_model, load_tokenizer
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel.env import cuda_available, resolve_precision
from shardfit.plan.choose import plan_for_config
from shardfit.plan.hardware import Hardware, detect, job_hardware
from shardfit.plan.plan import Plan
from shardfit.strategy import Strategy
from shardfit.strategy import get as get_strategy


def preflight(model: nn.Module, cfg: Config, s: Strategy, world: int, plan: Plan | None) -> list[Finding]:
    """Every rule that needs no placed model (config, unused modules, mixtures of experts, FSDP units, precision,
    checkpointing, the plan's verdict); each fixes what it can in place and says so."""
    out = device_map_rules(cfg, s, world) + qlora_rules(cfg, s)
    out += rules.unused_module_rules(model, s, fix=True)
    out += vision_unit_rules(model, cfg, s, fix=True)
    out += router_lora_rules(model, cfg) + aux_loss_rules(model, cfg) + quantized_expert_rules(model, cfg)
    out += rules.fsdp_unit_rules(model, s, cfg.precision, fix=True)
    out += rules.qlora_shard_rules(model, s, world)
    out += rules.grad_ckpt_rules(model, cfg)
    out += rules.reentrant_ckpt_rules(model, s, fix=True)
    out += rules.precision_rules(model, cfg, fix=True)
    out += rules.visible_gpu_rules(s, world)
    out += rules.plan_rules(plan, s, cfg.force)
    return out


def created_off_meta_rules(model: nn.Module) -> list[Finding]:
    """On a meta-built model, anything that is NOT meta was created on a real device by the model's own code:
    exactly the buffers that ZeRO-3 would leave behind on the CPU (train moves them to the rank's device)."""
    real = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    if not real:
        return []
    return [Finding("buffer_on_wrong_device", "error", real[0][0],
                    f"{len(real)} tensors are created on {real[0][1].device} by the model's code (e.g. {real[0][0]}), "
                    "outside the placement of weights: under ZeRO-3 they stay there",
                    "shardfit moves buffers to the rank's device before training", True)]


def validate_data(cfg: Config) -> None:
    """The data validation train runs before it loads the model: formats, and with a local tokenizer the chat
    template, truncation and max_bad_rows. A bad row is exit 2 here too."""
    split = read_split(cfg)
    source = resolve_model(cfg.model)
    if source.is_local:
        tokenizer = load_tokenizer(source, cfg.trust_remote_code)
        encode_split(cfg, tokenizer, split, load_vision_processor(source, cfg, tokenizer))


def job_plan(cfg: Config, hw: Hardware, strategy: str, world: int) -> Plan | None:
    """The plan of the job as it will run: model_parallel is one process over every local GPU; the other
    strategies use one GPU per rank."""
    if hw.name == "cpu":  # the processes of a CPU job share the host's memory
        return plan_for_config(cfg, job_hardware("cpu", world))
    per_node = hw.gpus_per_node if strategy == "model_parallel" else max(world // hw.nodes, 1)
    return plan_for_config(cfg, dataclasses.replace(hw, gpus_per_node=per_node))


def check_config(cfg: Config, world: int | None = None, hw: Hardware | None = None) -> tuple[str, list[Finding]]:
    """Findings for a config as its strategy would run it on `hw` (default: this machine); returns (strategy,
    findings). `world` defaults to every GPU of `hw` for multi-rank strategies."""
    if cfg.precision == "auto":  # planned GPUs compute in bf16; this machine's device decides for itself
        precision = "bf16" if hw is not None else resolve_precision("auto", "cuda" if cuda_available() else "cpu")
        cfg = dataclasses.replace(cfg, precision=precision)
    hw = hw or detect()
    multi = cfg.strategy == "auto" or get_strategy(cfg.strategy).multi_rank
    world = world if world is not None else (hw.world if multi else 1)
    plan = job_plan(cfg, hw, cfg.strategy, world)
    name = cfg.strategy
    if name == "auto":
        name = (plan.recommended if plan else None) or ("single" if world == 1 else "zero3")
    s = get_strategy(name)
    validate_data(cfg)
    model = build_model(cfg, s, weights=False)
    return name, preflight(model, cfg, s, world, plan) + created_off_meta_rules(model)


def format_findings(strategy: str, findings: list[Finding]) -> str:
    if not findings:
        return f"ok: no findings (strategy {strategy})"
    lines = [f"strategy {strategy}: {len(findings)} finding(s)"]
    for f in findings:
        mark = "fixed" if f.auto_fixed else f.severity
        lines.append(f"  [{mark:>7}] {f.rule} at {f.where}\n            {f.message}\n            fix: {f.fix}")
    return "\n".join(lines)
