"""The forward of a vision-language body on a training batch: token embeddings, the audio tower's features in the
audio tokens, the vision tower's in the image and video tokens, then the language model (with the deepstack
features of Qwen3-VL's and Qwen3-Omni's towers, where the tower makes them).

The steps are the body's own forward, spelled out so that a batch without images, videos or audio runs the same
modules in the same order (embedding, audio tower, vision tower once, language model): under FSDP2 every rank must
gather the same units in the same sequence, or the collectives mismatch. Images and videos therefore go through
the vision tower in one call, their features split after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfit.parallel.ulysses import SHARD_KWARG, SequenceShard


def vision_language_forward(body: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                            input_features: torch.Tensor | None = None,
                            audio_feature_lens: torch.Tensor | None = None,
                            pixel_values_videos: torch.Tensor | None = None,
                            video_grid_thw: torch.Tensor | None = None,
                            routed: dict[str, bool] | None = None) -> Any:
    """A Qwen2-VL-style body (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.5V, a Qwen2.5-Omni or Qwen3-Omni thinker) on a
    batch with (4, rows, width) positions; returns the language model's output. With a sequence shard in `routed`
    (sequence parallelism), the ids and positions are the whole rows': the embeddings are built for the whole rows
    and the language model runs on this rank's slice of them (`_my_slice`)."""
    embeds = body.get_input_embeddings()(input_ids)
    audio = getattr(body, "audio_tower", None)
    if audio is not None:
        if input_features is None:
            embeds = embeds + idle_audio(audio, embeds)
        else:
            out = audio(input_features.to(_input_dtype(audio)), feature_lens=audio_feature_lens)
            mask = (input_ids == body.config.audio_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, out.last_hidden_state.to(embeds.dtype))
    media = [(p, g, tok) for p, g, tok in ((pixel_values, image_grid_thw, body.config.image_token_id),
                                           (pixel_values_videos, video_grid_thw,
                                            getattr(body.config, "video_token_id", None))) if p is not None]
    embeds, deepstack = _with_vision(body.visual, input_ids, embeds, media)
    shard = (routed or {}).get(SHARD_KWARG)
    if shard is not None:
        embeds, position_ids, deepstack = _my_slice(shard, embeds, position_ids, deepstack)
    return body.language_model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **deepstack,
                               **(routed or {}))


def _my_slice(shard: SequenceShard, embeds: torch.Tensor, position_ids: torch.Tensor,
              deepstack: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This rank's contiguous slice of the whole rows' embeddings [rows, width, dim] and positions [4, rows, width],
    and of the deepstack inputs: the media-token mask cut like the rows, and of each layer's features (one row per
    media token, in the order of the tokens over the rows) the rows whose tokens fall in this rank's slice."""
    if deepstack:
        visual = deepstack["visual_pos_masks"]
        keep = shard.mine(torch.arange(visual.shape[-1], device=visual.device), 0)
        inside = torch.zeros_like(visual)
        inside[:, keep] = True
        picked = inside[visual]  # for each media token in order: whether it is in this slice
        deepstack = {"visual_pos_masks": shard.mine(visual, 1),
                     "deepstack_visual_embeds": [f[picked] for f in deepstack["deepstack_visual_embeds"]]}
    # A copy, not a view: the first block saves its input for backward, and a view would keep the whole rows'
    # embeddings alive with it through the step.
    return shard.mine(embeds, 1).clone(), shard.mine(position_ids, -1), deepstack


