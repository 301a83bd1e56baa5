"""The planner's parameter count of a config.json, family by family, against the model transformers builds from the
same config on the meta device (no memory): two-matrix MLPs, LayerNorms' and MLPs' biases, parallel blocks' single
norm, Falcon's multi-query heads, ERNIE 4.5's expert keys, MLA's and gated attention's biases (plan/family_rules.py,
plan/config_shape.py), Pixtral's vision tower, and what a gpt-oss token computes with (only its top-k experts'
biases)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.plan.adapters import lora_params
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.flops import linear_flops_per_token
from shardfit.plan.workload import Workload

# Two blocks and a small vocabulary keep each build well under half a second; every other size is the family's
# default, so the widths and the keys that say biases are the class's own.
FEW = dict(num_hidden_layers=2, vocab_size=512)
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, pad_token_id=0)


def _model(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _built(config: Any) -> int:
    """The parameters transformers' causal LM of `config` holds."""
    return sum(p.numel() for p in _model(config).parameters())


@pytest.mark.parametrize(("model_type", "keys"), [
    ("gpt_neox", FEW),  # LayerNorm biases, fc biases, fused qkv and dense biases (before: 32 % high)
    ("gpt_neox", dict(FEW, attention_bias=False)),
    ("phi", FEW),  # one LayerNorm a block, biases everywhere, a biased head (before: 28 % high)
    ("starcoder2", FEW),  # use_bias on attention and MLP, LayerNorm biases (before: 37 % high)
    ("starcoder2", dict(FEW, use_bias=False)),
    ("falcon", FEW),  # parallel block with one LayerNorm, multi-query: one key/value head (before: 57 % high)
    ("falcon", dict(FEW, new_decoder_architecture=True, num_kv_heads=8, bias=True)),
    ("falcon", dict(FEW, parallel_attn=False)),
    # learned positions, out_proj's bias (before: 0.35 % low)
    ("gpt_neo", dict(FEW, num_layers=2, attention_types=[[["global", "local"], 1]])),
    ("ernie4_5_moe", FEW),  # moe_num_experts, moe_k, shared experts, score bias (before: 85 % low)
    ("ernie4_5_moe", dict(FEW, num_hidden_layers=4, moe_layer_start_index=1, moe_layer_end_index=2,
                          moe_layer_interval=2)),
    ("ernie4_5", dict(FEW, use_bias=True)),
    ("aria_text", FEW),  # moe_num_experts (before: 78 % low)
    ("persimmon", FEW),  # per-head q/k LayerNorms
    ("jais2", FEW),
    ("arcee", FEW),
    ("apertus", FEW),  # xIELU's two learned scalars, per-head q/k norms
    ("nanochat", FEW),  # norms without weights
    ("llama", dict(SMALL, mlp_bias=True)),
    # the MLP width its class derives from intermediate_size (2/3, rounded up to block_multiple_of), per-head q/k
    # norms (before: 39 % high)
    ("lfm2", FEW),
    ("lfm2", dict(FEW, intermediate_size=1000, block_ffn_dim_multiplier=1.5, block_multiple_of=64)),
    ("lfm2", dict(FEW, block_auto_adjust_ff_dim=False)),
    # mlp_layer_types: a dense MLP in the "dense" blocks, the mixture in the others (before: 76 % high)
    ("glm4_moe_lite", FEW),
    ("glm4_moe_lite", dict(FEW, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "dense"])),
    ("bitnet", FEW),  # sub-norms on the attention's output and the MLP's inner width (before: 0.013 % low)
    ("deepseek_v3", dict(FEW, attention_bias=True, n_routed_experts=4, first_k_dense_replace=1)),  # MLA's biases
    ("deepseek_v3", dict(FEW, attention_bias=True, q_lora_rank=None, n_routed_experts=4, first_k_dense_replace=1)),
    ("qwen3_next", dict(SMALL, num_hidden_layers=4, attention_bias=True, num_experts=4,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32,
                        linear_num_key_heads=2, linear_num_value_heads=4)),  # gated q's bias, twice as wide
])
def test_the_count_is_the_built_models(model_type: str, keys: dict[str, Any]) -> None:
    config = CONFIG_MAPPING[model_type](**keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("granitemoehybrid", FEW),  # Mamba-2 mixers, the shared MLP beside the experts (before: 4.1 % low)
    ("granitemoehybrid", dict(FEW, layer_types=["linear_attention", "full_attention"])),
    ("granitemoehybrid", dict(FEW, layer_types=["full_attention", "linear_attention"], num_local_experts=0)),
    ("granitemoehybrid", dict(FEW, mamba_proj_bias=True, mamba_conv_bias=False, mamba_n_groups=2)),
    ("falcon_h1", FEW),  # Mamba-2 beside attention in every block (before: 6.5 % low)
    ("falcon_h1", dict(FEW, mamba_rms_norm=True, projectors_bias=True, mamba_proj_bias=True, mamba_d_ssm=2048,
                       mamba_n_heads=32)),
    ("bamba", FEW),  # Mamba-2 mixers (before: 22 % low)
    ("bamba", dict(FEW, attn_layer_indices=[1])),
    # Mamba-1 mixers, mixtures every other block (before: 78 % high)
    ("jamba", dict(FEW, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, num_experts=4)),
    ("jamba", dict(FEW, attn_layer_period=2, attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0,
                   num_experts=4, mamba_proj_bias=True, mamba_conv_bias=False)),
])
def test_a_mamba_hybrid_counts_its_built_model(model_type: str, keys: dict[str, Any]) -> None:
    """A block that pairs a Mamba mixer (Mamba-1 in Jamba, Mamba-2 in the others) with an MLP or a mixture is
    counted with the mixer's own weights, not as an attention block's."""
    config = CONFIG_MAPPING[model_type](**keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("jamba", dict(FEW, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, num_experts=4)),
    ("granitemoehybrid", dict(FEW, layer_types=["linear_attention", "full_attention"])),
])
def test_a_mamba_hybrid_token_computes_with_its_mixers_and_top_k_experts(model_type: str,
                                                                         keys: dict[str, Any]) -> None:
    """A Mamba hybrid's active weights: all but the embedding, less the routed experts a token is not sent to."""
    config = CONFIG_MAPPING[model_type](**keys)
    model = _model(config)
    experts = config.num_experts if model_type == "jamba" else config.num_local_experts
    idle = (experts - config.num_experts_per_tok) / experts
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel() - idle * routed
    assert shape_from_config(config.to_dict(), model_type).active_params() == active


