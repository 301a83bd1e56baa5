"""Preflight rules of a mixture of experts: the traps of fine-tuning one that train without an error and leave a
model that routes badly, or that do not fit where the plan said they would."""

from __future__ import annotations

from torch import nn

from shardfit import method as methods
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.models.anatomy import base_model
from shardfit.models.experts import aux_loss_of, balancing_loss_fn, moe_parts, router_targets
from shardfit.plan.quant import quantizable


def router_lora_rules(model: nn.Module, cfg: Config) -> list[Finding]:
    """`lora.targets` that name a router. An adapted router changes which experts every token reaches, and peft
    0.21 would put one on it; shardfit never adapts routers (models/experts.py), so the named ones are left out."""
    if not methods.get(cfg.method).adapters:
        return []
    named = router_targets(cfg.lora.targets, moe_parts(base_model(model)))
    if not named:
        return []
    leaf = named[0].rpartition(".")[2]
    return [Finding("lora_on_router", "warning", f"config: lora.targets ({named[0]}, {len(named)} in all)",
                    f"lora.targets names the routers ('{leaf}'); an adapter there changes which experts each token "
                    "is sent to, which the experts were never trained for, and the load balance with it. shardfit "
                    "leaves routers without adapters",
                    f"remove '{leaf}' from lora.targets (the routers stay frozen under LoRA)", True)]


def aux_loss_rules(model: nn.Module, cfg: Config) -> list[Finding]:
    """A full fine-tune that trains the routers with no load-balancing loss: nothing keeps the tokens spread over
    the experts, and routing can collapse onto a few of them (the others stop learning, the busy ones become
    the step's bottleneck under expert parallelism)."""
    base = base_model(model)
    parts = moe_parts(base)
    if cfg.method != "full" or not parts.any or aux_loss_of(base, base.config) is not None:
        return []
    trained = [r for r in parts.routers if any(p.requires_grad for p in base.get_submodule(r).parameters())]
    if not trained:
        return []
    leaf = trained[0].rpartition(".")[2]
    if balancing_loss_fn(base) is not None:
        why = ("its config sets router_aux_loss_coef to 0, so the family's load-balancing loss is off (shardfit "
               "adds it with the config's coefficient, whatever output_router_logits says)")
        fix = (f"set router_aux_loss_coef in the model's config.json (the family's published value, e.g. 0.001), "
               f"or keep the routers frozen: freeze_modules: [{leaf}]")
    else:
        why = ("its transformers model has no load-balancing loss (DeepSeek-V3 and GLM-4.5 balance with a bias "
               "that only their own pre-training updates; Llama 4's config names a coefficient its code never uses)")
        fix = f"keep the routers frozen: freeze_modules: [{leaf}]; and watch expert_load_min / max in metrics.jsonl"
    return [Finding("moe_no_load_balancing", "warning", f"{trained[0]} ({len(trained)} routers)",
                    f"the routers train with nothing to keep the load even: {why}. Tokens can collapse onto a few "
                    "experts; expert_load_min / expert_load_max in metrics.jsonl show it (1.0 is even)", fix)]


def quantized_expert_rules(model: nn.Module, cfg: Config) -> list[Finding]:
    """QLoRA of a mixture stores each fused expert stack in NF4 (models/quantize_experts.py) when it is a whole
    number of 64-element blocks; one that is not stays in 16 bits (the plan counts it so too). Reported, since the
    experts hold most of a mixture's weights: the run needs more memory than 4-bit experts would."""
    if cfg.method != "qlora":
        return []
    base = base_model(model)
    parts = moe_parts(base)
    dense = [(f"{e}.{n}", p) for e in parts.experts for n, p in base.get_submodule(e).named_parameters(recurse=False)
             if p.dim() == 3 and not quantizable(p.shape[0] * p.shape[1], p.shape[2])]
    if not dense:
        return []
    name, p = dense[0]
    kept = str(p.dtype).removeprefix("torch.")
    return [Finding("qlora_experts_not_4bit", "warning", f"{name} ({len(dense)} expert weights)",
                    f"method qlora stores expert weights in 4 bits in blocks of 64 values, but {list(p.shape)} "
                    f"({p.numel()} values) is not whole blocks: these experts stay in {kept} "
                    "(the plan counts them so)",
                    "nothing to do for a published model (their widths are whole blocks); for a custom one, an "
                    "expert width whose weights are multiples of 64 values; or method: lora")]
