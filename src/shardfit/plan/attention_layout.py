"""Which decoder blocks of a built transformers config attend over less than the whole row, and how: the one rule
by which the planner (plan/config_shape.py `attention_layout`, on the class built from a config.json) and the rank
(resolve/sequence.py `facts_of_config`, on the loaded model's config) read a layout, so that the sequence-parallel
and pipeline rules refuse the same models on both sides. Torch-free; it imports nothing of transformers and reads
only attributes of the config object it is given.

Blocks are read by their `layer_types` names (transformers' configuration_utils.ALLOWED_LAYER_TYPES and its legacy
names); without them, by `attention_chunk_size` and by `sliding_window` under Qwen's `use_sliding_window`. A config
that transformers builds heterogeneous (`per_layer_config`: dots3_note, embedding_gemma2, neomme) raises when one of
its per-layer attributes is read globally, so it is read block by block from its per-layer view. A window that is
not a size, a list of windows whose length is not the blocks', or a layer type this table does not know reads as
UNREAD: a partial layout, which the rules refuse with a message instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

WINDOW, CHUNK, RECURRENT, SPARSE, UNREAD = "window", "chunk", "recurrent", "sparse", "unread"
KINDS = (WINDOW, CHUNK, RECURRENT, SPARSE, UNREAD)

# How the rules' refusals name each kind of block.
WORDS = {
    WINDOW: "sliding-window attention layers",
    CHUNK: "chunked attention layers",
    RECURRENT: "recurrent layers (linear attention, Mamba-style state spaces or short convolutions)",
    SPARSE: "sparse attention layers (keys picked by an indexer, or compressed)",
    UNREAD: "an attention layout this version cannot read from its config (a per-layer or unusual "
            "sliding_window, attention_chunk_size or layer_types)",
}

# What each `layer_types` name does. Blocks without attention (nemotron_h's "mlp" and "moe", the MLP layer-type
# names "dense" and "sparse") act per token and split like full attention. "hybrid" blocks run attention beside a
# recurrent state (zamba2, falcon_h1, zaya); "reference_sliding_attention" (unlimited_ocr) slides over generated
# tokens; "conv" is LFM's short convolution, which reaches back a few tokens as a recurrence does.
TYPE_KINDS: dict[str, tuple[str, ...]] = {
    "full_attention": (), "attention": (), "mlp": (), "moe": (), "dense": (), "sparse": (),
    "sliding_attention": (WINDOW,), "window_attention": (WINDOW,), "reference_sliding_attention": (WINDOW,),
    "chunked_attention": (CHUNK,),
    "linear_attention": (RECURRENT,), "mamba": (RECURRENT,), "conv": (RECURRENT,), "hybrid": (RECURRENT,),
    "hybrid_sliding": (WINDOW, RECURRENT),
    "indexed_attention": (SPARSE,), "deepseek_sparse_attention": (SPARSE,), "qwen_sparse_attention": (SPARSE,),
    "compressed_sparse_attention": (SPARSE,), "heavily_compressed_attention": (SPARSE,),
    "minimax_m3_sparse": (SPARSE,),
}
# Block types the time model counts as attention over the whole row, their kinds in `groups` also holding FULL:
# "hybrid" blocks, whose recurrent state runs beside attention (zamba2's shared attention block), and the sparse
# types whose keys are not a top-k of the row's (DeepSeek-V4's compressed ones) or whose picking transformers does
# not state (qwen_sparse_attention, minimax_m3_sparse). The rest of the sparse types attend to an indexer's
# `index_topk` of the row's keys (DeepSeek-V3.2's DSA).
FULL = "full"
TIMED_WHOLE = ("hybrid", "compressed_sparse_attention", "heavily_compressed_attention", "qwen_sparse_attention",
               "minimax_m3_sparse")
# Families whose every block is recurrent and whose configs list no layer_types.
RECURRENT_MODEL_TYPES = ("rwkv", "xlstm")
# Families that name their blocks' attention under other keys: (the list of per-block names, the window's key, what
# each name is as a layer type). GPT-Neo's "local" blocks attend to the last `window_size` positions
# (GPTNeoSelfAttention masks everything `window_size` or more positions back), its "global" ones to the whole row.
BLOCK_NAME_KEYS: dict[str, tuple[str, str, dict[str, str]]] = {
    "gpt_neo": ("attention_layers", "window_size", {"global": "full_attention", "local": "sliding_attention"}),
}
# Families whose flash-attention class passes the kernel no window (GPTNeoFlashAttention2): their windowed blocks
# attend to the whole row under flash, which the time model counts.
FLASH_UNWINDOWED_TYPES = ("gpt_neo",)


def odd_setting(config: Any) -> str | None:
    """What is wrong with a setting of a built `config`'s language model that transformers accepts but whose blocks
    cannot run as set, naming the key and its fix (None: nothing): an indexer's `index_topk` that picks no keys
    (topk of 0 or fewer masks every key), or a BLOCK_NAME_KEYS family's window that is not a positive size or block
    name its class does not know (GPT-Neo's blocks raise on both)."""
    text = text_of(config)
    topk = getattr(text, "index_topk", None)
    if isinstance(topk, (int, float)) and not isinstance(topk, bool) and (topk <= 0 or topk != int(topk)):
        return f"'index_topk' is {topk!r}: the indexer must pick a positive number of keys (DeepSeek-V3.2 picks 2048)"
    model_type = getattr(text, "model_type", None)
    if model_type not in BLOCK_NAME_KEYS:
        return None
    key, window_key, names = BLOCK_NAME_KEYS[model_type]
    named = getattr(text, key, None)
    odd = sorted({t for t in named if t not in names}) if isinstance(named, (list, tuple)) else []
    if odd:
        return f"'{key}' names {', '.join(map(repr, odd))}: each block is one of {', '.join(map(repr, names))}"
    window = getattr(text, window_key, None)
    if isinstance(window, (int, float)) and not isinstance(window, bool) and window <= 0 and \
            any(names.get(t) == "sliding_attention" for t in named or ()):
        return f"'{window_key}' is {window!r}: local blocks attend within a positive number of tokens (256)"
    return None


class _Unread(ValueError):
    """A value the layout cannot be read from."""


@dataclass(frozen=True)
class AttentionLayout:
    """The blocks that do not attend over the whole row: how many, the window or chunk they attend within (the
    largest where blocks differ; 1 where they have none, as recurrent blocks), and what they do (of KINDS, in its
    order), which the rules read; and for the time model each kind of partial block apart (`groups`: its kinds,
    its own window, chunk or sparse top-k (0: none or unknown), and how many blocks, in the order they first
    appear; left out of equality, which is the rules' reading)."""

    span: int = 0
    blocks: int = 0
    kinds: tuple[str, ...] = ()
    groups: tuple[tuple[tuple[str, ...], int, int], ...] = field(default=(), compare=False)

    @property
    def partial(self) -> bool:
        """Whether any block attends over less than the whole row (the rules refuse to split or cut such a model)."""
        return self.blocks > 0


def text_of(config: Any) -> Any:
    """The language model's part of a built config: its text_config, Qwen-Omni's thinker's, or itself."""
    thinker = getattr(config, "thinker_config", None)
    return getattr(config, "text_config", None) or getattr(thinker, "text_config", None) or config


def refusal(kinds: tuple[str, ...]) -> str:
    """What a refusal says a partial layout has ("has sliding-window attention layers"). No kinds: a window (the
    catalog's shapes state only the window and its blocks)."""
    return "has " + " and ".join(WORDS[k] for k in KINDS if k in (kinds or (WINDOW,)))


def layout_of(config: Any) -> AttentionLayout:
    """The layout of the language model of a built transformers `config`; UNREAD (refused) where its settings cannot
    be read, never an exception."""
    text, layers = text_of(config), 0
    try:
        layers = count_of(getattr(text, "num_hidden_layers", 0))
        if getattr(text, "model_type", None) in RECURRENT_MODEL_TYPES:
            return AttentionLayout(1, max(layers, 1), (RECURRENT,), (((RECURRENT,), 0, max(layers, 1)),))
        return _read(text, layers)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError):  # RuntimeError: a global per-layer read
        return AttentionLayout(1, max(layers, 1), (UNREAD,), (((UNREAD,), 0, max(layers, 1)),))


