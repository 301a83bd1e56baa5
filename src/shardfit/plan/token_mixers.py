"""What the time model needs of each kind of partial block a config.json lays out (plan/attention_layout.py
`AttentionLayout.groups`): its window, chunk or top-k, the FLOPs of a recurrent block's state update, a sparse
block's indexer. Torch-free; it reads the built config's attributes, or the file's keys where none was built.

A recurrent block other than Gated DeltaNet (which plan/flops.py `delta_rule_flops_per_token` counts from its own
sizes) is counted by the state each token updates, read by the keys its family names it with:
- Mamba and Mamba-2 (jamba, zamba, zamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h): its channels (the
  SSM's width: `mamba_d_ssm`, heads x head width, or `mamba_expand` x hidden) x the state size per channel
  (`mamba_d_state`, `ssm_state_size`, `state_size`);
- linear attention with a key-by-value state per head (olmo_hybrid, kimi_linear; MiniMax's lightning attention,
  LINEAR_ATTENTION_TYPES, with its softmax heads' sizes);
- RecurrentGemma's RG-LRU: a diagonal state as wide as `lru_width`;
- LFM's short convolution (`conv`): `conv_L_cache` taps per hidden channel.
Each state element a token updates costs three multiply-adds (decay it, add the token's input to it, read it out:
6 FLOPs), each convolution tap one (2 FLOPs). The products inside a chunk that chunked scans add (Mamba-2's SSD) are
left out, as is the cost of the blocks' input convolutions (a few taps per channel).
A recurrent block of a family this table does not know (Inkling's and ZAYA's "hybrid" blocks: attention beside short
convolutions or CCA, no state) is given no state update: it is timed as the attention its layout states, and a
block whose layout states none as whole attention (as before the blocks were told apart), never a guessed state.
A state key the family's class has but that is not a positive count (Bamba's `mamba_d_state: null`) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardfit.errors import UserError
from shardfit.plan.attention_layout import (
    CHUNK,
    FULL,
    RECURRENT,
    SPARSE,
    UNREAD,
    WINDOW,
    AttentionLayout,
    count_of,
)
from shardfit.plan.model_shape import BlockGroup

SCAN_FLOPS_PER_STATE = 6.0  # decay, input and read-out: three multiply-adds per state element
CONV_FLOPS_PER_TAP = 2.0
# Families whose recurrent blocks are linear attention with a key-by-value state per softmax head (MiniMax's
# lightning attention), sized by the heads of its softmax attention.
LINEAR_ATTENTION_TYPES = ("minimax",)
STATE_KEYS = ("mamba_d_state", "ssm_state_size", "state_size")


def block_groups(layout: AttentionLayout, get: Callable[[str], Any], has: Callable[[str], bool], *, name: str,
                 hidden: int, heads: int, head_dim: int, deltanet: bool) -> tuple[BlockGroup, ...]:
    """The partial blocks of `layout` as the time model counts them; `get` reads one key of the language model's
    config (None where it has none), `has` says whether it has the key at all (a UserError naming `name`'s key
    where a state size is there but not a count); `deltanet`: the recurrent blocks are Gated DeltaNet, which
    ModelShape's `linear_*` fields already count (they are left out here)."""
    groups = []
    for kinds, span, blocks in layout.groups:
        attention = _attention(kinds, deltanet)
        if attention is None:
            continue
        index = count_of(get("index_n_heads")) * count_of(get("index_head_dim")) if attention == SPARSE else 0
        recurrent = RECURRENT in kinds and not deltanet and UNREAD not in kinds
        flops = recurrence_flops(get, has, name=name, hidden=hidden, heads=heads, head_dim=head_dim) \
            if recurrent else 0.0
        if flops is None:  # a recurrence the table does not know: the attention its layout states, else whole
            flops, attention = 0.0, FULL if attention == "none" else attention
        groups.append(BlockGroup(blocks, attention, span, flops, index))
    return tuple(groups)


def _attention(kinds: tuple[str, ...], deltanet: bool) -> str | None:
    """What softmax attention blocks of `kinds` run (BlockGroup's `attention`); None: Gated DeltaNet blocks, which
    the shape's `linear_*` fields time. A layout that could not be read is timed as whole attention."""
    if UNREAD in kinds:
        return FULL
    if RECURRENT in kinds and deltanet:
        return None
    for kind in (CHUNK, WINDOW, FULL, SPARSE):
        if kind in kinds:
            return kind
    return "none"


def recurrence_flops(get: Callable[[str], Any], has: Callable[[str], bool], *, name: str, hidden: int, heads: int,
                     head_dim: int) -> float | None:
    """Forward FLOPs per token of one recurrent block's state update (the module docstring's table); None where the
    family's recurrence is not one the table knows."""
    def count(*keys: str) -> int:
        return next((count_of(get(k)) for k in keys if count_of(get(k))), 0)

    if state := count(*STATE_KEYS):
        channels = count("mamba_d_ssm") or count("mamba_n_heads") * count("mamba_d_head") or \
            count("mamba_num_heads") * count("mamba_head_dim") or (count("mamba_expand", "expand") or 2) * hidden
        return SCAN_FLOPS_PER_STATE * channels * state
    if count("linear_num_value_heads"):
        return SCAN_FLOPS_PER_STATE * count("linear_num_value_heads") * count("linear_key_head_dim") * \
            count("linear_value_head_dim")
    if count("linear_num_heads"):
        return SCAN_FLOPS_PER_STATE * count("linear_num_heads") * count("linear_head_dim") ** 2
    if count("lru_width"):
        return SCAN_FLOPS_PER_STATE * count("lru_width")
    if count("conv_L_cache"):
        return CONV_FLOPS_PER_TAP * count("conv_L_cache") * hidden
    if get("model_type") in LINEAR_ATTENTION_TYPES:
        return SCAN_FLOPS_PER_STATE * heads * head_dim * head_dim
    if odd := next((k for k in STATE_KEYS if has(k)), None):  # the family sizes its state by a key set to no count
        raise UserError(f"{name}: config.json '{odd}' is {get(odd)!r}: a recurrent block's state size must be a "
                        "positive count (Mamba-2's is 128).")
    return None
