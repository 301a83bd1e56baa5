"""Preflight rules of a mixture of experts: the traps of fine-tuning one that train without an error and leave a
model that routes badly, or that do not fit where the plan said they would."""

from __future__ import annotations

from torch import nn

from shardfit import method as methods
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.models.anatomy import base_model
from shardfit.models.experts import aux_loss_of, balancing_loss_fn, moe_parts, router_targets


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
    """QLoRA of a mixture: shardfit stores linear layers in NF4, not the experts' fused 3-D weights, which hold
    most of an MoE's parameters. They would stay in 16 bits while the plan counts them in 4, so the run would need
    several times the memory planned: refused."""
    if cfg.method != "qlora":
        return []
    base = base_model(model)
    parts = moe_parts(base)
    if not parts.any:
        return []
    fused = sum(p.numel() for e in parts.experts for p in base.get_submodule(e).parameters(recurse=False)
                if p.dim() == 3)
    total = sum(p.numel() for p in base.parameters())
    return [Finding("qlora_fused_experts", "error", f"{parts.experts[0]} ({len(parts.experts)} expert modules)",
                    f"method qlora stores linear layers in 4 bits, but this model's routed experts are fused 3-D "
                    f"weights ({fused / total:.0%} of its parameters), which shardfit cannot store in NF4: they "
                    "would stay in 16 bits, several times the memory the plan counts for them",
                    "method: lora (the experts in 16 bits; strategy zero3 shards them over the GPUs); plan it with "
                    "shardfit plan --method lora")]
