"""The forward of a Gemma 3-style vision-language body on a training batch: token embeddings, the vision tower and
projector's soft tokens written into the image tokens, then the language model under the model's own mask, causal
except that the tokens of one image see each other both ways.

As for the Qwen2-VL-style bodies (train/media_forward.py), every batch runs the same modules in the same order:
a batch without images runs the tower and projector on one blank image whose result is multiplied by zero, so
under FSDP2 / ZeRO-3 a rank without an image gathers the same units as a rank with one.

The mask is built by transformers' own Gemma 3 helpers from token_type_ids (1 at the image tokens, as
Gemma3Processor marks them), so it is the mask the model's forward builds. It is exact for rows that each hold one
example: shardfit leaves Gemma 3's image rows unpacked (train/recipe.py), since a packed row's per-example block
mask and the image blocks are not composed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def soft_token_forward(body: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                       pixel_values: torch.Tensor | None, routed: dict[str, bool] | None = None) -> Any:
    """A Gemma 3 body (`vision_tower`, `multi_modal_projector`, `language_model`) on a batch of rows with 1-D
    positions; `pixel_values`: (images, 3, side, side) in the order of their tokens. Returns the language model's
    output."""
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    image = input_ids == body.config.image_token_id
    ids = input_ids
    if body.config.image_token_id >= body.vocab_size:  # an image token outside the vocabulary: embed it as 0
        ids = input_ids.masked_fill(image, 0)
    embeds = body.get_input_embeddings()(ids)
    if pixel_values is None:
        embeds = embeds + idle_soft_tokens(body, embeds)
    else:
        feats = soft_tokens(body, pixel_values)
        embeds = embeds.masked_scatter(image.unsqueeze(-1), feats.to(embeds.dtype))
    blocks = get_block_sequence_ids_for_mask(image.long(), device=embeds.device)
    masks = create_masks_for_vision_model(config=body.config.get_text_config(), inputs_embeds=embeds,
                                          attention_mask=None, past_key_values=None, position_ids=position_ids,
                                          block_sequence_ids=blocks)
    return body.language_model(attention_mask=masks, position_ids=position_ids, inputs_embeds=embeds,
                               use_cache=False, **(routed or {}))


def soft_tokens(body: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """The projector's soft tokens of each image, (images, tokens per image, width): the tower's last hidden
    states, pooled to the soft-token grid, normed and projected (the model's own get_image_features)."""
    tower = body.vision_tower
    dtype = getattr(tower, "vision_model", tower).embeddings.patch_embedding.weight.dtype
    out = tower(pixel_values=pixel_values.to(dtype), return_dict=True)
    return body.multi_modal_projector(out.last_hidden_state)


def idle_soft_tokens(body: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """Zero, computed through the tower and projector on one blank image of the tower's size: a batch without
    images still runs every vision unit (their collectives stay matched across ranks, and a trainable projector
    gets its zero gradient on every rank)."""
    side = int(body.config.vision_config.image_size)
    channels = int(body.config.vision_config.num_channels)
    pixels = torch.zeros(1, channels, side, side, dtype=like.dtype, device=like.device)
    return soft_tokens(body, pixels).sum().to(like.dtype) * 0.0
