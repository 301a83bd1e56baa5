"""Image tokens before anything loads: how many patches the vision tower sees and how many tokens the language
model's sequence gains per image, for Qwen2-VL-style models (14-pixel patches, 2x2 merge, images resized to a
multiple of 28 pixels within [min_pixels, max_pixels] keeping the aspect ratio, as their image processor does).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardfit.errors import UserError

# The keys under which a transformers config holds a tower beside its language model (Qwen-Omni's thinker holds
# both of its towers).
TOWER_KEYS = ("vision_config", "audio_config", "thinker_config")

# The published Qwen2-VL / Qwen2.5-VL preprocessor_config.json bounds.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 14 * 14 * 4 * 16384


@dataclass(frozen=True)
class MediaLoad:
    """Images per training sample and their size, with the resize bounds and the vision tower's geometry."""

    images_per_sample: int
    width: int
    height: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch: int = 14
    merge: int = 2
    # Gemma 3: every image resized to a `square` x `square` image and pooled to `soft_tokens` tokens (0: Qwen-style)
    soft_tokens: int = 0
    square: int = 0

    def resized(self) -> tuple[int, int]:
        """(height, width) after the processor's resize: multiples of patch x merge, pixels within the bounds
        (Gemma 3: the tower's square)."""
        if self.soft_tokens:
            return self.square, self.square
        f = self.patch * self.merge
        h = max(f, round(self.height / f) * f)
        w = max(f, round(self.width / f) * f)
        if h * w > self.max_pixels:
            beta = math.sqrt(self.height * self.width / self.max_pixels)
            h = max(f, math.floor(self.height / beta / f) * f)
            w = max(f, math.floor(self.width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (self.height * self.width))
            h = math.ceil(self.height * beta / f) * f
            w = math.ceil(self.width * beta / f) * f
        return h, w

    def patches_per_image(self) -> int:
        """Patches the vision tower's blocks process for one image (an image is one temporal patch)."""
        h, w = self.resized()
        return (h // self.patch) * (w // self.patch)

    def tokens_per_image(self) -> int:
        """Tokens one image adds to the language model's sequence (merge x merge patches make one; Gemma 3: its
        mm_tokens_per_image soft tokens, whatever the image's size)."""
        if self.soft_tokens:
            return self.soft_tokens
        return self.patches_per_image() // (self.merge * self.merge)

    def grid(self) -> tuple[int, int]:
        """(rows, columns) of patches of one image after the resize."""
        h, w = self.resized()
        return h // self.patch, w // self.patch

    def tokens_per_sample(self) -> int:
        return self.images_per_sample * self.tokens_per_image()

    def to_json(self) -> dict:
        h, w = self.resized()
        return {"images_per_sample": self.images_per_sample, "image_size": [self.width, self.height],
                "resized_to": [w, h], "patches_per_image": self.patches_per_image(),
                "tokens_per_image": self.tokens_per_image(), "media_tokens_per_sample": self.tokens_per_sample()}


@dataclass(frozen=True)
class SoftTokenTower:
    """Gemma 3's image side as its config.json gives it: `tokens` soft tokens per image (mm_tokens_per_image), the
    tower's `side` x `side` input in `patch`-pixel patches."""

    tokens: int
    side: int
    patch: int

    def load(self, media: MediaLoad) -> MediaLoad:
        """`media` (images per sample and their size) as this tower takes them."""
        return dataclasses.replace(media, patch=self.patch, merge=1, soft_tokens=self.tokens, square=self.side)


def has_tower(config: Any) -> bool:
    """Whether `config` (a built transformers config, or a config.json's keys as attributes) holds a vision or
    audio tower beside its language model, of whatever kind: the one reading by which the planner and the rank
    (resolve/sequence.py `facts_of_config`) tell a multimodal model. A tower key set to null builds no tower
    (Gemma 4's text-only configs)."""
    return any(getattr(config, key, None) is not None for key in TOWER_KEYS)


def soft_token_tower_of(config: dict) -> SoftTokenTower | None:
    """The soft-token image side of a config.json (Gemma 3: mm_tokens_per_image and a SigLIP vision_config), None
    for any other model."""
    v = config.get("vision_config")
    tokens = config.get("mm_tokens_per_image")
    if config.get("model_type") != "gemma3" or not isinstance(v, dict):
        return None
    # transformers' Gemma3Config defaults: 256 soft tokens, SigLIP's 224 pixels in 16-pixel patches (the published
    # configs name 896 and 14).
    return SoftTokenTower(int(tokens or 256), int(v.get("image_size") or 224), int(v.get("patch_size") or 16))


def parse_image_size(text: str) -> tuple[int, int]:
    """`1024x768` -> (1024, 768); anything else is a UserError naming the flag."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--image-size {text}: give WIDTHxHEIGHT in pixels, e.g. --image-size 1024x768.")
    return int(parts[0]), int(parts[1])


def check_fits(media: MediaLoad, seq_len: int, flag: str = "--seq") -> None:
    """The image tokens of a sample must fit in the sequence (they are never truncated): a UserError otherwise."""
    n = media.tokens_per_sample()
    if n >= seq_len:
        # Gemma 3's soft tokens per image are fixed: only the sequence or the number of images can change.
        lower = "use fewer images per sample" if media.soft_tokens else \
            "lower --image-max-pixels (image_max_pixels in a config)"
        raise UserError(f"{media.images_per_sample} image(s) of {media.width}x{media.height} take {n} tokens "
                        f"({media.tokens_per_image()} each), not less than {flag} {seq_len}: raise {flag}, or "
                        f"{lower}.")


def describe(media: MediaLoad) -> str:
    """One line for the plan's table."""
    h, w = media.resized()
    return (f"images: {media.images_per_sample} per sample of {media.width}x{media.height} (resized to {w}x{h}): "
            f"{media.patches_per_image()} patches through the vision tower and {media.tokens_per_image()} tokens in "
            f"the sequence each, {media.tokens_per_sample()} image tokens per sample (counted within the sequence "
            "length)")


@dataclass(frozen=True)
class VisionShape:
    """A Qwen2-VL-style vision tower: `depth` blocks of width `dim` (MLP width `mlp`; `gated`: Qwen2.5-VL's SiLU
    gate/up/down MLP and RMSNorm, else Qwen2-VL's QuickGELU MLP and LayerNorm), `patch`-pixel patches over
    `temporal_patch` frames, `merge` x `merge` patches merged into one language-model token of width `out`."""

    depth: int
    dim: int
    mlp: int
    heads: int
    out: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    gated: bool = False
    in_channels: int = 3
    kind: str = ""  # the model's type (config.json's model_type, e.g. qwen2_vl; "": not known)

    def patch_values(self) -> int:
        """Pixel values of one patch as the image processor hands them over (channels x frames x patch x patch)."""
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    def params(self) -> int:
        """The tower's weights: patch embedding, blocks (norms, qkv, projection, MLP), merger."""
        d, m = self.dim, self.mlp
        norm = d if self.gated else 2 * d
        mlp = 3 * d * m + 2 * m + d if self.gated else 2 * d * m + m + d
        block = 2 * norm + 3 * d * d + 3 * d + d * d + d + mlp
        merged = d * self.merge * self.merge
        merger = norm + merged * merged + merged + merged * self.out + self.out
        return self.patch_values() * d + self.depth * block + merger

    def saved_per_patch(self) -> float:
        """Values a trainable tower saves for backward per patch: per block (its norms' and linear layers' inputs,
        rotated q and k, v, the attention output and its log-sum-exp, the MLP's inner activations) and the
        merger's. Counted from the blocks of transformers' Qwen2-VL / Qwen2.5-VL with autograd's saved-tensor hooks
        over a range of widths (linear in `dim` and `mlp`, the same for every image size)."""
        d, m = self.dim, self.mlp
        block = 13 * d + 4 * m + 6 if self.gated else 11 * d + 3 * m + 8
        return self.depth * block + (5.5 if self.gated else 4.5) * d


def vision_activation_bytes(v: VisionShape, patches: int, trainable: bool, low: int, cast_copy: bool,
                            checkpointed: bool = False) -> float:
    """What the images of one micro-batch hold through the step: their pixel patches (fp32, as the processor makes
    them), a 16-bit copy of them when one is made and kept (`cast_copy`: FSDP's mixed precision casts the root's
    inputs for the whole forward; autocast's copy is saved when the patch embedding trains) and, for a trainable
    tower, every block's saved activations in the compute precision (`low` bytes); `checkpointed` (transformers
    checkpoints the vision blocks with the decoder's): each block's input only. A frozen tower saves nothing: it
    runs block by block at the start of the forward pass, long before the step's peak."""
    pixels = patches * v.patch_values() * (4.0 + (low if cast_copy and low != 4 else 0))
    if not trainable:
        return pixels
    saved = v.depth * v.dim + (5.5 if v.gated else 4.5) * v.dim if checkpointed else v.saved_per_patch()
    return pixels + patches * saved * low


def vision_shape_of(config: dict) -> VisionShape | None:
    """The vision tower of a config.json (Qwen2-VL `embed_dim`/`mlp_ratio`, Qwen2.5-VL and Qwen2.5-Omni
    `hidden_size`/`intermediate_size`), None when it has none."""
    v = config.get("vision_config") or (config.get("thinker_config") or {}).get("vision_config")
    if not isinstance(v, dict) or "depth" not in v:
        return None
    gated = "intermediate_size" in v and "embed_dim" not in v
    dim = v.get("embed_dim") or v.get("hidden_size")
    mlp = v["intermediate_size"] if gated else int(dim * v.get("mlp_ratio", 4))
    out = v.get("out_hidden_size") or v.get("hidden_size") if gated else v.get("hidden_size") or dim
    return VisionShape(depth=v["depth"], dim=dim, mlp=mlp, heads=v.get("num_heads", 16), out=out,
                       patch=v.get("patch_size", 14), temporal_patch=v.get("temporal_patch_size", 2),
                       merge=v.get("spatial_merge_size", 2), gated=gated,
                       in_channels=v.get("in_channels") or v.get("in_chans") or 3,
                       kind=str(config.get("model_type", "")))