def test_a_gpt_oss_token_computes_with_its_top_k_experts_biases_only() -> None:
    """gpt-oss's active weights: all but the embedding, less the experts a token is not routed to, their weights
    and their biases (before: every expert's biases were counted active)."""
    config = CONFIG_MAPPING["gpt_oss"](**SMALL, num_local_experts=8, num_experts_per_tok=2)
    model = _model(config)
    idle = (config.num_local_experts - config.num_experts_per_tok) / config.num_local_experts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel() - idle * experts
    assert shape_from_config(config.to_dict(), "gpt_oss").active_params() == active


# Every causal-LM family whose two-block default config the planner counts to the parameter (the families this
# transformers builds fastest; tower-heavy ones are checked elsewhere): a guard that a rule for one family leaves
# the others' counts alone.
EXACT = ("apertus", "arcee", "aria_text", "cohere", "cohere2", "cohere2_moe", "cwm", "deepseek_v2", "deepseek_v3",
         "ernie4_5", "ernie4_5_moe", "exaone4", "falcon", "gemma", "gemma2", "gemma3_text", "glm4_moe", "gpt_neox",
         "gpt_oss", "granite", "granitemoe", "granitemoeshared", "helium", "hyperclovax", "internlm3", "iquestcoder",
         "jais2", "kolibri1", "llama", "llama4_text", "mellum", "minicpm3", "ministral3", "mistral", "mixtral",
         "nanochat", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phimoe", "qwen2", "qwen2_moe", "qwen3",
         "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "seed_oss", "solar_open", "stablelm",
         "starcoder2", "vaultgemma", "youtu")


