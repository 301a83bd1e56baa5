"""Image tokens before anything loads: how many patches the vision tower sees and how many tokens the language
model's sequence gains per image, for Qwen2-VL-style models (14-pixel patches, 2x2 merge, images resized to a
multiple of 28 pixels within [min_pixels, max_pixels] keeping the aspect ratio, as their image processor does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardfit.errors import UserError

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

    def resized(self) -> tuple[int, int]:
        """(height, width) after the processor's resize: multiples of patch x merge, pixels within the bounds."""
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
        """Tokens one image adds to the language model's sequence (merge x merge patches make one)."""
        return self.patches_per_image() // (self.merge * self.merge)

    def tokens_per_sample(self) -> int:
        return self.images_per_sample * self.tokens_per_image()

    def to_json(self) -> dict:
        h, w = self.resized()
        return {"images_per_sample": self.images_per_sample, "image_size": [self.width, self.height],
                "resized_to": [w, h], "patches_per_image": self.patches_per_image(),
                "tokens_per_image": self.tokens_per_image(), "media_tokens_per_sample": self.tokens_per_sample()}


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
        raise UserError(f"{media.images_per_sample} image(s) of {media.width}x{media.height} take {n} tokens "
                        f"({media.tokens_per_image()} each), not less than {flag} {seq_len}: raise {flag}, or lower "
                        "--image-max-pixels (image_max_pixels in a config).")


def describe(media: MediaLoad) -> str:
    """One line for the plan's table."""
    h, w = media.resized()
    return (f"images: {media.images_per_sample} per sample of {media.width}x{media.height} (resized to {w}x{h}): "
            f"{media.patches_per_image()} patches through the vision tower and {media.tokens_per_image()} tokens in "
            f"the sequence each, {media.tokens_per_sample()} image tokens per sample (counted within the sequence "
            "length)")