def carries_state(config: Any) -> bool:
    """Whether a built config's language model has recurrent blocks (linear attention, Mamba-style state spaces,
    short convolutions), whose state runs along the whole row: examples packed into one row would leak into each
    other through it, where attention keeps them apart with the packed-row mask."""
    return RECURRENT in layout_of(config).kinds


def _read(text: Any, layers: int) -> AttentionLayout:
    """The layout block by block: each block's layer type, else its chunk, else its window (under
    use_sliding_window); a chunk the types place nowhere still counts, since the rank refuses any chunked config."""
    types, window_key = _types(text)
    per_layer = _block_configs(text)
    kinds: set[str] = set()
    groups: dict[tuple[tuple[str, ...], int], int] = {}
    chunk_seen = 0
    for i in range(len(types) if types is not None else layers):
        block = per_layer[i] if i < len(per_layer) else text
        chunk = _size(_at(block, "attention_chunk_size", i, layers))
        chunk_seen = max(chunk_seen, chunk)
        if types is not None:  # the window is read only where the block's type slides
            own = TYPE_KINDS.get(types[i], (UNREAD,))
        elif chunk:
            own = (CHUNK,)
        else:
            own = (WINDOW,) if _at(block, "use_sliding_window", i, layers, True) and _slides(block, i, layers) else ()
        if own:
            kinds.update(own)
            span = chunk if CHUNK in own else _window(block, i, layers, window_key) if WINDOW in own else \
                _size(getattr(block, "index_topk", None)) if SPARSE in own else 0
            timed = (*own, FULL) if types is not None and types[i] in TIMED_WHOLE else own
            groups[timed, span] = groups.get((timed, span), 0) + 1
    spans = [span for own, span in groups if WINDOW in own or CHUNK in own]
    if chunk_seen and CHUNK not in kinds:  # a chunk the layer_types do not place: the rules refuse it all the same
        kinds.add(CHUNK)
        groups, spans = groups or {((CHUNK,), chunk_seen): layers}, [*spans, chunk_seen]
    if not groups:
        return AttentionLayout()
    return AttentionLayout(max(spans, default=0) or 1, sum(groups.values()), tuple(k for k in KINDS if k in kinds),
                           tuple((own, span, n) for (own, span), n in groups.items()))


