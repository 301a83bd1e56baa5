"""A ModelShape from a transformers config.json, whichever family wrote it.

Families name the same sizes differently; each key table below lists the names in the order they are tried, so a
new family is one more name in a table, not a new branch:
- experts: Mixtral / gpt-oss / Llama 4 `num_local_experts`, Qwen-MoE `num_experts`, DeepSeek / GLM-4.5
  `n_routed_experts`;
- one expert's width: `moe_intermediate_size` (Qwen-MoE, DeepSeek, GLM-4.5); Llama 4 names it
  `intermediate_size` and its dense MLP `intermediate_size_mlp`; Mixtral and gpt-oss have only `intermediate_size`;
- shared experts: `n_shared_experts` x the expert width (DeepSeek, GLM-4.5), `shared_expert_intermediate_size`
  (Qwen2-MoE), `shared_intermediate_size` (IBM Granite's shared MLP), one expert-wide shared MLP in every Llama 4
  mixture;
- dense blocks among the mixtures: `first_k_dense_replace` (DeepSeek, GLM-4.5), `mlp_only_layers` and
  `decoder_sparse_step` (Qwen-MoE), `moe_layers` or `interleave_moe_layer_step` (Llama 4);
- the text model of a multimodal config: `text_config`, or Qwen-Omni's `thinker_config.text_config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from shardfit.errors import UserError
from shardfit.plan.attention_layout import (
    CHUNK,
    FLASH_UNWINDOWED_TYPES,
    AttentionLayout,
    layout_of,
    odd_setting,
    text_of,
)
from shardfit.plan.audio import AudioShape, audio_shape_of
from shardfit.plan.family_rules import (
    FAMILIES,
    attention_bias_override,
    kv_heads_rule,
    norms_and_biases,
    per_head_qk_norm,
    pixtral_tower_params,
)
from shardfit.plan.loaded_config import distinct_block_heads, loads_text_only, rank_config, tied_of_config
from shardfit.plan.mamba_hybrid import mamba_hybrid_fields
from shardfit.plan.media import VisionShape, has_tower, soft_token_tower_of, vision_shape_of
from shardfit.plan.model_shape import MLA, BlockGroup, ModelShape
from shardfit.plan.sdpa_classes import runs_eager
from shardfit.plan.single_part import check_parts, part_groups, single_part_fields
from shardfit.plan.token_mixers import block_groups

EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k")
SHARED_EXPERTS = ("n_shared_experts", "moe_num_shared_experts")


# Families whose transformers experts run every token through every routed expert (plan/model_shape.py
# `every_expert`).
EVERY_EXPERT_TYPES = ("llama4", "llama4_text")
# Families whose experts run gpt-oss's clamped SwiGLU behind a top-k softmax router, and whose attention softmaxes
# over a sink logit per head (plan/model_shape.py `clamped_swiglu`, `attention_sinks`).
GPT_OSS_TYPES = ("gpt_oss",)
# Families this version of transformers may not know whose window, when set, covers every block (their classes
# lay out no pattern): the fallback for a model_type transformers cannot build (`unbuilt_layout`).
EVERY_BLOCK_TYPES = ("mistral", "mixtral", "phi3", "starcoder2")
# Families whose `linear_attention` blocks are transformers' Gated DeltaNet (Qwen3NextGatedDeltaNet,
# Qwen3_5GatedDeltaNet, OlmoHybridGatedDeltaNet) and whose softmax attention gates its output but OLMo hybrid's
# (plan/model_shape.py `linear_layers`, `gated_attention`); Qwen3-Next fuses the DeltaNet's input projections.
GATED_DELTANET_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid")
FUSED_DELTANET_TYPES = ("qwen3_next",)
# OLMo hybrid's Gated DeltaNet (OlmoHybridGatedDeltaNet) projects q, k and v apart under softmax attention's names
# (plan/model_shape.py `linear_split`); its softmax attention is OLMo 2's, ungated.
SPLIT_DELTANET_TYPES = ("olmo_hybrid",)
# Families whose softmax attention normalizes q and k: across all heads at once (OLMo 2's q_norm and k_norm over
# heads x head_dim), or one head's width shared by every head (Qwen3's).
QK_NORM_ALL_HEADS_TYPES = ("olmo2", "olmo3", "olmoe", "flex_olmo", "olmo_hybrid")
QK_NORM_PER_HEAD_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_omni_moe",
                          "qwen3_omni_moe_thinker", "qwen3_omni_moe_text")
# Families whose shared experts' output is scaled by a sigmoid gate (a hidden x 1 linear, `shared_expert_gate` in
# their modeling); other families with shared experts (laguna, flint, kolibri1, ...) add them ungated.
# Families whose router is DeepSeek-V3's (plan/model_shape.py `router_groups`): n_group groups of experts, the
# top-k of the best topk_group of them, the router run in fp32 over the upcast input.
GROUP_ROUTER_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm4v_moe_text",
                      "glm_moe_dsa", "glm5_next", "nemotron_h", "dots1", "exaone_moe", "solar_open", "mistral_large4",
                      "kimi_linear", "mimo_v2_flash")
SHARED_GATE_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text")
# Families whose MLP is two matrices (up, an activation, down) where ModelShape's is three (gate, up, down): planned
# as three of 2/3 the width, the same weights and FLOPs (plan/family_rules.py). A config.json may leave the width
# null for 4 x hidden.
TWO_MATRIX_MLP_TYPES = tuple(name for name, family in FAMILIES.items() if family.two_matrix)
# Families whose class ties the head to the embedding where the file does not say (besides Gemma's).
TIED_BY_DEFAULT_TYPES = ("gpt_neo", "gpt2", "gpt_bigcode", "bloom")
# Decoder families whose config.json names sizes by their own names, read through their class's attribute_map
# (GPT-Neo: `num_heads`, `num_layers`; GPT-2, GPT-BigCode, CodeGen, GPT-J: `n_embd`, `n_head`, `n_layer`,
# `n_positions`; BLOOM: `n_head`, `n_layer`). Only these: other classes' maps also rename sizes of encoders, towers
# and expert layouts this planner does not model.
ALIASED_TYPES = ("gpt_neo", "gpt2", "gpt_bigcode", "codegen", "gptj", "bloom")
# The names of a dense MLP's width, in the order they are tried (GPT-2's family: `n_inner`, null for 4 x hidden).
MLP_WIDTH = ("intermediate_size", "ffn_hidden_size", "n_inner")


# Families whose query, key and value projections always carry biases, whatever the config says (Qwen2 and the
# language models of Qwen2-VL, Qwen2.5-VL and Qwen2.5-Omni built on it); their output projection has none.
QKV_BIAS_TYPES = ("qwen2", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_5_omni_thinker",
                  "qwen2_5_omni_text")
# The keys by which the other families put biases on q/k/v: most families' attention_bias (which biases the output
# projection too, but in QKV_ONLY_BIAS_TYPES), Qwen2-MoE's qkv_bias (on by default) and StableLM's use_qkv_bias
# (neither biases the output projection); Seed-OSS biases its output projection by its own attention_out_bias.
QKV_BIAS_KEYS = ("attention_bias", "qkv_bias", "use_qkv_bias")
O_BIAS_KEY = "attention_out_bias"
QKV_ONLY_BIAS_TYPES = ("glm", "glm4", "glm4_moe", "glm4v", "glm4v_text", "glm4v_moe",
                       "glm4v_moe_text", "glm_image", "glm_image_text", "helium", "mimo_v2_flash", "molmo2",
                       "moonshine", "seed_oss", "solar_open")


def first_of(d: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    """The value of the first of `keys` that `d` holds and is not null."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: itself, `text_config`, or Qwen-Omni's thinker's."""
    nested = cfg.get("text_config") or (cfg.get("thinker_config") or {}).get("text_config") or cfg
    return nested if isinstance(nested, dict) else cfg


