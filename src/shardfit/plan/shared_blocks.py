"""The ModelShape fields of Zyphra's Zamba and Zamba2 (transformers' ZambaForCausalLM, Zamba2ForCausalLM): every
block is a Mamba mixer under one norm (Mamba-1 with per-head projections in Zamba, Mamba-2 in Zamba2) with no MLP,
and the "hybrid" blocks of `layers_block_type` also run a transformer block whose weights they share: one for the
whole model in Zamba, `num_mem_blocks` taken in turn in Zamba2. The shared block attends over the hidden state and
the embedding side by side (`attention_hidden_size`, twice the hidden width) with `attention_head_dim`-wide heads
and runs a gated MLP; each hybrid block adds a hidden x hidden linear of its own after it. Zamba2 adds low-rank
adapters (`adapter_rank`) that the shared block's copies keep per use: one on the MLP's fused gate/up projection,
and with `use_shared_attention_adapter` one on each of q, k and v; each copy of a shared block holds an adapter for
every hybrid block that runs it, whose weights are tied with the copies'.

Counted as a single-part decoder (plan/single_part.py) of Mamba blocks only, with the shared blocks' weights once
(`shared_params`) and every linear module the hybrid blocks hold (`shared_linears`): PEFT wraps each copy apart,
so LoRA adapts the shared weights once per hybrid block though the base weights are tied. Counting each block as
attention plus MLP, as any other family, weighs a default Zamba or Zamba2 130 % heavy.
"""

from __future__ import annotations

from typing import Any

from shardfit.errors import UserError
from shardfit.plan.attention_layout import text_of

SHARED_BLOCK_TYPES = ("zamba", "zamba2")
HYBRID = "hybrid"


def shared_block_fields(text: dict[str, Any], built: Any, name: str) -> dict[str, Any]:
    """The ModelShape fields of a SHARED_BLOCK_TYPES decoder ({} for any other family or where no class is at hand:
    only the class lays the blocks out and sizes the shared ones). `built`: the file's config class
    (plan/config_shape.py `built_config`); a UserError naming the key where a size is not a positive integer."""
    model_type = text.get("model_type")
    if model_type not in SHARED_BLOCK_TYPES or built is None:
        return {}
    c = text_of(built)
    types = list(getattr(c, "layers_block_type", None) or [])
    keys = ["hidden_size", "attention_hidden_size", "attention_head_dim", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "mamba_expand", "mamba_d_state", "mamba_d_conv"]
    keys += ["n_mamba_heads", "mamba_ngroups", "adapter_rank", "num_mem_blocks"] if model_type == "zamba2" else \
        ["mamba_dt_rank"]
    sizes = {k: getattr(c, k, None) for k in keys}
    for key, value in {"layers_block_type": len(types), **sizes}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: config.json's {key} is {value!r}; it must be a positive integer (remove the key "
                            f"for the family's default).")
    h, inner = sizes["hidden_size"], sizes["mamba_expand"] * sizes["hidden_size"]
    hybrids = types.count(HYBRID)
    fields: dict[str, Any] = dict(
        layers=len(types), single_part=True, mamba_layers=len(types), attention_layers=0, dense_layers=0,
        experts=1, top_k=1, heads=sizes["num_attention_heads"], kv_heads=sizes["num_key_value_heads"],
        head_dim=sizes["attention_head_dim"], attn_bias=False, o_bias=False, qk_norm=0,
        mamba_state=sizes["mamba_d_state"], mamba_conv=sizes["mamba_d_conv"])
    if model_type == "zamba":
        fields.update(mamba_v1=True, mamba_heads=1, mamba_head_dim=inner, mamba_dt_rank=sizes["mamba_dt_rank"],
                      mamba_bare_projections=True, mamba_conv_bias=getattr(c, "mamba_conv_bias", True) is not False,
                      mamba_bias=getattr(c, "mamba_proj_bias", False) is True)
        blocks, uses = [_shared_block(sizes, bias=False, fused=False)] * min(hybrids, 1), [0] * hybrids
        adapter: list[tuple[str, int, int]] = []
        adapters: dict[str, Any] = dict(shared_params=0, shared_linears=())
    else:
        bias = getattr(c, "add_bias_linear", False) is True
        heads, every = sizes["n_mamba_heads"], sizes["num_mem_blocks"]
        fields.update(mamba_heads=heads, mamba_head_dim=inner // heads, mamba_groups=sizes["mamba_ngroups"],
                      mamba_conv_bias=True, mamba_bias=bias, mamba_chunk=int(getattr(c, "chunk_size", None) or 256))
        blocks = [_shared_block(sizes, bias=bias, fused=True)] * min(hybrids, every)
        uses = [j % every for j in range(hybrids)]
        adapter = _adapter(sizes, getattr(c, "use_shared_attention_adapter", False) is True)
        adapters = _zamba2_adapters(c, every, len(blocks), uses, adapter)
    linears = tuple(lin for b in uses for lin in blocks[b][0] + [("linear_hybrid", h, h)])
    # each use runs its block's linears, its own linear and the one adapter set kept for it
    active = sum(i * o for _, i, o in linears) + hybrids * sum(i * o for _, i, o in adapter)
    return dict(fields, shared_params=sum(p for _, p in blocks) + hybrids * h * h + adapters["shared_params"],
                shared_linears=linears + adapters["shared_linears"], shared_active=active, shared_uses=hybrids)


