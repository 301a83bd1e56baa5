"""The preflight's rules for a mixture of experts: LoRA aimed at a router, routers that train with no
load-balancing loss, QLoRA of fused experts. Each fires on a setup that has the problem and stays silent on a
correct one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from shardfit.check.findings import is_ok
from shardfit.check.moe_rules import aux_loss_rules, quantized_expert_rules, router_lora_rules
from shardfit.config import Config, LoraSettings
from shardfit.errors import UserError
from shardfit.models.adapters import apply_lora, freeze_modules
from tests.families import make_family_model, tiny_text_config
from tests.helpers import run_cli, write_config


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


def test_qlora_of_fused_experts_is_a_finding() -> None:
    found = quantized_expert_rules(_model("gpt-oss"), _cfg("qlora"))
    assert [f.rule for f in found] == ["qlora_fused_experts"] and not is_ok(found)
    assert "of its parameters" in found[0].message and "method: lora" in found[0].fix
    assert quantized_expert_rules(_model("gpt-oss"), _cfg("lora")) == []
    assert quantized_expert_rules(_model("Qwen3 (dense)"), _cfg("qlora")) == []


@pytest.mark.slow
def test_check_and_train_refuse_qlora_of_experts_with_the_finding(tmp_path: Path, tokenizer_dir: Path,
                                                                  small_data: Path) -> None:
    model = make_family_model("Qwen3-MoE", tmp_path / "moe", tokenizer_dir)
    cfg = write_config(tmp_path / "c.yaml", model=str(model), data=str(small_data), method="qlora",
                       precision="fp32", max_seq_len=256, max_steps=1, strategy="single",
                       output_dir=str(tmp_path / "run"))
    r = run_cli("check", str(cfg), "--json", timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    found = {f["rule"]: f for f in json.loads(r.stdout)["findings"]}
    assert found["qlora_fused_experts"]["severity"] == "error"
    r = run_cli("train", str(cfg), timeout=300)
    assert r.returncode == 2 and "qlora_fused_experts" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