def tied_of(cfg: dict[str, Any], text: dict[str, Any], built: Any = None) -> bool:
    """Whether the head shares the embedding. Qwen-Omni: the thinker's own setting decides (its head is untied
    whatever its text config says). Any other model: the setting of the config the rank builds its model from
    (plan/loaded_config.py `rank_config` of its config class `built`, the file's keys with the class's defaults
    filling what the file leaves out): a multimodal model's top level whatever its text_config says, a text-only
    load's text_config (resolve/pipeline.py `facts_of_config` reads the loaded model's by the same rule). Without a
    class (a model_type this transformers does not know), a config without the key
    is read as its family's default: tied for Gemma and GPT-Neo, untied for the rest."""
    if built is not None and cfg.get("thinker_config") is None:
        return tied_of_config(rank_config(built))
    model_type = str(cfg.get("model_type", ""))
    default = model_type.startswith("gemma") or model_type in TIED_BY_DEFAULT_TYPES
    return bool(cfg.get("tie_word_embeddings", (cfg.get("thinker_config") or {}).get(
        "tie_word_embeddings", text.get("tie_word_embeddings", default))))


def moe_layer_flags(text: dict[str, Any], layers: int, experts: int, mlp_types: Any = None) -> list[bool]:
    """Which of `layers` blocks hold a mixture of experts, by whichever of the families' keys the config has: the
    class's `mlp_layer_types` (`mlp_types`: "dense" or a mixture's kind a block, GLM-4.7-Flash, Kimi Linear, MiMo-V2
    and others, whose classes derive it from first_k_dense_replace where the file leaves it out) first."""
    if experts <= 1:
        return [False] * layers
    if isinstance(mlp_types, (list, tuple)) and len(mlp_types) == layers:
        return [t != "dense" for t in mlp_types]
    if "first_k_dense_replace" in text:
        k, every = text.get("first_k_dense_replace") or 0, text.get("moe_layer_freq") or 1
        return [i >= k and i % every == 0 for i in range(layers)]
    if "moe_layer_start_index" in text:  # ERNIE 4.5: every interval-th block from the start to the end index
        start, every = text.get("moe_layer_start_index") or 0, text.get("moe_layer_interval") or 1
        end = text.get("moe_layer_end_index")
        end = layers - 1 if end is None or end < 0 else end
        return [(i + 1) % every == 0 and start <= i <= end for i in range(layers)]
    if "mlp_only_layers" in text or "decoder_sparse_step" in text:
        dense, step = set(text.get("mlp_only_layers") or []), text.get("decoder_sparse_step") or 1
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if text.get("moe_layers") is not None:
        moe = set(text["moe_layers"])
        return [i in moe for i in range(layers)]
    step = text.get("interleave_moe_layer_step") or 1
    return [(i + 1) % step == 0 for i in range(layers)]


