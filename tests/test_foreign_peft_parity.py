"""The planner's trainable parameters equal what peft 0.21 with transformers 5 trains on each mixture family, for
another tool's usual LoRA targets (all-linear, the seven projections, the attention alone): its rewrite of
transformers 4's expert names onto the fused weights (gate_up at twice the rank, Mixtral's w1/w3/w2, no adapters on
the dense layers' or shared experts' MLPs), and the families it does not rewrite (gpt-oss, Llama 4, Qwen2-MoE),
whose routed experts take no adapter from target_modules. Tiny models built on the meta device, counted by peft."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.foreign.job import ForeignJob
from shardfit.foreign.targets import plan_all_linear, plan_targets
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.estimate import trainable_params
from shardfit.plan.workload import Workload

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                    "interleave_moe_layer_step": 1, "moe_layers": [0, 1]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LISTS = {"all-linear": "all-linear", "seven": SEVEN, "attention": SEVEN[:4]}
RANK = 4


def _peft_count(config: object, targets: str | list[str]) -> int:
    """What peft trains on the model of `config`, built on the meta device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=targets))
    return sum(p.numel() for p in lora.parameters() if p.requires_grad)


def _planned(model_type: str, config: object, targets: str | list[str]) -> int:
    """The planner's trainable parameters for another tool's job with `targets` on that model."""
    version = transformers.__version__
    shape = shape_from_config({**config.to_dict(), "model_type": model_type}, f"tiny/{model_type}")
    job = ForeignJob(tool="axolotl", source="job.yml", model=f"tiny/{model_type}",
                     workload=Workload(method="lora", lora_rank=RANK))
    if targets == "all-linear":
        plan_all_linear(job, shape, version)
    else:
        plan_targets(job, "lora_target_modules", list(targets), shape, version)
    return trainable_params(shape, dataclasses.replace(job.workload))


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_planned_adapters_equal_what_peft_trains_on_each_mixture(model_type: str) -> None:
    """For each family and list, the plan's trainable parameters are peft's count on the same tiny model."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    for name, targets in LISTS.items():
        assert _planned(model_type, config, targets) == _peft_count(config, targets), (model_type, name)
