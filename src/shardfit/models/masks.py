"""The attention-mask argument a text decoder gets for one micro-batch, decided from what the host knows.

Given position ids and no mask, transformers looks for packed rows (a position restart) on the device and reads the
answer back (`find_packed_sequence_indices`): on a GPU the host then waits for the device at every forward. The
batch already knows on the host whether any row restarts its positions (`Batch.restarts`), so:
- SDPA on rows without a restart, and a decoder that takes one mask per layer type (Qwen2, Qwen3, Gemma 3, ...):
  that mapping with no mask, which is what transformers would have found (SDPA then runs its causal kernel);
- otherwise (restarts; eager attention, whose causal mask is always built): the mask transformers would have
  built, built with its own mask functions without the read-back, given as the mapping or as the ready 4-D mask
  transformers passes through as it is;
- restarts in a decoder with full and sliding-window layers that takes the mapping (gpt-oss, Gemma 3, Qwen3 with
  windows): each layer type's mask, causal (and within the window) inside each example. Not only to spare the wait:
  some models never give transformers the positions to find the examples by (gpt-oss 5.23's mask arguments leave
  them out), and their packed rows would attend across examples;
- flex attention on full-attention decoders: the block mask of the examples (causal within each), built from the
  positions on the host's word that a row restarts, so the kernel skips the blocks across examples;
- anything else (no host facts, chunked layers, a windowed decoder without the mapping, windows that differ by
  block (a per_layer_config), another attention kernel, SDPA on rows without a restart in a decoder without the
  mapping, such as Llama's): no argument, transformers decides as before.
Every case gives the attention kernel the mask transformers means for these rows; only the wait goes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from transformers import masking_utils as mu

# Attention kernels whose mask transformers builds with `create_causal_mask`'s mask functions (flash attention
# reads packed rows from the positions itself; flex attention wants a block mask).
_DENSE_MASK_KERNELS = ("sdpa", "eager")


@functools.cache
def takes_mask_mapping(decoder_cls: type) -> bool:
    """Whether the decoder class's forward accepts `attention_mask` as a {layer type: mask} mapping (transformers'
    models that do test `isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    try:
        source = inspect.getsource(decoder_cls.forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source


# What `_one_value` gives for a key a heterogeneous config sets block by block.
_PER_BLOCK = object()


def _one_value(config: Any, key: str) -> Any:
    """`key` of `config` where every block shares it (None where unset), or _PER_BLOCK where a heterogeneous config
    (transformers' per_layer_config) sets it per block: transformers raises on reading such a key globally
    (AmbiguousGlobalPerLayerAttributeError, a RuntimeError), and one mask per layer type cannot hold windows that
    differ by block."""
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        return _PER_BLOCK
    try:
        return getattr(config, key, None)
    except RuntimeError:
        return _PER_BLOCK


def _full_attention_only(config: Any) -> bool:
    """Every layer attends causally over the whole row (no sliding window, no chunks)."""
    types = _one_value(config, "layer_types")
    return (types is None or (types is not _PER_BLOCK and set(types) == {"full_attention"})) \
        and not _one_value(config, "sliding_window") and not _one_value(config, "attention_chunk_size")


def _full_and_sliding_only(config: Any) -> bool:
    """Every layer attends causally over the whole row or within one sliding window (no chunks, no window that
    differs by block)."""
    types, window = _one_value(config, "layer_types"), _one_value(config, "sliding_window")
    return types is not _PER_BLOCK and bool(types) and set(types) <= {"full_attention", "sliding_attention"} \
        and window is not _PER_BLOCK and bool(window) and not _one_value(config, "attention_chunk_size")


def block_causal_mask(config: Any, position_ids: torch.Tensor, dtype: torch.dtype,
                      window: int | None = None) -> torch.Tensor:
    """The mask transformers builds for these rows (causal, within `window` tokens when given, within each example
    of a row), without reading the device: its packed-sequence ids from the position restarts (none: plain causal),
    and its own mask functions for the kernel."""
    batch, width = position_ids.shape
    first = position_ids[:, :1] - 1
    sequence = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    base = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    fn = mu.packed_sequence_compatibility_function(base, position_ids, sequence)
    make = mu.ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]
    return make(batch_size=batch, q_length=width, kv_length=width, q_offset=0, kv_offset=0, mask_function=fn,
                attention_mask=None, allow_is_causal_skip=False, dtype=dtype, config=config, use_vmap=False,
                device=position_ids.device)


def _flex_argument(decoder: nn.Module, config: Any, position_ids: torch.Tensor, mapping: bool) -> dict[str, Any]:
    """Flex attention's block mask, from the example boundaries the positions give (plain causal without a
    restart): the kernel then skips the blocks across examples instead of computing a dense square. Built with
    transformers' own functions, with or without restarts, so it never reads the device to look for them."""
    if not _full_attention_only(config):
        return {}  # windows and chunks: transformers' own masks
    mask = block_causal_mask(config, position_ids, decoder.get_input_embeddings().weight.dtype)
    return {"attention_mask": {"full_attention": mask} if mapping else mask}


def mask_argument(decoder: nn.Module, position_ids: torch.Tensor | None, restarts: bool | None) -> dict[str, Any]:
    """The keyword arguments (`attention_mask` or none) to call `decoder` with for this micro-batch (module doc)."""
    config = getattr(decoder, "config", None)
    if restarts is None or position_ids is None or position_ids.dim() != 2 or config is None:
        return {}
    if not getattr(config, "is_causal", True):
        return {}
    mapping = takes_mask_mapping(type(decoder))
    if config._attn_implementation == "flex_attention":
        return _flex_argument(decoder, config, position_ids, mapping)
    if config._attn_implementation not in _DENSE_MASK_KERNELS:
        return {}
    if not _full_attention_only(config):
        if not (restarts and mapping and _full_and_sliding_only(config)):
            return {}
        dtype = decoder.get_input_embeddings().weight.dtype
        return {"attention_mask": {"full_attention": block_causal_mask(config, position_ids, dtype),
                                   "sliding_attention": block_causal_mask(config, position_ids, dtype,
                                                                          config.sliding_window)}}
    if not restarts and config._attn_implementation == "sdpa":
        # No mask: SDPA's causal kernel, as transformers finds. (Without the mapping there is no way to say it.)
        return {"attention_mask": {"full_attention": None}} if mapping else {}
    mask = block_causal_mask(config, position_ids, decoder.get_input_embeddings().weight.dtype)
    return {"attention_mask": {"full_attention": mask} if mapping else mask}
