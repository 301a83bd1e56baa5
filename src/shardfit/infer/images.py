"""Generation from an image with a vision-language model (Qwen2-VL, Qwen2.5-VL): the prompt through the chat
template with the image's tokens where `<image>` stands (or before the text), the pixels through the model's own
image processor, as training encoded them (data/vision.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from shardfit.config import Config
from shardfit.data.formats import BadRow
from shardfit.data.images import unreadable_image
from shardfit.data.media import IMAGE
from shardfit.data.vision import VisionProcessor, load_pixels
from shardfit.errors import UserError
from shardfit.infer.generate import Messages, Sampling, render
from shardfit.infer.load import Target
from shardfit.models.anatomy import input_device
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model


def vision_processor_for(target: Target, tokenizer: Any, trust_remote_code: bool = False) -> VisionProcessor:
    """The image processor and image tokens of what `target` generates with: a merged or full model folder's own
    files, else the base model's, with the run's pixel bounds (image_min/max_pixels) when it is a run.
    `trust_remote_code`: the command line's flag (a run's config never allows code, see load.resolve_target)."""
    cfg = target.run_cfg or Config(model=target.model)
    folder = target.model if (Path(target.model) / "preprocessor_config.json").is_file() else target.base_model
    cfg = dataclasses.replace(cfg, model=folder, trust_remote_code=trust_remote_code)
    vp = load_vision_processor(resolve_model(folder), cfg, tokenizer)
    if vp is None:
        raise UserError(f"--image: {target.label} is not a vision-language model shardfit reads images for "
                        "(Qwen2-VL, Qwen2.5-VL); leave --image out.")
    return vp


def check_image(path: str) -> str:
    """An image file that exists and decodes, as an absolute path; a UserError naming --image otherwise."""
    p = Path(path).expanduser()
    problem = unreadable_image(p)
    if problem == "not found":
        raise UserError(f"--image {path}: no such file.")
    if problem:
        raise UserError(f"--image {path}: {problem}.")
    return str(p.resolve())


def with_image_placeholders(messages: Messages, n_images: int) -> Messages:
    """The conversation with one `<image>` per image: where the last user turn already has them, as it is; else
    placed before that turn's text."""
    have = sum(m["content"].count(IMAGE) for m in messages)
    if have == n_images:
        return messages
    if have:
        raise UserError(f"the prompt has {have} {IMAGE} placeholder(s) but {n_images} --image; give one "
                        f"{IMAGE} per image, or none (the image then comes before the text).")
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = list(messages)
    out[last] = dict(out[last], content=IMAGE * n_images + out[last]["content"])
    return out


def image_inputs(tokenizer: Any, vp: VisionProcessor, messages: Messages, images: list[str]) -> dict[str, Any]:
    """Model inputs for a prompt with images: token ids (each image's tokens expanded to what its grid gives),
    attention mask, pixel patches, grids, and which tokens are image tokens (transformers' M-RoPE needs them)."""
    messages = with_image_placeholders(messages, len(images))
    marker = vp.start + vp.image_token + vp.end
    text = render(tokenizer, [dict(m, content=m["content"].replace(IMAGE, marker)) for m in messages])
    try:
        pixels, grids = load_pixels(vp, tuple(images))
    except BadRow as e:  # an image the processor refuses (its shape), or one changed since check_image read it
        raise UserError(f"--image: {e}.") from None
    pieces = text.split(vp.image_token)
    counts = [vp.tokens_per_image(g) for g in grids.tolist()]
    text = pieces[0] + "".join(vp.image_token * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    image = (enc["input_ids"] == vp.image_token_id).int()
    if vp.soft_grid is not None:  # Gemma 3: no grids; token_type_ids mark the image tokens for its image mask
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "pixel_values": pixels,
                "token_type_ids": image}
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "pixel_values": pixels,
            "image_grid_thw": grids, "mm_token_type_ids": image}


@torch.no_grad()
def generate_with_images(model: torch.nn.Module, tokenizer: Any, vp: VisionProcessor, messages: Messages,
                         images: list[str], sampling: Sampling) -> str:
    """The reply to `messages` about `images`."""
    inputs = image_inputs(tokenizer, vp, messages, images)
    device, dtype = input_device(model), next(model.parameters()).dtype
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    out = model.generate(**inputs, **sampling.kwargs(tokenizer))
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