@pytest.mark.parametrize("model_type", EXACT)
def test_each_default_family_counts_its_built_model(model_type: str) -> None:
    config = CONFIG_MAPPING[model_type](**FEW)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("mistral3", {}),  # Pixtral's tower with Mistral 3's norm, patch merger and two linears (before: 27 % low)
    ("mistral3", dict(multimodal_projector_bias=True, spatial_merge_size=1)),
    ("llava", dict(vision_config=dict(model_type="pixtral", num_hidden_layers=3))),  # Pixtral under LLaVA's linears
])
def test_a_pixtral_tower_counts_its_built_model(model_type: str, keys: dict[str, Any]) -> None:
    """The count of a Mistral 3 or LLaVA config with a Pixtral vision tower is the built model's to the parameter."""
    config = CONFIG_MAPPING[model_type](**dict(dict(text_config=dict(model_type="mistral", **FEW)), **keys))
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    assert shape_from_config(config.to_dict(), model_type).params() == built


MAMBA2, HYBRID = "linear_attention", "hybrid"


@pytest.mark.parametrize(("model_type", "keys"), [
    ("zamba", dict(FEW, num_hidden_layers=9)),  # one shared block for both hybrid blocks (before: 130 % high)
    ("zamba", dict(FEW, num_hidden_layers=9, mamba_proj_bias=True, mamba_conv_bias=False, num_key_value_heads=4)),
    ("zamba2", dict(FEW, num_hidden_layers=5, layers_block_type=[MAMBA2, HYBRID, MAMBA2, HYBRID, HYBRID])),
    ("zamba2", dict(FEW, num_hidden_layers=5, layers_block_type=[MAMBA2, HYBRID, MAMBA2, HYBRID, HYBRID],
                    num_mem_blocks=2, use_shared_attention_adapter=True, add_bias_linear=True)),
    ("zamba2", dict(FEW, num_hidden_layers=3, layers_block_type=[MAMBA2, HYBRID, HYBRID], num_mem_blocks=4,
                    num_key_value_heads=8)),  # more shared blocks than hybrid blocks: one each
])
def test_shared_transformer_blocks_count_once(model_type: str, keys: dict[str, Any]) -> None:
    """Zamba's and Zamba2's hybrid blocks share their transformer blocks' weights (counted once), each keeps its
    own linear and Zamba2's adapters; every block is a Mamba mixer without an MLP."""
    config = CONFIG_MAPPING[model_type](**keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("zamba2", dict(num_hidden_layers=5, layers_block_type=[MAMBA2, HYBRID, MAMBA2, HYBRID, HYBRID], num_mem_blocks=2,
                    use_shared_attention_adapter=True)),
    ("zamba2", dict(num_hidden_layers=5, layers_block_type=[MAMBA2, HYBRID, MAMBA2, HYBRID, HYBRID])),
    ("zamba", dict(num_hidden_layers=9)),  # x_proj and dt_proj are bare weights, not linear layers
])
def test_lora_adapts_each_use_of_a_shared_block(model_type: str, keys: dict[str, Any]) -> None:
    """PEFT wraps every hybrid block's copy of a shared block apart (the base weights are tied, the modules are
    not): all-linear LoRA adapts each copy's linears, its adapters' too, as peft resolves all-linear; the plan's
    count (plan/adapters.py `lora_params`) is what shardfit's LoRA trains, the Mamba mixers' out_proj left out."""
    config = CONFIG_MAPPING[model_type](**dict(FEW, **keys))
    peft_model = apply_lora(_model(config), LoraSettings(rank=8, targets="all-linear"))
    adapted = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(shape_from_config(config.to_dict(), model_type), Workload(lora_rank=8)) == adapted


