"""The ModelShape fields of a Mamba hybrid whose blocks each pair a token mixer with an MLP or a mixture of experts:
AI21's Jamba (Mamba-1), IBM's Bamba and Granite 4.0 (granitemoehybrid) and TII's Falcon-H1 (Mamba-2). Counting
their Mamba blocks as attention blocks weighs Jamba 78 % heavy and Bamba 20 % light.

A block's mixer is read from its config class's `layer_types` ("linear_attention": Mamba, "full_attention":
softmax attention; Falcon-H1's "hybrid": both side by side, every block), which Bamba and Falcon-H1 map to their
`layers_block_type` and Jamba derives from its attention period and offset; Jamba's mixtures sit in the blocks its
`layers_num_experts` gives more than one expert. The Mamba-2 mixer is Nemotron-H's (plan/single_part.py): heads of
`mamba_d_head` channels, `mamba_n_groups` groups of B and C of `mamba_d_state` each, a `mamba_d_conv`-tap
convolution; Falcon-H1 biases its out_proj by `projectors_bias` and norms its output only under `mamba_rms_norm`.
Jamba's Mamba-1 mixer is `mamba_expand` x hidden channels wide with a `mamba_dt_rank`-wide step projection.
Sizes are read from the built class, whose defaults fill what the file leaves out (and resolve "auto" widths).
"""

from __future__ import annotations

from typing import Any

from shardfit.errors import UserError
from shardfit.plan.attention_layout import text_of

MAMBA2_HYBRID_TYPES = ("bamba", "falcon_h1", "granitemoehybrid")
MAMBA1_HYBRID_TYPES = ("jamba",)
# Falcon-H1: every block runs attention and a Mamba-2 mixer side by side before its MLP.
PARALLEL_TYPES = ("falcon_h1",)
# IBM Granite 4.0: a block without experts (`num_local_experts` 0: the dense Granite-4.0-H Micro and 1B) keeps only
# its shared MLP, of `shared_intermediate_size`; `intermediate_size` is then unused.
SHARED_MLP_ONLY_TYPES = ("granitemoehybrid",)
MAMBA_BLOCKS = ("linear_attention", "mamba", "hybrid")


def mamba_hybrid_fields(text: dict[str, Any], built: Any, name: str) -> dict[str, Any]:
    """The ModelShape fields of a MAMBA2_HYBRID_TYPES or MAMBA1_HYBRID_TYPES decoder ({} for any other family, or
    where neither the class nor the file lists its blocks): which blocks mix tokens with Mamba, the mixer's sizes,
    and (Jamba) which blocks hold a mixture. `built`: the file's config class (plan/config_shape.py
    `built_config`); a UserError naming the key where a size is not a positive integer."""
    model_type = text.get("model_type")
    if model_type not in MAMBA2_HYBRID_TYPES + MAMBA1_HYBRID_TYPES:
        return {}
    built_text = None if built is None else text_of(built)

    def get(key: str) -> Any:
        value = getattr(built_text, key, None) if built_text is not None else None
        return value if value is not None else text.get(key)

    types = get("layer_types") or get("layers_block_type")
    if not isinstance(types, (list, tuple)) or not types:
        return {}
    mamba = [t in MAMBA_BLOCKS for t in types]
    fields: dict[str, Any] = dict(mamba_mixers=sum(mamba), mamba_parallel=model_type in PARALLEL_TYPES,
                                  mamba_conv_bias=get("mamba_conv_bias") is not False,
                                  mamba_bias=get("mamba_proj_bias") is True)
    experts = get("layers_num_experts")
    if isinstance(experts, (list, tuple)) and len(experts) == len(types):  # Jamba: mixtures every period-th block
        dense = [n <= 1 for n in experts]
        fields.update(dense_layers=sum(dense),
                      mamba_dense_mixers=sum(m and d for m, d in zip(mamba, dense, strict=True)))
    if model_type in SHARED_MLP_ONLY_TYPES and not get("num_local_experts"):
        fields.update(intermediate=_counts(get, name, ("shared_intermediate_size",))["shared_intermediate_size"])
    if model_type in MAMBA1_HYBRID_TYPES:
        sizes = _counts(get, name, ("hidden_size", "mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"))
        return dict(fields, mamba_v1=True, mamba_heads=1, mamba_head_dim=sizes["mamba_expand"] * sizes["hidden_size"],
                    mamba_state=sizes["mamba_d_state"], mamba_conv=sizes["mamba_d_conv"],
                    mamba_dt_rank=sizes["mamba_dt_rank"], mamba_inner_norms=True)
    sizes = _counts(get, name, ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"))
    if model_type in PARALLEL_TYPES:
        fields.update(mamba_out_bias=get("projectors_bias") is True, mamba_gated_norm=get("mamba_rms_norm") is True)
    return dict(fields, mamba_heads=sizes["mamba_n_heads"], mamba_head_dim=sizes["mamba_d_head"],
                mamba_state=sizes["mamba_d_state"], mamba_groups=sizes["mamba_n_groups"],
                mamba_conv=sizes["mamba_d_conv"], mamba_chunk=int(get("mamba_chunk_size") or 256))


def _counts(get: Any, name: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The sizes `keys` as `get` reads them; a UserError naming the first that is not a positive integer."""
    values = {k: get(k) for k in keys}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: config.json's {key} is {value!r}; it must be a positive integer (the Mamba "
                            f"mixer needs it; remove the key for the family's default).")
    return values
