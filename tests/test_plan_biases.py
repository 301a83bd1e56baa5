"""The attention's and experts' biases and q/k norms the planner counts, family by family, against the model
transformers builds: Qwen2-MoE's qkv_bias (on by default, though its published config.json leaves it out), Qwen2's
q/k/v biases (no key says them), attention_bias on the output projection where the family puts one there, gpt-oss's
sinks and its experts' and router's biases, Qwen3's and OLMo 2's q/k norms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.shapes import hf_config, resolve_shape

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, pad_token_id=0)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)


def _built(config: Any) -> int:
    """The parameters transformers' causal LM of `config` holds (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_a_default_qwen2_moe_config_json_counts_its_qkv_biases(tmp_path: Path) -> None:
    """Qwen2-MoE's class turns qkv_bias on by default; the planner ignored it: 6,144 parameters a block short."""
    config = CONFIG_MAPPING["qwen2_moe"]()
    written = {k: v for k, v in config.to_dict().items() if k != "qkv_bias"}  # as Qwen1.5-MoE's file: no key
    (tmp_path / "config.json").write_text(json.dumps(written))
    shape = resolve_shape(str(tmp_path))
    assert shape.attn_bias and not shape.o_bias
    assert shape.params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("qwen2_moe", dict(QWEN2_MOE, qkv_bias=False)),
    ("qwen2_moe", QWEN2_MOE),
    ("qwen2", {}),  # q/k/v biases whatever the config says
    ("llama", dict(attention_bias=True)),  # q/k/v and o
    ("granitemoe", dict(attention_bias=True, num_local_experts=4, num_experts_per_tok=2)),
    ("glm4_moe", dict(attention_bias=True, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1,
                      use_qk_norm=False)),  # q/k/v only
    ("gpt_oss", dict(num_local_experts=4)),  # q/k/v/o, sinks, the experts' and the router's biases
    ("seed_oss", dict(attention_bias=True, attention_out_bias=False)),  # q/k/v only
    ("seed_oss", dict(attention_bias=False, attention_out_bias=True)),  # o only
])
def test_biases_count_the_built_model(model_type: str, keys: dict[str, Any]) -> None:
    """The count of a tiny config of each family is the built model's to the parameter (before: Qwen2-MoE's and
    Qwen2's q/k/v biases, the output projection's bias under attention_bias, and gpt-oss's sinks and expert
    biases were left out)."""
    config = CONFIG_MAPPING[model_type](**SMALL, **keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("qwen3", {}),  # one head's width for q and one for k
    ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)),
    ("olmo2", {}),  # q and k normalized across all heads
    ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
])
def test_qk_norms_count_the_built_model(model_type: str, keys: dict[str, Any]) -> None:
    """The q and k norms of Qwen3's and OLMo 2's attention are the built model's weights too (before: left out,
    256 parameters a block of a default Qwen3, 8,192 of a default OLMo 2)."""
    config = CONFIG_MAPPING[model_type](**SMALL, **keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2-1.5B",
                                   "Qwen/Qwen1.5-0.5B", "Qwen/Qwen2.5-Coder-7B-Instruct"])
def test_a_compact_qwen2_catalog_entry_counts_its_qkv_biases(model: str) -> None:
    """A catalog Qwen2-family id counts as the Qwen2 model built from its shape (plan/shapes.py `hf_config`), q/k/v
    biases included (before: left out, 0.002 % short)."""
    shape = resolve_shape(model)
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(shape)).parameters())
    assert shape.params() == built


@pytest.mark.parametrize(("model", "declared"), [("mistralai/Mistral-7B-v0.1", False),
                                                 ("mistralai/Mistral-Nemo-Base-2407", False),
                                                 ("meta-llama/Llama-3.1-8B", True)])
def test_a_compact_entrys_config_holds_only_keys_its_class_declares(model: str, declared: bool) -> None:
    """Mistral's config class has no attention_bias (its projections are bias-free): hf_config set one anyway,
    an attribute the model never reads; Llama's declares it, and gets the entry's."""
    config = hf_config(resolve_shape(model))
    assert ("attention_bias" in config.to_dict()) is declared
    if declared:
        assert config.attention_bias is resolve_shape(model).attn_bias
