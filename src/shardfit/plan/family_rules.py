"""What a family's class builds around its linear layers that its config.json does not size: the MLP's form (two
matrices, up and down, where ModelShape's is gated), how many norms a block holds and whether they are LayerNorms
with biases, which linears carry biases and by which key, and a bias on the output head.

The table below holds only what no key says; where a key says it, the key is read (Llama's `mlp_bias`,
StarCoder 2's and ERNIE's `use_bias`, Falcon's `bias`), through the family's built config class so its defaults fill
what the file leaves out. Checked against the models transformers builds on the meta device
(tests/test_plan_families.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One family's rules. `two_matrix`: its MLP is up, an activation, down (no gate); `norms`: norms a block holds
    (or a rule reading the config); `norm_bias`: they and the final norm are LayerNorms with biases; `attn_bias` and
    `mlp_bias`: True where the family's attention's or MLP's linears always carry biases, a key where the config says
    it, None (attention) where the generic keys of plan/config_shape.py decide; `o_bias`: the attention's output
    projection alone always carries one; `head_bias`: a bias on the head; `positions`: a learned position embedding
    of `max_position_embeddings` rows; `score_bias`: a mixture's router holds a learned bias per expert on its
    scores (ERNIE 4.5's moe_statics); `act_params`: learned scalars of the MLP's activation (Apertus's xIELU);
    `qk_norm`: per-head q and k norms (LayerNorms where the block's are), always or by a key; `embed_norm`: a norm
    over the embedding's output (BLOOM's word_embeddings_layernorm); `mlp_norm`: a norm over the MLP's inner width
    (BitNet's ffn_sub_norm)."""

    two_matrix: bool = False
    norms: int | Callable[[Callable[[str], Any]], int] = 2
    norm_bias: bool = False
    attn_bias: bool | str | None = None
    mlp_bias: bool | str = False
    head_bias: bool | str = False
    o_bias: bool = False
    positions: bool = False
    score_bias: bool = False
    act_params: int = 0
    qk_norm: bool | str = False
    embed_norm: bool = False
    mlp_norm: bool = False


def falcon_norms(get: Callable[[str], Any]) -> int:
    """Falcon's norms a block: two in a sequential block, one in a parallel block unless its new decoder
    architecture asks for two (`num_ln_in_parallel_attn`, two by default there)."""
    if not get("parallel_attn"):
        return 2
    count = get("num_ln_in_parallel_attn")
    return 2 if count == 2 or (count is None and get("new_decoder_architecture")) else 1


FAMILIES: dict[str, Family] = {
    "gpt_neo": Family(two_matrix=True, norm_bias=True, mlp_bias=True, o_bias=True, positions=True),
    "gpt_neox": Family(two_matrix=True, norm_bias=True, mlp_bias=True),
    "gpt2": Family(two_matrix=True, norm_bias=True, attn_bias=True, mlp_bias=True, positions=True),
    "gpt_bigcode": Family(two_matrix=True, norm_bias=True, attn_bias=True, mlp_bias=True, positions=True),
    "bloom": Family(two_matrix=True, norm_bias=True, attn_bias=True, mlp_bias=True, embed_norm=True),
    # a parallel block under one LayerNorm, attention without biases, a biased head
    "codegen": Family(two_matrix=True, norms=1, norm_bias=True, mlp_bias=True, head_bias=True),
    "gptj": Family(two_matrix=True, norms=1, norm_bias=True, mlp_bias=True, head_bias=True),
    "phi": Family(two_matrix=True, norms=1, norm_bias=True, attn_bias=True, mlp_bias=True, head_bias=True),
    "starcoder2": Family(two_matrix=True, norm_bias=True, attn_bias="use_bias", mlp_bias="use_bias"),
    "falcon": Family(two_matrix=True, norms=falcon_norms, norm_bias=True, attn_bias="bias", mlp_bias="bias"),
    "persimmon": Family(two_matrix=True, norm_bias=True, attn_bias=True, mlp_bias=True, qk_norm="qk_layernorm"),
    "jais2": Family(two_matrix=True, norm_bias=True),
    "arcee": Family(two_matrix=True),
    "apertus": Family(two_matrix=True, act_params=2, qk_norm=True),
    "nanochat": Family(two_matrix=True, norms=0),
    "cohere": Family(norms=1),  # a parallel block: one norm before attention and MLP alike
    "cohere2": Family(norms=1),
    "cohere2_moe": Family(norms=1),
    "olmo": Family(norms=0),  # LayerNorms without weights
    "gemma2": Family(norms=4),  # norms before and after attention and MLP
    "gemma3_text": Family(norms=4, qk_norm=True),
    "glm4_moe": Family(qk_norm="use_qk_norm"),  # GLM-4.5 normalizes q and k per head; GLM-4.5-Air does not
    "gemma4_text": Family(norms=4, qk_norm=True),
    "hyperclovax": Family(norms=4),
    "kolibri1": Family(norms=4, qk_norm=True),
    "exaone4": Family(qk_norm=True),
    "mellum": Family(qk_norm=True),
    "bitnet": Family(norms=3, mlp_norm=True),  # sub-norms: the attention's output (hidden-wide) and the MLP's inner
    "lfm2": Family(qk_norm=True),  # on its attention blocks (its short-convolution blocks are not told apart yet)
    "stablelm": Family(norm_bias=True),
    "phimoe": Family(norm_bias=True),
    "ernie4_5": Family(attn_bias="use_bias", mlp_bias="use_bias"),
    "ernie4_5_moe": Family(attn_bias="use_bias", mlp_bias="use_bias", head_bias="use_bias", score_bias=True),
}
PLAIN = Family()


