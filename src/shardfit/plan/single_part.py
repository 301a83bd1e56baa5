"""The ModelShape fields of a decoder whose blocks are each ONE part under its own norm: NVIDIA's Nemotron-H,
Nemotron Nano 2 and Nemotron 3 (transformers' NemotronHForCausalLM, model_type nemotron_h). A block is a Mamba-2
mixer, softmax attention, an MLP or a mixture of experts, never a mixer paired with an MLP, so counting each block
as attention plus MLP (as every other family is counted) weighs a 4.5 G model as 8 G.

The blocks are listed by the config class's `layers_block_type` ("linear_attention": Mamba-2, "full_attention",
"mlp", "moe"), which it reads from the file's `layers_block_type` or from the older `hybrid_override_pattern`, one
character a block (M, *, -, E); the class counts the blocks by that list and ignores `num_hidden_layers`. Sizes are
read from the built class, whose defaults fill what the file leaves out; without a class (a transformers that does
not know nemotron_h) only the file's keys are read, and a missing one is refused by name.
"""

from __future__ import annotations

from typing import Any

from shardfit.errors import UserError
from shardfit.plan.attention_layout import text_of
from shardfit.plan.model_shape import ATTENTION, MAMBA, MLP, MOE, BlockGroup
from shardfit.plan.shared_blocks import SHARED_BLOCK_TYPES, shared_block_fields

SINGLE_PART_TYPES = ("nemotron_h",)
# The class's block names and the pattern's characters (NemotronHConfig._pattern_to_list), as parts.
PARTS = {"linear_attention": MAMBA, "full_attention": ATTENTION, "mlp": MLP, "moe": MOE}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Older files' block names, which transformers renames as it reads them (configuration_utils'
# remap_legacy_layer_types) and builds.
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def single_part_fields(cfg: dict[str, Any], text: dict[str, Any], built: Any, name: str) -> dict[str, Any]:
    """The ModelShape fields of a SINGLE_PART_TYPES decoder ({} for any other family): its blocks by part, the
    Mamba-2 mixer's sizes, the experts (of the "moe" blocks only: a dense file's class defaults name 8 experts it
    never builds), two-matrix MLPs, and attention without biases (NemotronHAttention's projections have none
    whatever `attention_bias` says). `built`: the file's config class (plan/config_shape.py `built_config`)."""
    if text.get("model_type", cfg.get("model_type")) in SHARED_BLOCK_TYPES:
        return shared_block_fields(text, built, name)
    if text.get("model_type", cfg.get("model_type")) not in SINGLE_PART_TYPES:
        return {}
    built_text = None if built is None else text_of(built)

    def get(key: str) -> Any:
        value = getattr(built_text, key, None) if built_text is not None else None
        return value if value is not None else text.get(key)

    parts = _parts(get, name)
    moe = parts.count(MOE)
    sizes = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"]
    if moe:
        sizes += ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"]
    values = {k: get(k) for k in sizes}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: config.json's {key} is {value!r}; it must be a positive integer (the "
                            f"{'mixture' if key in sizes[-3:] and moe else 'model'} needs it).")
    if moe and values["n_routed_experts"] < 2:
        raise UserError(f"{name}: config.json's n_routed_experts is 1 with 'moe' blocks; a mixture routes among at "
                        "least 2 experts: set n_routed_experts to 2 or more, or make those blocks 'mlp' ('-').")
    if moe and values["num_experts_per_tok"] > values["n_routed_experts"]:
        raise UserError(f"{name}: config.json's num_experts_per_tok ({values['num_experts_per_tok']}) exceeds "
                        f"n_routed_experts ({values['n_routed_experts']}); route each token to at most that many.")
    # The shared expert is always built; NemotronHMLP takes a width of 0 (or none) as intermediate_size.
    shared = (get("moe_shared_expert_intermediate_size") or values["intermediate_size"]) if moe else 0
    latent = (get("moe_latent_size") or 0) if moe else 0
    return dict(
        layers=len(parts), single_part=True, mamba_layers=parts.count(MAMBA), attention_layers=parts.count(ATTENTION),
        dense_layers=len(parts) - moe if moe else 0, hidden=values["hidden_size"],
        intermediate=values["intermediate_size"], heads=values["num_attention_heads"],
        kv_heads=values["num_key_value_heads"], head_dim=values["head_dim"],
        experts=values.get("n_routed_experts", 1), top_k=values.get("num_experts_per_tok", 1),
        moe_intermediate=values.get("moe_intermediate_size", 0), shared_intermediate=int(shared),
        moe_latent=int(latent), attn_bias=False, o_bias=False, qk_norm=0,
        mamba_heads=values["mamba_num_heads"], mamba_head_dim=values["mamba_head_dim"],
        mamba_state=values["ssm_state_size"], mamba_groups=values["n_groups"], mamba_conv=values["conv_kernel"],
        mamba_conv_bias=get("use_conv_bias") is not False, mamba_bias=get("use_bias") is True,
        mamba_chunk=int(get("chunk_size") or 128), two_matrix=True, mlp_bias=get("mlp_bias") is True)


def check_parts(cfg: dict[str, Any], name: str) -> None:
    """A UserError naming the key where a SINGLE_PART_TYPES config.json lists a block its class does not know (a
    pattern character other than M, *, - and E, or a layers_block_type name other than the four), before the
    class is built (whose own error names neither key nor fix)."""
    if cfg.get("model_type") in SINGLE_PART_TYPES and (cfg.get("layers_block_type") is not None or
                                                       cfg.get("hybrid_override_pattern") is not None):
        _parts(cfg.get, name)


def part_groups(fields: dict[str, Any]) -> tuple[BlockGroup, ...]:
    """The blocks of a single-part decoder (`single_part_fields`) that mix no tokens (its MLPs and mixtures), for
    the time model: no softmax attention and no recurrence (their Mamba-2 blocks are the layout's recurrent group,
    their attention blocks the whole prefix)."""
    ffn = fields["layers"] - fields["mamba_layers"] - fields["attention_layers"] if fields else 0
    return (BlockGroup(ffn, "none"),) if ffn > 0 else ()


def _parts(get: Any, name: str) -> list[str]:
    """Each block's part, from the class's `layers_block_type` or the file's, or its `hybrid_override_pattern`."""
    types = get("layers_block_type")
    if types is None and get("hybrid_override_pattern") is not None:
        pattern = get("hybrid_override_pattern")
        odd = sorted(set(pattern) - set(PATTERN)) if isinstance(pattern, str) and pattern else [pattern]
        if odd:
            raise UserError(f"{name}: config.json's hybrid_override_pattern has {', '.join(map(repr, odd))}; each "
                            f"block is one of {', '.join(map(repr, PATTERN))} (Mamba-2, attention, MLP, mixture).")
        types = [PATTERN[c] for c in pattern]
    if isinstance(types, (list, tuple)):
        types = [LEGACY.get(t, t) if isinstance(t, str) else t for t in types]
    if not isinstance(types, (list, tuple)) or not types or any(t not in PARTS for t in types):
        raise UserError(f"{name}: config.json's layers_block_type is {types!r}: list each block as one of "
                        f"{', '.join(map(repr, PARTS))} (or give hybrid_override_pattern, one of M, *, -, E a block).")
    return [PARTS[t] for t in types]