def _types(text: Any) -> tuple[list[str] | None, str]:
    """The blocks' layer types (None: the config lists none) and the key of their window: `layer_types` and
    `sliding_window`, or a family's own names for them (BLOCK_NAME_KEYS)."""
    types = getattr(text, "layer_types", None)
    if types is None and getattr(text, "model_type", None) in BLOCK_NAME_KEYS:
        key, window_key, names = BLOCK_NAME_KEYS[text.model_type]
        named = getattr(text, key, None)
        if isinstance(named, (list, tuple)) and all(isinstance(t, str) for t in named):
            return [names.get(t, t) for t in named], window_key
        raise _Unread(key)
    if types is not None and not (isinstance(types, (list, tuple)) and all(isinstance(t, str) for t in types)):
        raise _Unread("layer_types")
    return types, "sliding_window"


def _block_configs(text: Any) -> list[Any]:
    """Each block's own config where transformers built `text` heterogeneous (its per-layer view); else none (every
    block reads the config itself)."""
    if getattr(text, "per_layer_attributes", None):
        return list(text.per_layer_config)
    return []


def _at(config: Any, key: str, block: int, layers: int, default: Any = None) -> Any:
    """`key` of `config` for `block`: a list of one value per block gives the block's own."""
    value = getattr(config, key, default)
    if isinstance(value, (list, tuple)):
        if len(value) != layers:
            raise _Unread(key)
        return value[block]
    return value


def _window(block: Any, index: int, layers: int, key: str = "sliding_window") -> int:
    """The window block `index` attends within (0: none), under the config's `key` for it."""
    return _size(_at(block, key, index, layers))


def _slides(block: Any, index: int, layers: int) -> bool:
    """Whether block `index` has a window shorter than the longest row the model takes: a window of at least
    max_position_embeddings never slides (Phi-3.5-mini and Phi-3 128k publish 262144 over 131072 positions)."""
    window, longest = _window(block, index, layers), count_of(getattr(block, "max_position_embeddings", 0))
    return window > 0 and not (longest and window >= longest)


def _size(value: Any) -> int:
    """A window or chunk as a count of tokens (0: none)."""
    if value is None or value is False:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise _Unread(repr(value))
    return int(value)


def count_of(value: Any) -> int:
    """`value` where it is a positive count, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def block_counts(config: Any, key: str) -> list[int]:
    """Every value `config` gives `key` (a count: heads, experts, a rank) across its blocks: the per-layer view's of
    a heterogeneous config, the items of a list, or its one value; non-counts left out."""
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        values = [getattr(block, key, None) for block in config.per_layer_config]
    else:
        values = [getattr(config, key, None)]
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    return [v for v in flat if count_of(v)]


def common_count(config: Any, key: str) -> int:
    """The largest count every block's `key` divides by (its one value where blocks agree; 0 where none): what a
    split over ranks must divide, as attention heads must."""
    return math.gcd(*block_counts(config, key))