def family_of(model_type: Any) -> Family:
    """The rules of `model_type` (a gated MLP, two RMSNorms a block, biases by the generic keys for any family the
    table does not name)."""
    return FAMILIES.get(model_type, PLAIN) if isinstance(model_type, str) else PLAIN


def _on(rule: bool | str | None, get: Callable[[str], Any]) -> bool | None:
    return get(rule) is True if isinstance(rule, str) else rule


def attention_bias_override(model_type: Any, get: Callable[[str], Any]) -> dict[str, bool] | None:
    """The ModelShape fields `attn_bias` (q, k, v) and `o_bias` (the output projection) where the family's rule
    decides them; None where the generic keys do."""
    family = family_of(model_type)
    if family.o_bias:
        return dict(attn_bias=False, o_bias=True)
    on = _on(family.attn_bias, get)
    return None if on is None else dict(attn_bias=on, o_bias=on)


def norms_and_biases(model_type: Any, get: Callable[[str], Any], hidden: int, width: int) -> dict[str, Any]:
    """The ModelShape fields `norms`, `norm_bias`, `mlp_extra`, `head_bias`, `positions`, `score_bias` and
    `embed_norm` (and the per-layer embeddings' sizes, by Gemma 4's keys) of a family whose dense MLP is `width`
    wide (its real width: a two-matrix MLP's up projection); `get` reads one key of the built language model's config
    (None where it has none). Llama's `mlp_bias` key biases any family's MLP. A two-matrix MLP's `mlp_extra` also
    holds what planning it as three matrices of 2/3 the width rounds away (the planned width is a whole number: at
    most `hidden` weights a block)."""
    family = family_of(model_type)
    mlp = _on(family.mlp_bias, get) or get("mlp_bias") is True
    norms = family.norms(get) if callable(family.norms) else family.norms
    linears = 1 if family.two_matrix else 2  # the gate's and the up projection's biases, or the up's alone
    rounded = 2 * width - 3 * round(2 * width / 3) if family.two_matrix else 0
    return dict(norms=norms, norm_bias=family.norm_bias,
                mlp_extra=(linears * width + hidden if mlp else 0) + rounded * hidden + family.act_params +
                (width if family.mlp_norm else 0),
                head_bias=bool(_on(family.head_bias, get)),
                positions=int(get("max_position_embeddings") or 0) if family.positions else 0,
                score_bias=family.score_bias, embed_norm=family.embed_norm,
                per_layer_input=int(get("hidden_size_per_layer_input") or 0),
                per_layer_vocab=int(get("vocab_size_per_layer_input") or 0))


def per_head_qk_norm(model_type: Any, get: Callable[[str], Any]) -> bool:
    """Whether the family's rule puts a per-head norm on q and on k."""
    return bool(_on(family_of(model_type).qk_norm, get))


def kv_heads_rule(model_type: Any, get: Callable[[str], Any]) -> int | None:
    """Key/value heads a family counts by its own rule (Falcon: one under `multi_query` outside its new decoder
    architecture, else `num_kv_heads`; GPT-BigCode: its class's count, one under `multi_query`); None for the
    rest."""
    if model_type == "gpt_bigcode":  # its class reads multi_query as one key/value head
        return get("num_key_value_heads")
    if model_type != "falcon":
        return None
    return get("num_kv_heads") if get("new_decoder_architecture") or not get("multi_query") else 1


def pixtral_tower_params(cfg: dict[str, Any], out: int) -> int | None:
    """The weights of a Pixtral vision tower and its projector to the language model's width `out` (Mistral 3's:
    an RMSNorm, a patch merger of `spatial_merge_size`^2 patches and two linears; LLaVA's: the two linears alone),
    as transformers' PixtralVisionModel builds it: a bias-free patch convolution, an RMSNorm before the blocks, and
    per block two RMSNorms, the attention's four bias-free projections and a gated MLP. None where the config's
    vision tower is not Pixtral's."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or v.get("model_type") != "pixtral":
        return None
    d, m = int(v.get("hidden_size") or 1024), int(v.get("intermediate_size") or 4096)
    heads = int(v.get("num_attention_heads") or 16)
    inner = heads * int(v.get("head_dim") or d // heads)
    patch, channels = int(v.get("patch_size") or 16), int(v.get("num_channels") or 3)
    block = 2 * d + 4 * d * inner + 3 * d * m
    tower = channels * patch * patch * d + d + int(v.get("num_hidden_layers") or 24) * block
    bias = cfg.get("multimodal_projector_bias", cfg.get("model_type") != "mistral3")
    projector = d * out + out * out + (2 * out if bias else 0)
    if cfg.get("model_type") == "mistral3":
        merge = int(cfg.get("spatial_merge_size") or 2)
        projector += d + d * merge * merge * d
    return tower + projector