def mlp_width(text: dict[str, Any]) -> int:
    """A dense MLP's width as the config gives it (a two-matrix MLP's up projection's)."""
    return first_of(text, MLP_WIDTH) or 4 * text["hidden_size"]


def expert_sizes(text: dict[str, Any], experts: int) -> tuple[int, int, int]:
    """(dense MLP width, one routed expert's width (0: the same), shared experts' total width)."""
    inter = mlp_width(text)
    if experts <= 1:
        return (round(2 * inter / 3) if text.get("model_type") in TWO_MATRIX_MLP_TYPES else inter), 0, 0
    if text.get("intermediate_size_mlp"):  # Llama 4: one shared expert as wide as a routed one
        return text["intermediate_size_mlp"], inter, inter
    expert = text.get("moe_intermediate_size") or 0
    shared = (first_of(text, SHARED_EXPERTS, 0) or 0) * (expert or inter) or \
        text.get("shared_expert_intermediate_size") or text.get("shared_intermediate_size") or 0
    return inter, expert, shared


def attention_layout(cfg: dict[str, Any], name: str) -> AttentionLayout:
    """The attention layout of the language model `cfg` describes, read by the rank's rule for its built model
    (plan/attention_layout.py `layout_of`): from transformers' own config class of the file's model_type, so every
    key the file leaves out takes the class's default and the class lays out its blocks (Qwen's use_sliding_window
    and max_window_layers, Gemma's and EXAONE's patterns, Llama 4's chunks, per-layer configs' own blocks).
    The class is built from the file's keys only: no code the file names is imported or run (no auto_map, no
    trust_remote_code)."""
    return layout_of_built(cfg, built_config(cfg, name))


def layout_of_built(cfg: dict[str, Any], built: Any) -> AttentionLayout:
    """`attention_layout` of `cfg` from its class `built` already (`built_config`; None: a model_type this
    transformers does not know)."""
    if built is None:
        return unbuilt_layout(text_config(cfg), text_config(cfg).get("num_hidden_layers"))
    return layout_of(built)


def built_config(cfg: dict[str, Any], name: str) -> Any:
    """transformers' config class of `cfg`'s model_type built from the file's keys, or None where this
    transformers does not know the model_type. A UserError naming the file when the class rejects a key."""
    model_type = cfg.get("model_type")
    from transformers import CONFIG_MAPPING  # configs only, as in plan/shapes.py `hf_config`

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "auto_map")}
    # A float JSON cannot hold (Nemotron-H's time_step_limit of inf) as transformers writes and reads it back:
    # {"__float__": "Infinity"} (PreTrainedConfig._decode_special_floats, what from_pretrained applies).
    decode = getattr(CONFIG_MAPPING[model_type], "_decode_special_floats", None)
    fields = decode(fields) if callable(decode) else fields
    try:
        return CONFIG_MAPPING[model_type](**fields)
    # RuntimeError: a class that reads one global value of a key the file's per_layer_config varies by block;
    # ZeroDivisionError: a class that lays its blocks out every N-th by a key the file sets to 0
    # (full_attention_interval); strict dataclass errors: transformers 5's typed config fields and validators.
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError, ZeroDivisionError,
            *_strict_config_errors()) as e:
        zeros = [k for k, v in fields.items() if v == 0 and type(v) is int and k.endswith(COUNT_KEY_ENDINGS)]
        named = f" (a count set to 0: {', '.join(zeros)})" if isinstance(e, ZeroDivisionError) and zeros else ""
        raise UserError(f"{name}: transformers' {CONFIG_MAPPING[model_type].__name__} cannot be built from this "
                        f"config.json ({type(e).__name__}: {e}){named}, so the model would not load either: fix or "
                        f"remove the key it names (or list the blocks' layer_types, as published configs do).") \
            from None


# How the keys of counts end (a layout every N-th block, heads, sizes): what a 0 that divides names.
COUNT_KEY_ENDINGS = ("_interval", "_heads", "_dim", "_size", "_layers", "_step", "_experts")