def test_each_hybrid_block_computes_with_its_shared_block() -> None:
    """The time model's linear weights a token runs: every block's Mamba mixer, and in each hybrid block its shared
    block, its own linear and the one adapter set kept for it (before: the shared blocks were left out)."""
    keys = dict(FEW, num_hidden_layers=5, num_mem_blocks=2, use_shared_attention_adapter=True,
                layers_block_type=[MAMBA2, HYBRID, MAMBA2, HYBRID, HYBRID])
    config = CONFIG_MAPPING["zamba2"](**keys)
    model = _model(config)
    computed = 0
    for i, layer in enumerate(model.model.layers):
        modules = [m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and "adapter_list" not in n]
        if hasattr(layer, "shared_transformer"):
            block = layer.shared_transformer
            use = block.feed_forward.layer_dic[i]
            modules += [m for adapters in (block.feed_forward.gate_up_proj_adapter_list,
                                           block.self_attn.linear_q_adapter_list, block.self_attn.linear_k_adapter_list,
                                           block.self_attn.linear_v_adapter_list)
                        for m in adapters[use].modules() if isinstance(m, torch.nn.Linear)]
        computed += sum(m.in_features * m.out_features for m in modules)
    shape = shape_from_config(config.to_dict(), "zamba2")
    assert linear_flops_per_token(shape)[1] * shape.layers == computed


@pytest.mark.parametrize(("model_type", "keys"), [
    ("gpt2", dict(n_layer=2, vocab_size=512)),  # n_embd, n_head, n_positions, learned positions (before: refused)
    ("gpt2", dict(n_layer=2, vocab_size=512, n_inner=1024, n_embd=256, n_head=4)),
    ("gpt_bigcode", dict(n_layer=2, vocab_size=512)),  # multi_query: one key/value head
    ("gpt_bigcode", dict(n_layer=2, vocab_size=512, multi_query=False)),
    ("bloom", dict(n_layer=2, vocab_size=512)),  # the embedding's LayerNorm, ALiBi: no positions
    ("codegen", dict(n_layer=2, vocab_size=512, n_embd=256, n_head=4)),  # one norm a block, a biased head
    ("gptj", dict(n_layer=2, vocab_size=512, n_embd=256, n_head=4, n_inner=512)),
])
def test_sizes_by_gpt2_style_names_count_the_built_model(model_type: str, keys: dict[str, Any]) -> None:
    """A config.json that names its sizes `n_embd`, `n_head`, `n_layer`, `n_inner` (its class's attribute_map) is
    read and counted to the parameter, not refused for a missing num_attention_heads."""
    config = CONFIG_MAPPING[model_type](**keys)
    assert shape_from_config(config.to_dict(), model_type).params() == _built(config)


@pytest.mark.parametrize("use_head", [True, False])
def test_a_siglip_tower_counts_its_pooling_head_where_built(use_head: bool) -> None:
    """Gemma 3's SigLIP tower builds its pooling head under vision_use_head, on by the class's default (before:
    never counted, 7.1M short of a default Gemma 3)."""
    vision = dict(num_hidden_layers=2, vision_use_head=use_head)
    config = CONFIG_MAPPING["gemma3"](text_config=FEW, vision_config=vision)
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    assert shape_from_config(config.to_dict(), "gemma3").params() == built


@pytest.mark.parametrize("keys", [
    dict(global_head_dim=256),  # every block's heads as wide: the per-layer embeddings alone (before: 47 % low)
    dict(global_head_dim=256, vocab_size_per_layer_input=1000, hidden_size_per_layer_input=64),
    dict(global_head_dim=256, hidden_size_per_layer_input=0),  # no per-layer embeddings: four norms, q/k norms
])
def test_gemma4_per_layer_embeddings_count_the_built_model(keys: dict[str, Any]) -> None:
    """Gemma 4's per-layer embeddings (a second table, the hidden state's projection to it, and each block's gate
    and projection) are counted, and LoRA adapts their linear layers as all-linear finds them."""
    config = CONFIG_MAPPING["gemma4_text"](**FEW, **keys)
    model = _model(config)
    head = model.get_output_embeddings()
    adapted = sum(8 * (m.in_features + m.out_features) for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m is not head)
    shape = shape_from_config(config.to_dict(), "gemma4_text")
    assert (shape.params(), lora_params(shape, Workload(lora_rank=8))) == \
        (sum(p.numel() for p in model.parameters()), adapted)