def embed_images(body: nn.Module, input_ids: torch.Tensor, embeds: torch.Tensor, pixel_values: torch.Tensor | None,
                 image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """`embeds` with the vision tower's features of the images in their tokens, the tower run idle on rows without
    images, as `vision_language_forward` does for a Qwen2-VL-style body without deepstack: what a pipeline's first
    stage runs (parallel/pipeline.py)."""
    media = [(pixel_values, image_grid_thw, body.config.image_token_id)] if pixel_values is not None else []
    return _with_vision(body.visual, input_ids, embeds, media)[0]


def _with_vision(visual: nn.Module, input_ids: torch.Tensor, embeds: torch.Tensor,
                 media: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """`embeds` with the tower's features of `media` in their tokens (and the deepstack inputs, if the tower has
    them), or, on rows without media, the tower run idle so that every rank runs it (ZeRO-3's gathers)."""
    if not media:
        return embeds + idle_vision(visual, embeds), {}
    return _with_media(visual, input_ids, embeds, media)


def _with_media(visual: nn.Module, input_ids: torch.Tensor, embeds: torch.Tensor,
                media: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """`embeds` with the tower's features of every image and video written into their tokens, and the language
    model's deepstack inputs (empty for a tower without them)."""
    # One kind of media goes in as it is: a concatenated copy would be one more tensor the tower saves.
    pixels = media[0][0] if len(media) == 1 else torch.cat([p for p, _, _ in media])
    grids = media[0][1] if len(media) == 1 else torch.cat([g for _, g, _ in media])
    out = visual(pixels.to(visual.dtype), grid_thw=grids)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    merge = visual.spatial_merge_size ** 2
    spans = []  # (token mask, first feature row, rows) of each kind of media
    first = 0
    for _, g, tok in media:
        n = int(g.prod(-1).sum()) // merge
        mask = input_ids == tok
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), feats[first:first + n].to(embeds.dtype))
        spans.append((mask, first, n))
        first += n
    layers = list(getattr(out, "deepstack_features", None) or [])
    return embeds, (deepstack_inputs(spans, layers) if layers else {})


def deepstack_inputs(spans: list[tuple[torch.Tensor, int, int]], layers: list[torch.Tensor]) -> dict[str, Any]:
    """Qwen3-VL's deepstack: features of some vision blocks (`layers`, each a row per media token, images then
    videos as the tower ran them) that the language model adds to the hidden states of its first blocks at the
    media tokens. Its forward takes them in the order of the tokens (`visual_pos_masks`): with images and videos
    both in the batch, each kind's rows go where its own tokens sit among all media tokens, as the model's own
    forward arranges them."""
    visual = spans[0][0]
    for mask, _, _ in spans[1:]:
        visual = visual | mask
    if len(spans) == 1:
        return {"visual_pos_masks": visual, "deepstack_visual_embeds": layers}
    joint = []
    for f in layers:
        rows = f.new_zeros(int(visual.sum()), f.shape[-1])
        for mask, first, n in spans:
            rows[mask[visual]] = f[first:first + n]
        joint.append(rows)
    return {"visual_pos_masks": visual, "deepstack_visual_embeds": joint}


def idle_audio(audio: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """Zero, computed through the audio tower on four frames of silence (one output token in Qwen2.5-Omni's tower
    and in Qwen3-Omni's): the audio tower's counterpart of `idle_vision`, for a batch without clips."""
    frames = 4
    features = torch.zeros(audio.num_mel_bins, frames, dtype=_input_dtype(audio), device=like.device)
    out = audio(features, feature_lens=torch.tensor([frames], device=like.device))
    return out.last_hidden_state.sum().to(like.dtype) * 0.0


def _input_dtype(audio: nn.Module) -> torch.dtype:
    """The dtype the audio tower's first layer computes in (Qwen2.5-Omni's conv1, Qwen3-Omni's conv2d1)."""
    return audio.get_input_embeddings().weight.dtype


def idle_vision(visual: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """Zero, computed through the vision tower on one tiny blank image.

    A batch without images would skip the tower, but under FSDP2 each vision block's all-gather (and under DDP a
    trainable merger's gradient) is a collective: a rank that skips it while another rank runs it waits forever
    (the classic ZeRO-3 stall of VL models). Running every rank through the tower on every step keeps the
    collectives matched; the result is multiplied by zero, so the loss and the gradients are unchanged. Qwen3-VL's
    deepstack mergers join the sum, so that their gradient (zero) exists on every rank too."""
    embed = visual.patch_embed
    merge = visual.spatial_merge_size
    dim = embed.in_channels * embed.temporal_patch_size * embed.patch_size * embed.patch_size
    pixels = torch.zeros(merge * merge, dim, dtype=like.dtype, device=like.device)
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    out = visual(pixels, grid_thw=grid)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    total = feats.sum()
    for f in getattr(out, "deepstack_features", None) or []:
        total = total + f.sum()
    return total.to(like.dtype) * 0.0