def _strict_config_errors() -> tuple[type[Exception], ...]:
    """The errors transformers' strict config classes raise for a field of the wrong type or a failed validator
    (huggingface_hub's StrictDataclassError; none where this huggingface_hub has no strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def unbuilt_layout(text: dict[str, Any], layers: Any) -> AttentionLayout:
    """The layout of a model_type this transformers cannot build (so the rank cannot build it either): only what the
    file states, an explicit `layer_types` (read by the rank's rule), or a window on every block of the
    EVERY_BLOCK_TYPES families; anything else is read as full attention, since no class is at hand to say which
    blocks a bare window covers."""
    if text.get("layer_types") is not None:
        return layout_of(SimpleNamespace(**text))
    window = text.get("sliding_window") or text.get("attention_chunk_size")
    if window and text.get("model_type") in EVERY_BLOCK_TYPES and text.get("use_sliding_window", True):
        return layout_of(SimpleNamespace(**{**text, "layer_types": ["sliding_attention"] * int(layers)}))
    return AttentionLayout()


def linear_attention_of(cfg: dict[str, Any], name: str, text: dict[str, Any], moe_flags: list[bool],
                        built: Any) -> dict[str, Any]:
    """The ModelShape fields of a Gated DeltaNet hybrid (GATED_DELTANET_TYPES; {} for any other family): which
    blocks are `linear_attention` (the file's layer_types, or its class's default where the file leaves them out:
    every `full_attention_interval`-th block, 4 by default, keeps softmax attention) and the DeltaNet's sizes;
    `built`: the file's config class (`built_config`)."""
    model_type = text.get("model_type", cfg.get("model_type"))
    if model_type not in GATED_DELTANET_TYPES:
        return {}
    built_text = None if built is None else text_of(built)
    types = list(getattr(built_text, "layer_types", None) or text.get("layer_types") or [])
    if not types:
        every = int(text.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(len(moe_flags))]
    linear = [t == "linear_attention" for t in types[:len(moe_flags)]]
    sizes = {k: getattr(built_text, k, None) if built_text is not None else None for k in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")}
    sizes = {k: text.get(k) if text.get(k) is not None else v for k, v in sizes.items()}
    _require_counts(name, sizes, tuple(sizes))
    return dict(linear_layers=sum(linear), linear_dense_layers=sum(a and not m for a, m in zip(linear, moe_flags,
                                                                                                strict=True)),
                linear_k_heads=sizes["linear_num_key_heads"], linear_v_heads=sizes["linear_num_value_heads"],
                linear_k_dim=sizes["linear_key_head_dim"], linear_v_dim=sizes["linear_value_head_dim"],
                linear_conv=sizes["linear_conv_kernel_dim"], linear_fused=model_type in FUSED_DELTANET_TYPES,
                linear_split=model_type in SPLIT_DELTANET_TYPES, gated_attention=model_type not in SPLIT_DELTANET_TYPES)


def biases_of(text: dict[str, Any], model_type: Any, built: Any) -> dict[str, bool]:
    """The ModelShape bias flags of the attention: q/k/v (`attn_bias`) and the output projection (`o_bias`), by the
    family's rule (plan/family_rules.py) or key as its class reads it (`built`: the file's config class, whose
    defaults fill the keys the file leaves out, as Qwen2-MoE's qkv_bias; None: the file's keys only)."""
    if model_type in QKV_BIAS_TYPES:
        return dict(attn_bias=True, o_bias=False)
    if (rule := attention_bias_override(model_type, getter(text, built))) is not None:
        return rule
    built_text = None if built is None else text_of(built)
    keys = (*QKV_BIAS_KEYS, O_BIAS_KEY)
    values = {k: getattr(built_text, k, None) if built_text is not None else text.get(k) for k in keys}
    key = next((k for k in QKV_BIAS_KEYS if values[k] is not None), None)
    on = key is not None and values[key] is True
    return dict(attn_bias=on, o_bias=values[O_BIAS_KEY] is True or on and key == "attention_bias" and
                model_type not in QKV_ONLY_BIAS_TYPES)


def qk_norm_of(shape: ModelShape, model_type: Any, get: Callable[[str], Any]) -> int:
    """The softmax attention's q and k norm weights of a block of `shape` (QK_NORM_ALL_HEADS_TYPES,
    QK_NORM_PER_HEAD_TYPES, plan/family_rules.py's per-head norms, LayerNorms where the block's are; 0 for any
    other family)."""
    if model_type in QK_NORM_ALL_HEADS_TYPES:
        return (shape.heads + shape.kv_heads) * shape.hd
    if model_type in QK_NORM_PER_HEAD_TYPES or per_head_qk_norm(model_type, get):
        return 2 * shape.hd * (2 if shape.norm_bias else 1)
    return 0


def block_heads_of(built: Any, name: str) -> tuple[int, ...]:
    """The attention heads of a per-layer config's blocks where they differ, largest first, as the rank reads them
    from the same class (resolve/sequence.py `facts_of_config`); () where every block has the same count or no class
    is at hand (`built` None). A UserError naming the block's key where a block's heads are not a count (the rank's
    reading would drop it, and the model cannot be built)."""
    if built is None:
        return ()
    text = text_of(built)
    if "num_attention_heads" in (getattr(text, "per_layer_attributes", None) or ()):
        for i, block in enumerate(text.per_layer_config):
            heads = getattr(block, "num_attention_heads", None)
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise UserError(f"{name}: config.json's per_layer_config[{i}].num_attention_heads is {heads!r}; it "
                                f"must be a positive integer (or remove the key to keep the global count).")
    return distinct_block_heads(built)


def mla_of(text: dict[str, Any]) -> MLA | None:
    """DeepSeek's latent attention, where the config has a `kv_lora_rank`."""
    if not text.get("kv_lora_rank"):
        return None
    return MLA(q_rank=text.get("q_lora_rank") or 0, kv_rank=text["kv_lora_rank"], nope=text["qk_nope_head_dim"],
               rope=text["qk_rope_head_dim"], v=text["v_head_dim"])


def with_standard_names(text: dict[str, Any], built: Any) -> dict[str, Any]:
    """`text` with the standard name of each size an ALIASED_TYPES family names otherwise (its class's
    attribute_map: GPT-Neo's `num_heads` and `num_layers` are `num_attention_heads` and `num_hidden_layers`), where
    the file has no key of the standard name."""
    built_text = None if built is None else text_of(built)
    if text.get("model_type") not in ALIASED_TYPES:
        return text
    aliases = getattr(built_text, "attribute_map", None) or {}
    return {**{std: text[own] for std, own in aliases.items() if own in text and std not in text}, **text}


def with_built_mlp_width(text: dict[str, Any], built: Any) -> dict[str, Any]:
    """`text` with the MLP width its class builds where the class derives it from `intermediate_size` (LFM2's
    Lfm2MLP, under `block_auto_adjust_ff_dim`, on by default: two thirds of it, times `block_ffn_dim_multiplier`
    where set, rounded up to a multiple of `block_multiple_of`); `text` itself for any other class."""
    get = getter(text, built)
    width = text.get("intermediate_size")
    if get("block_auto_adjust_ff_dim") is not True or not isinstance(width, int) or isinstance(width, bool):
        return text
    width = int(2 * width / 3)
    if get("block_ffn_dim_multiplier") is not None:
        step = int(get("block_multiple_of") or 1)
        width = -(-int(get("block_ffn_dim_multiplier") * width) // step) * step
    return {**text, "intermediate_size": width}


def getter(text: dict[str, Any], built: Any) -> Callable[[str], Any]:
    """A reader of one key of the language model's config: the built class's value (`built`), else the file's
    (`text`), else None."""
    built_text = None if built is None else text_of(built)

    def get(key: str) -> Any:
        try:
            value = getattr(built_text, key, None) if built_text is not None else None
        except RuntimeError:  # a per-layer attribute read globally
            value = None
        return value if value is not None else text.get(key)

    return get


ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")  # GPT-2's family (GPT-J, CodeGen, GPT-Neo's attention_dropout)


def attention_dropout_of(name: str, get: Callable[[str], Any]) -> float:
    """The attention probabilities' dropout probability in training (the built class's value, its default where
    the file has none: GPT-2's 0.1); a UserError naming the key when it is no probability."""
    for key in ATTENTION_DROPOUT:
        value = get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise UserError(f"{name}: config.json {key} is {value!r}; a dropout probability is a number from 0 "
                            "up to (not including) 1: fix or remove the key.")
        return float(value)
    return 0.0


# The families whose attention hands attn_logit_softcapping to the attention function (transformers' Gemma 2,
# VaultGemma, T5Gemma). Gemma 3's config has the key too, but Gemma3Attention passes no softcap: it never caps.
SOFTCAP_TYPES = frozenset({"gemma2", "vaultgemma", "t5gemma", "t5_gemma_module"})


def softcap_of(name: str, model_type: str | None, get: Callable[[str], Any]) -> float:
    """The attention logits' softcap (attn_logit_softcapping: the built class's value, its default where the file
    has none, Gemma 2's 50; null: none) of a SOFTCAP_TYPES family, 0 for any other (its class ignores the key); a
    UserError naming the key when it is no positive number."""
    if model_type not in SOFTCAP_TYPES:
        return 0.0
    value = get("attn_logit_softcapping")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise UserError(f"{name}: config.json attn_logit_softcapping is {value!r}; a softcap is a positive number, "
                        "or null for none: fix or remove the key.")
    return float(value)


def router_groups_of(model_type: str | None, get: Callable[[str], Any], experts: int) -> dict[str, int]:
    """ModelShape's `router_groups` and `router_topk_groups` of a GROUP_ROUTER_TYPES mixture ({} for any other):
    its n_group and topk_group, 1 each where the config leaves them out."""
    if experts < 2 or model_type not in GROUP_ROUTER_TYPES:
        return {}
    groups, best = get("n_group"), get("topk_group")
    return dict(router_groups=groups if isinstance(groups, int) and groups > 0 else 1,
                router_topk_groups=best if isinstance(best, int) and best > 0 else 1)


def groups_of(attention: AttentionLayout, text: dict[str, Any], built: Any, deltanet: bool,
              name: str) -> tuple[BlockGroup, ...]:
    """The partial blocks kind by kind for the time model (plan/token_mixers.py), read from the built class's
    language model (`built`) where there is one, else from the file's keys (`name`: the model, for an error)."""
    built_text = None if built is None else text_of(built)
    get = getter(text, built)

    def has(key: str) -> bool:
        try:
            return key in text or (built_text is not None and hasattr(built_text, key))
        except RuntimeError:  # a per-layer attribute read globally: the class has it
            return True

    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    return block_groups(attention, get, has, name=name, hidden=hidden, heads=heads,
                        head_dim=text.get("head_dim") or hidden // heads, deltanet=deltanet)


def shape_from_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """The shape a config.json describes; a UserError naming the key when a size is missing or not a count."""
    require_sane_sizes(name, cfg)
    check_parts(cfg, name)
    built = built_config(cfg, name)  # once: the layout, a hybrid's blocks and the names of sizes read the class
    if built is not None and (odd := odd_setting(built)):
        raise UserError(f"{name}: config.json {odd}.")
    text = with_built_mlp_width(with_standard_names(text_config(cfg), built), built)
    single = single_part_fields(cfg, text, built, name)  # Nemotron-H: its class counts blocks by their list
    if single:
        text = {**text, "num_hidden_layers": single["layers"]}
    try:
        heads, layers = text["num_attention_heads"], text["num_hidden_layers"]
        _require_counts(name, text, ("num_hidden_layers", "hidden_size", "num_attention_heads"))
        _require_not_negative(name, text, OPTIONAL_SIZES)
        experts = int(first_of(text, EXPERTS, 1) or 1)
        inter, expert, shared = expert_sizes(text, experts)
        model_type = text.get("model_type", cfg.get("model_type"))
        # the built text config's own: a composite's text_config that names none gets its class's default type
        text_type = getattr(text_of(built), "model_type", None) if built is not None else model_type
        attention = layout_of_built(cfg, built)
        moe_flags = moe_layer_flags(text, layers, experts, getter(text, built)("mlp_layer_types"))
        deltanet = linear_attention_of(cfg, name, text, moe_flags, built)
        get = getter(text, built)
        shape = ModelShape(
            id=name, model_type=str(cfg.get("model_type") or ""), layers=layers, hidden=text["hidden_size"],
            intermediate=inter, heads=heads,
            kv_heads=kv_heads_rule(model_type, get) or text.get("num_key_value_heads") or
            text.get("multi_query_group_num") or heads,
            vocab=text.get("vocab_size") or cfg["vocab_size"], head_dim=text.get("head_dim"),
            tied=tied_of(cfg, text, built),
            experts=experts, top_k=int(first_of(text, TOP_K, 1) or 1) if experts > 1 else 1,
            moe_intermediate=expert, shared_intermediate=shared,
            dense_layers=moe_flags.count(False) if experts > 1 else 0, dense_first=moe_flags == sorted(moe_flags),
            mla=mla_of(text), **biases_of(text, model_type, built),
            sliding_window=attention.span, sliding_layers=attention.blocks, attention_kinds=attention.kinds,
            attention_chunked=CHUNK in attention.kinds,
            attention_groups=groups_of(attention, text, built, bool(deltanet), name),
            every_expert=experts > 1 and model_type in EVERY_EXPERT_TYPES,
            clamped_swiglu=experts > 1 and model_type in GPT_OSS_TYPES, attention_sinks=model_type in GPT_OSS_TYPES,
            attn_dropout=attention_dropout_of(name, get), attn_softcap=softcap_of(name, text_type or model_type, get),
            # the text model's class picks its kernel (a composite's own class only refuses `sdpa`)
            eager_only=runs_eager(cfg.get("model_type") or model_type, "sdpa", text_type=text_type),
            text_model_type=str(text_type or ""),
            flash_unwindowed=model_type in FLASH_UNWINDOWED_TYPES,
            shared_gate=bool(shared) and model_type in SHARED_GATE_TYPES, block_heads=block_heads_of(built, name),
            **router_groups_of(model_type, get, experts),
            **norms_and_biases(model_type, get, text["hidden_size"], mlp_width(text)), **deltanet)
        if single:
            shape = dataclasses.replace(shape, **single, attention_groups=shape.attention_groups + part_groups(single))
        shape = dataclasses.replace(shape, **mamba_hybrid_fields(text, built, name))  # Jamba, Bamba, Falcon-H1
        text_only = loads_text_only(cfg.get("model_type"))  # the rank loads no tower the file describes
        vision, audio = (None, None) if text_only else (vision_shape_of(cfg), audio_shape_of(cfg))
        tower = not text_only and has_tower(rank_config(built) if built is not None else SimpleNamespace(**cfg))
    except KeyError as e:
        raise UserError(f"{name}: config.json has no {e}; shardfit plans decoder-only transformers.") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{name}: config.json has a size that is not a number ({e}).") from None
    _require_counts(name, dataclasses.asdict(shape), ("intermediate", "kv_heads", "vocab", "experts", "top_k"))
    towers = tower_params(vision, audio) if vision is not None or audio is not None else \
        (0 if text_only else other_tower_params(cfg))
    if vision is not None and is_qwen3_vision(cfg):
        # Counted as the tower it is (LayerNorm, a plain GELU MLP): the `intermediate_size` its vision_config names
        # made vision_shape_of read Qwen2.5-VL's gated MLP, a third more MLP weights than the built tower's.
        vision = dataclasses.replace(vision, gated=False)
        towers = qwen3_tower_params(cfg, vision) + (audio.params() if audio else 0)
    elif vision is not None and is_qwen3_5_vision(cfg):
        vision = dataclasses.replace(vision, gated=False)
        towers = qwen3_5_tower_params(cfg, vision)
    soft_tower = None if text_only else soft_token_tower_of(cfg)
    return dataclasses.replace(shape, vision=vision, audio=audio, extra_params=towers, soft_tower=soft_tower,
                               qk_norm=qk_norm_of(shape, model_type, get),
                               other_tower=tower and vision is None and audio is None and soft_tower is None)


# Sizes a config may leave out (or null); where it gives a whole number, a negative one is no model's (the shape
# would count negative weights and plan them as fitting).
OPTIONAL_SIZES = ("head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "shared_intermediate_size", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", *SHARED_EXPERTS, *EXPERTS,
                  *TOP_K)


# The largest value shardfit takes for each size a config.json gives: far above every published model (512 experts,
# a vocabulary of 262k, a width of 16k, 126 blocks), and far below what overflows memory while the model is built.
# A value beyond is a typo or a hand-edited file, refused naming its key, not met as an out-of-memory error.
SIZE_CEILINGS = {
    "num_hidden_layers": 1 << 12, "hidden_size": 1 << 18, "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14, "head_dim": 1 << 14, "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20, "shared_expert_intermediate_size": 1 << 20, "vocab_size": 1 << 24,
    **dict.fromkeys(SHARED_EXPERTS, 1 << 16), **dict.fromkeys(EXPERTS, 1 << 16), **dict.fromkeys(TOP_K, 1 << 16),
}

# The same for the vision and audio towers' sizes (vision_config, audio_config, also under Qwen-Omni's
# thinker_config), under each name a family gives them: far above every published tower (ViTs of 4k wide, 63
# blocks deep, images of a few thousand pixels; Whisper-like encoders of 32 layers over 1,500 positions).
TOWER_CEILINGS = {
    **dict.fromkeys(("depth", "num_hidden_layers", "encoder_layers"), 1 << 12),
    **dict.fromkeys(("hidden_size", "embed_dim", "d_model", "out_hidden_size", "output_dim", "projector_output_dim",
                     "vision_output_dim"), 1 << 18),
    **dict.fromkeys(("intermediate_size", "encoder_ffn_dim"), 1 << 20),
    **dict.fromkeys(("num_heads", "num_attention_heads", "encoder_attention_heads", "num_mel_bins"), 1 << 14),
    **dict.fromkeys(("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "in_chans",
                     "mlp_ratio"), 1 << 10),
    **dict.fromkeys(("image_size", "n_window"), 1 << 16),
    **dict.fromkeys(("num_position_embeddings", "max_source_positions"), 1 << 24),
}


# A mapping in config.json is a tower's when its key names one: vision_config, Qwen-VL's visual, audio_config,
# speech_config, vit_config, Granite Speech's encoder_config, projector_config... under any holder
# (thinker_config for Qwen-Omni). The language model's part (text_config, llm_config) is held to SIZE_CEILINGS.
_TOWER_KEY = re.compile(r"(?i)(vision|visual|vit|image|audio|speech|whisper|encoder|perceiver|projector)")


def tower_configs(cfg: dict[str, Any], prefix: str = "", depth: int = 3) -> list[tuple[str, dict[str, Any]]]:
    """The towers' parts of a config, each with the path of keys that leads to it (`thinker_config.audio_config`),
    found under any key that names a tower, `depth` mappings deep."""
    out = []
    for key, value in cfg.items():
        if not isinstance(value, dict) or depth <= 0:
            continue
        where = f"{prefix}{key}"
        if _TOWER_KEY.search(str(key)):
            out.append((where, value))
        out += tower_configs(value, f"{where}.", depth - 1)
    return out


def _numbers(raw: Any) -> list[tuple[str, Any]]:
    """A size's numbers, each with what follows its key in the name: one number, each side of a [height, width],
    or each entry of a mapping ({"height": .., "width": ..}, {"shortest_edge": ..}: image processors' form)."""
    if isinstance(raw, list):
        return [("", v) for v in raw]
    if isinstance(raw, dict):
        return [(f".{k}", v) for k, v in raw.items()]
    return [("", raw)]


def _require_below(name: str, where: str, values: dict[str, Any], ceilings: dict[str, int]) -> None:
    """A UserError naming `where`'s key whose number (or each side of a [height, width] or {height, width})
    exceeds its ceiling."""
    for key, ceiling in ceilings.items():
        for sub, value in _numbers(values.get(key)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                continue  # not a number: the count checks name it
            if value > ceiling:
                shown = f"{value:,}" if isinstance(value, int) else f"{value:g}"
                raise UserError(f"{name}: config.json's {where}{key}{sub} is {shown}, beyond any model's (shardfit "
                                f"takes up to {ceiling:,}): no memory holds it. Fix the value in {name}'s "
                                "config.json.")


def require_sane_sizes(name: str, cfg: dict[str, Any]) -> None:
    """A UserError naming the key where config.json (its language model's part, or a vision or audio tower's) gives
    a size beyond SIZE_CEILINGS or TOWER_CEILINGS; the planner's shape and the model's build both read config.json
    through this, so plan, check and train refuse it alike (exit 2) before anything is allocated."""
    text = text_config(cfg)
    for key in ("moe_intermediate_size", *SHARED_EXPERTS, *EXPERTS, *TOP_K):
        if isinstance(text.get(key), list):  # ERNIE 4.5 VL: one value per modality's experts
            raise UserError(f"{name}: config.json's {key} is a list ({text[key]}), one value per modality's experts "
                            f"(ERNIE 4.5 VL's text and vision experts); shardfit does not plan such a mixture, nor "
                            f"does its trainer load it. Plan a text-only model of the family instead.")
    _require_below(name, "", text, SIZE_CEILINGS)
    for where, tower in tower_configs(cfg):
        _require_below(name, f"{where}.", tower, TOWER_CEILINGS)


def _require_not_negative(name: str, values: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise UserError(f"{name}: config.json's {key} is {value}; a size is 0 or more: fix it, or remove the "
                            "key (its family's default then applies).")


def _require_counts(name: str, values: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: config.json's {key} is {value!r}; it must be a positive integer.")


def _side(value: Any, default: int) -> int:
    """A square image's or patch's side as a vision_config gives it: one number, or [height, width] (InternVL,
    Molmo 2), whose larger side is taken; `default` where it is unset."""
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def tower_params(vision: VisionShape | None, audio: AudioShape | None) -> int:
    """The weights of a multimodal model's towers: what it holds outside the decoder (Qwen2.5-Omni's talker and
    token2wav are never built for training)."""
    return (vision.params() if vision else 0) + (audio.params() if audio else 0)


def is_qwen3_vision(cfg: dict[str, Any]) -> bool:
    """Qwen3-VL's tower (also Qwen3-Omni's): LayerNorm and a plain GELU MLP, where Qwen2.5-VL's is gated."""
    v = cfg.get("vision_config") or (cfg.get("thinker_config") or {}).get("vision_config") or {}
    return "deepstack_visual_indexes" in v


def qwen3_tower_params(cfg: dict[str, Any], vision: VisionShape) -> int:
    """Qwen3-VL's tower (transformers' Qwen3VLVisionModel, also Qwen3-Omni's): the blocks and merger `vision` counts,
    the patch embedding's bias, the learned position embedding of `num_position_embeddings` positions and one
    DeepStack merger per `deepstack_visual_indexes` entry (the merger's layout with its LayerNorm over the merged
    width)."""
    v = cfg.get("vision_config") or (cfg.get("thinker_config") or {}).get("vision_config") or {}
    positions = int(v.get("num_position_embeddings") or 0)
    merged = vision.dim * vision.merge * vision.merge
    deepstack = len(v.get("deepstack_visual_indexes") or ())
    merger = 2 * merged + merged * merged + merged + merged * vision.out + vision.out
    return vision.params() + vision.dim + positions * vision.dim + deepstack * merger


def is_qwen3_5_vision(cfg: dict[str, Any]) -> bool:
    """Qwen3.5's tower: Qwen3-VL's blocks (LayerNorm, a plain GELU MLP) without its deepstack mergers."""
    return str((cfg.get("vision_config") or {}).get("model_type", "")).startswith("qwen3_5")


def qwen3_5_tower_params(cfg: dict[str, Any], vision: VisionShape) -> int:
    """Qwen3.5's tower (transformers' Qwen3_5VisionModel): the blocks and merger `vision` counts, the patch
    embedding's bias and the learned position embedding of `num_position_embeddings` positions."""
    positions = int((cfg.get("vision_config") or {}).get("num_position_embeddings") or 0)
    return vision.params() + vision.dim + positions * vision.dim


def other_tower_params(cfg: dict[str, Any]) -> int:
    """A vision tower that is not Qwen-VL's (SigLIP in Gemma 3, Llama 4's, GLM-4.xV's): a ViT of `layers` blocks of
    width `d` (attention 4d^2, MLP 2dm, biases and norms), its patch embedding and positions, and a projection to
    the language model's width. An estimate within a few per cent of the tower (Gemma 3's, whose layout is known
    whole, is exact; Pixtral's, in Mistral 3 and LLaVA, is counted whole by plan/family_rules.py); the tower is a
    small part of these models."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return 0
    if (pixtral := pixtral_tower_params(cfg, text_config(cfg).get("hidden_size") or 0)) is not None:
        return pixtral
    d = v.get("hidden_size") or v.get("embed_dim") or 0
    m = v.get("intermediate_size") or 4 * d
    depth = v.get("num_hidden_layers") or v.get("depth") or 0
    patch = _side(v.get("patch_size"), 14)
    positions = (_side(v.get("image_size"), 336) // patch) ** 2
    out = text_config(cfg).get("hidden_size", d)
    block = 4 * d * d + 2 * d * m + 9 * d + m
    proj = (v.get("projector_output_dim") or v.get("vision_output_dim") or d) * out
    # Gemma 3's SigLIP tower is known whole: the patch embedding's bias, the final LayerNorm and the projector's
    # RMSNorm (4d) make the count the built tower's to the parameter (SigLIP's head is off: vision_use_head false).
    exact = 4 * d if cfg.get("model_type") == "gemma3" else 0
    return int(depth * block + 3 * patch * patch * d + positions * d + proj + exact + siglip_head_params(v, d, m))


def siglip_head_params(v: dict[str, Any], d: int, m: int) -> int:
    """The weights of a SigLIP tower's pooling head (transformers' SiglipMultiheadAttentionPoolingHead: a probe
    token, a multi-head attention with biases, a LayerNorm and an MLP of width `m`), built under its
    `vision_use_head`, on by the class's default (published Gemma 3 files turn it off); 0 for any other tower."""
    if v.get("model_type") != "siglip_vision_model" or v.get("vision_use_head", True) is False:
        return 0
    return d + 4 * d * d + 4 * d + 2 * d + 2 * d * m + m + d
