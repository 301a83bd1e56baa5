"""Where things are in a model: the text model that trains, its decoder body, output head, repeated blocks and
input embedding. Every stage asks here, so composite models (a peft wrapper, Qwen-Omni's thinker, Qwen2-VL's
language model) are handled once."""

from __future__ import annotations

import torch
from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def text_model(model: nn.Module) -> nn.Module:
    """The model whose text forward shardfit trains: Qwen-Omni's thinker (its talker and token2wav only produce
    speech), else the base model."""
    base = base_model(model)
    thinker = getattr(base, "thinker", None)
    return thinker if thinker is not None else base


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body and output head of a causal LM (through a peft wrapper and an Omni thinker).

    Models whose head and decoder are reachable through `get_output_embeddings` / `get_decoder` (Qwen2-VL's
    language model among them), or through `model` where `get_decoder` answers the model itself, are covered;
    anything else is not a model shardfit trains (TypeError)."""
    base = text_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is base:
        # transformers' lookup fell back to the whole model: Llama4ForCausalLM's `base_model_prefix` names an
        # attribute it lacks (its body is `model`). The body is then the `model` beside the head; without one, the
        # "decoder" would return logits where the loss expects hidden states.
        decoder = getattr(base, "model", None)
    if decoder is None or head is None:
        raise TypeError(f"{type(base).__name__} exposes no decoder/output head; shardfit trains causal LMs")
    return decoder, head


def output_vocab(model: nn.Module) -> int:
    """Rows of the output head's weight: the logits per position (a LoRA-wrapped head reports its base's)."""
    _, head = decoder_and_head(model)
    out = getattr(head, "out_features", None)
    return int(out) if out is not None else int(head.weight.shape[0])


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers, in order (the units of FSDP, checkpointing and compilation)."""
    decoder, _ = decoder_and_head(model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = next((m for m in decoder.modules() if isinstance(m, nn.ModuleList)), None)
    return list(layers) if layers is not None else []


def untied_input_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding when it does not share its weight with the output head; None when tied (a tied pair
    must stay together) or absent."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if emb is None or getattr(emb, "weight", None) is None:
        return None
    _, head = decoder_and_head(model)
    if head is None or getattr(head, "weight", None) is emb.weight:
        return None
    return emb


def input_device(model: nn.Module) -> torch.device:
    """Where a batch must go: the device of the input embedding (under model_parallel the first block's GPU),
    else of any parameter."""
    try:
        decoder, _ = decoder_and_head(model)
    except TypeError:
        decoder = None
    emb = decoder.get_input_embeddings() if decoder is not None and hasattr(decoder, "get_input_embeddings") else None
    if emb is not None:
        return emb.weight.device
    return next(model.parameters()).device


# Model types whose image path shardfit trains: the vision tower's features fill the image placeholder tokens and
# the language model takes 3-D M-RoPE positions (Qwen3-VL's also its deepstack features, train/media_forward.py).
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe")
# Of those, the ones whose videos shardfit trains (not GLM-4.5V's, whose frames take timestamps and positions of
# their own).
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Of those, the ones that write a timestamp and vision_start / vision_end around each temporal patch of a video.
TIMESTAMPED_VIDEO_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Qwen2.5-Omni and Qwen3-Omni-MoE (whole, or the thinker alone): images and audio, when the folder has the processor
# files; without them the thinker trains on text. `build_model` marks a thinker that trains on media with MEDIA_FLAG.
OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_omni_moe", "qwen3_omni_moe_thinker")
# Of those, the ones whose audio tower cuts a clip into chunks of 2 x n_window frames (Qwen3-Omni's): another token
# count per clip (plan/audio.py `clip_tokens`).
CHUNKED_AUDIO_MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
# Gemma 3 (whole): images, when its folder has preprocessor_config.json (without it, its language model trains on
# text as before). Each image becomes a fixed number of soft tokens read with 1-D positions and attended to both
# ways within the image (a SigLIP tower and a pooling projector, train/soft_token_forward.py).
SOFT_TOKEN_MODEL_TYPES = ("gemma3",)
# The types whose folder decides whether they train on media: `build_model` marks such a model with MEDIA_FLAG.
FLAGGED_MEDIA_TYPES = OMNI_MODEL_TYPES + SOFT_TOKEN_MODEL_TYPES
MEDIA_FLAG = "shardfit_trains_media"


def trains_images(model: nn.Module) -> bool:
    """Whether shardfit's forward of this model runs its vision tower (and audio tower, where it has one): a
    Qwen2-VL-style model, or a Qwen-Omni thinker built to train on media."""
    text = text_model(model)
    kind = getattr(getattr(text, "config", None), "model_type", None)
    media = kind in VISION_MODEL_TYPES or (kind in FLAGGED_MEDIA_TYPES and getattr(text, MEDIA_FLAG, False))
    return media and vision_body(model) is not None


def vision_body(model: nn.Module) -> nn.Module | None:
    """The body of a vision-language model shardfit trains on images (its vision tower and `language_model` side
    by side: Qwen2-VL-style `visual`, Gemma 3's `vision_tower` and `multi_modal_projector`), whose forward fills
    image placeholders with vision features; None for a text model."""
    body = getattr(text_model(model), "model", None)
    if body is None or not hasattr(body, "language_model"):
        return None
    if hasattr(body, "visual") or soft_token_body(model) is body:
        return body
    return None


def soft_token_body(model: nn.Module) -> nn.Module | None:
    """The body of a Gemma 3-style model built to train on images (SOFT_TOKEN_MODEL_TYPES, marked with
    MEDIA_FLAG: `vision_tower`, `multi_modal_projector`, `language_model`), None for any other model."""
    text = text_model(model)
    body = getattr(text, "model", None)
    kind = getattr(getattr(text, "config", None), "model_type", None)
    parts = ("vision_tower", "multi_modal_projector", "language_model")
    if kind in SOFT_TOKEN_MODEL_TYPES and getattr(text, MEDIA_FLAG, False) and all(hasattr(body, n) for n in parts):
        return body
    return None


def vision_tower_of(body: nn.Module) -> nn.Module:
    """The vision tower of a vision body (`visual`, or Gemma 3's `vision_tower`)."""
    return body.visual if hasattr(body, "visual") else body.vision_tower


def projector_of(body: nn.Module) -> nn.Module | None:
    """The module that projects vision features into the language model's width: Qwen's `visual.merger`, Gemma 3's
    `multi_modal_projector` (beside the tower, not in it)."""
    projector = getattr(body, "multi_modal_projector", None)
    return projector if projector is not None else getattr(getattr(body, "visual", None), "merger", None)


def projector_name(model: nn.Module) -> str:
    """The projector's attribute name, as peft's modules_to_save names it under train_projector."""
    return "multi_modal_projector" if soft_token_body(model) is not None else "merger"


def vision_units(model: nn.Module) -> list[nn.Module]:
    """The vision tower's repeated blocks and its merger (projector), in order: each is one FSDP unit, so a frozen
    block and a trainable merger never share one."""
    body = vision_body(model)
    if body is None:
        return []
    tower = vision_tower_of(body)
    merger = projector_of(body)
    blocks = getattr(tower, "blocks", None)
    if blocks is None:  # SigLIP (Gemma 3): encoder.layers (under vision_model in older transformers)
        blocks = getattr(getattr(getattr(tower, "vision_model", tower), "encoder", None), "layers", [])
    units = list(blocks)
    if merger is not None and hasattr(merger, "modules_to_save"):
        # peft's train_projector wrapper: the frozen original and the trainable copy, each a unit of its own.
        units += [merger.original_module, *merger.modules_to_save.values()]
    elif merger is not None:
        units.append(merger)
    return units


def audio_units(model: nn.Module) -> list[nn.Module]:
    """The audio tower's repeated encoder layers (Qwen2.5-Omni, Qwen3-Omni), in order: each is one FSDP unit, like a
    vision block; the tower's convolutions and output projection stay with the root."""
    body = vision_body(model)
    tower = getattr(body, "audio_tower", None) if body is not None else None
    return list(getattr(tower, "layers", None) or [])
