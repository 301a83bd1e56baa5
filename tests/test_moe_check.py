"""The preflight's rules for a mixture of experts: LoRA aimed at a router, routers that train with no
load-balancing loss (QLoRA's expert stacks that are not whole 4-bit blocks: tests/test_qlora_moe.py). Each fires
on a setup that has the problem and stays silent on a correct one."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from shardfit.check.findings import is_ok
from shardfit.check.moe_rules import aux_loss_rules, router_lora_rules
from shardfit.config import Config, LoraSettings
from shardfit.errors import UserError
from shardfit.models.adapters import apply_lora, freeze_modules
from tests.families import tiny_text_config


def _model(family: str, **config):
    c = tiny_text_config(family)
    for k, v in config.items():
        setattr(c, k, v)
    return AutoModelForCausalLM.from_config(c)


def _cfg(method: str, targets: str | list[str] = "all-linear") -> Config:
    return Config(model="tiny", data="rows.jsonl", method=method, lora=LoraSettings(rank=4, targets=targets))


@pytest.mark.parametrize("targets", [["q_proj", "gate"], r".*\.(q_proj|gate)"])
def test_lora_targets_naming_a_router_are_reported_and_left_out(targets: str | list[str]) -> None:
    cfg = _cfg("lora", targets)
    model = apply_lora(_model("Qwen3-MoE"), cfg.lora)
    assert not [n for n, _ in model.named_parameters() if ".gate.lora" in n]  # left out, as the finding says
    found = router_lora_rules(model, cfg)
    assert [f.rule for f in found] == ["lora_on_router"] and found[0].auto_fixed and is_ok(found)
    assert "'gate'" in found[0].message and "2 in all" in found[0].where
    assert router_lora_rules(apply_lora(_model("Qwen3-MoE"), LoraSettings(rank=4)), _cfg("lora")) == []
    assert router_lora_rules(_model("Qwen3 (dense)"), cfg) == []
    # Only routers named and the experts left out: nothing to adapt, and the message says why no router is.
    with pytest.raises(UserError, match="Routers never get adapters"):
        apply_lora(_model("Qwen3-MoE"), LoraSettings(rank=4, targets=["gate"], experts=False))


@pytest.mark.parametrize("family, config, why", [
    ("Qwen3-MoE", {"router_aux_loss_coef": 0.0}, "router_aux_loss_coef to 0"),
    ("DeepSeek-V3", {}, "has no load-balancing loss"),
    ("Llama 4 (text)", {}, "has no load-balancing loss"),
])
def test_full_fine_tune_without_load_balancing_is_warned(family: str, config: dict, why: str) -> None:
    model = _model(family, **config)
    found = aux_loss_rules(model, _cfg("full"))
    assert [f.rule for f in found] == ["moe_no_load_balancing"] and found[0].severity == "warning"
    assert why in found[0].message and "expert_load_max" in found[0].message and "freeze_modules" in found[0].fix
    # Silent: LoRA (routers frozen), the routers frozen by the fix, the family's own loss on.
    assert aux_loss_rules(model, _cfg("lora")) == []
    router = found[0].fix.rpartition("[")[2].rstrip("]").split("]")[0]
    freeze_modules(model, [router])
    assert aux_loss_rules(model, _cfg("full")) == []
    assert aux_loss_rules(_model("Qwen3-MoE"), _cfg("full")) == []


def test_lora_dropout_on_fused_experts_is_refused_by_its_key() -> None:
    """peft's adapters on fused expert weights (target_parameters) take no dropout: the refusal names
    lora.dropout and both ways out, not lora.targets as peft's own message would; without the experts the
    same dropout adapts the attention and trains."""
    with pytest.raises(UserError, match=r"'lora.dropout': 0.1 .*lora.dropout: 0, or lora.experts: false"):
        apply_lora(_model("Qwen3-MoE"), LoraSettings(rank=4, dropout=0.1))
    model = apply_lora(_model("Qwen3-MoE"), LoraSettings(rank=4, dropout=0.1, experts=False))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and not any(".experts." in n for n in trained)