def _shared_block(sizes: dict[str, int], *, bias: bool, fused: bool) -> tuple[list[tuple[str, int, int]], int]:
    """One shared transformer block: (name, in, out) of its linear layers, and all its weights (its norms over the
    attention's input and the MLP's, and the MLP's biases under `bias`). `fused`: the MLP's gate and up
    projections are one linear (Zamba2's gate_up_proj, which only all-linear LoRA reaches)."""
    h, a, m = sizes["hidden_size"], sizes["attention_hidden_size"], sizes["intermediate_size"]
    q, kv = sizes["num_attention_heads"] * sizes["attention_head_dim"], \
        sizes["num_key_value_heads"] * sizes["attention_head_dim"]
    mlp = [("linear_gate_up", h, 2 * m), ("down", m, h)] if fused else [("gate", h, m), ("up", h, m), ("down", m, h)]
    linears = [("q", a, q), ("k", a, kv), ("v", a, kv), ("o", q, h)] + mlp
    return linears, sum(i * o for _, i, o in linears) + a + h + (2 * m + h if bias else 0)


def _adapter(sizes: dict[str, int], attention: bool) -> list[tuple[str, int, int]]:
    """The linear layers of one use's adapters in Zamba2's shared block: the MLP's gate/up adapter and, with
    `attention`, q's, k's and v's."""
    h, a, m, r = sizes["hidden_size"], sizes["attention_hidden_size"], sizes["intermediate_size"], \
        sizes["adapter_rank"]
    mlp = [("linear_adapter", h, r), ("linear_adapter", r, 2 * m)]
    return mlp + [("linear_adapter", a, r), ("linear_adapter", r, a)] * 3 if attention else mlp


def _zamba2_adapters(c: Any, every: int, blocks: int, uses: list[int],
                     adapter: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Zamba2's adapters: each shared block `b` (of `blocks`) holds one for every i of the config's
    `hybrid_layer_ids` with i % `every` == b, weights counted once; each hybrid block's copy of its block (`uses`:
    which block each runs) holds the same modules, which LoRA adapts apart."""
    count = len(getattr(c, "hybrid_layer_ids", None) or [])
    held = [sum(1 for i in range(count) if i % every == b) for b in range(blocks)]
    weights = sum(held) * sum(i * o for _, i, o in adapter)
    return dict(shared_params=weights, shared_linears=tuple(lin for b in uses for lin in adapter * held[b]))
