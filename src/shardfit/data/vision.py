"""Tokenise a conversation with images for a Qwen2-VL-style model: the chat template and assistant-only labels as
for text, each image's pixels through the model's image processor, each image placeholder expanded to the number
of tokens the vision tower's merger emits for it (never trained), and the 3-D M-RoPE positions the model expects.

Positions are computed per example, as the model's own `get_rope_index` does for one sequence: text advances one
position per token on all three axes; an image's tokens take (start, start + row, start + column) and the next text
starts at start + max(rows, columns). Carrying them per example is what lets packing keep each example's own
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardfit.data.formats import BadRow
from shardfit.data.media import IMAGE
from shardfit.data.tokenize import IGNORE, Encoded, encode_messages


@dataclass(frozen=True)
class VisionProcessor:
    """What encoding needs from a vision-language model: its image processor and the tokens an image takes."""

    image_processor: Any
    image_token: str  # the placeholder the language model reads image features into (Qwen: <|image_pad|>)
    image_token_id: int
    start: str  # the markers the chat template puts around an image (Qwen: <|vision_start|>, <|vision_end|>)
    end: str
    merge: int  # spatial merge of the vision tower: merge x merge patches make one language-model token

    def tokens_per_image(self, grid_thw: list[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge * self.merge)


@dataclass(frozen=True)
class ImagePixels:
    """The images of one example, decoded when a batch needs them: held as paths, a data set of any size costs no
    memory for pixels (a 1024x768 image is 19 MB of fp32 patches)."""

    vp: VisionProcessor
    paths: tuple[str, ...]

    def load(self) -> torch.Tensor:
        """Pixel patches of every image, in order (rows: patches)."""
        return load_pixels(self.vp, self.paths)[0]


def load_pixels(vp: VisionProcessor, paths: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel patches of every image (rows: patches, in image order) and each image's (t, h, w) patch grid."""
    from PIL import Image  # Pillow only for image data: text-only runs never import it

    images = []
    for p in paths:
        with Image.open(p) as im:
            images.append(im.convert("RGB"))
    out = vp.image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def encode_with_images(tokenizer: Any, vp: VisionProcessor, messages: list[dict[str, str]],
                       images: tuple[str, ...], max_len: int) -> Encoded:
    """One example with its pixels, image grids and M-RoPE positions; a row whose image tokens do not fit in
    `max_len` is a `BadRow` (truncating inside an image would leave features with no tokens to fill)."""
    marker = vp.start + vp.image_token + vp.end
    rendered = [dict(m, content=m["content"].replace(IMAGE, marker)) for m in messages]
    enc = encode_messages(tokenizer, rendered, max_len=1 << 30)
    grids = load_pixels(vp, images)[1] if images else None  # decoded once here for the grids; pixels come later
    counts = [vp.tokens_per_image(g) for g in grids.tolist()] if grids is not None else []
    n_slots = sum(1 for t in enc.input_ids if t == vp.image_token_id)
    if n_slots != len(counts):
        raise BadRow(f"{len(counts)} image(s) but the chat template produced {n_slots} image slot(s); the text "
                     f"itself must not contain {vp.image_token}")
    ids: list[int] = []
    targets: list[int] = []
    image_spans: list[tuple[int, list[int]]] = []  # (first token, grid) of each image, in order
    k = 0
    for tok, tgt in zip(enc.input_ids, enc.targets, strict=True):
        if tok == vp.image_token_id:
            n = counts[k]
            image_spans.append((len(ids), grids[k].tolist()))
            ids += [tok] * n
            targets += [IGNORE] * (n - 1) + [tgt]  # image tokens are inputs only; the last keeps the next label
            k += 1
        else:
            ids.append(tok)
            targets.append(tgt)
    truncated = len(ids) > max_len
    if truncated:
        if image_spans and image_spans[-1][0] + counts[-1] > max_len:
            raise BadRow(f"its {sum(counts)} image tokens and text take {len(ids)} tokens, beyond max_seq_len="
                         f"{max_len}; raise max_seq_len, or lower image_max_pixels (fewer tokens per image)")
        ids, targets = ids[:max_len], targets[:max_len - 1] + [IGNORE]
    mrope = mrope_positions(len(ids), image_spans, vp.merge)
    return Encoded(ids, targets, truncated, mrope=mrope, pixel_values=ImagePixels(vp, images) if images else None,
                   image_grid_thw=grids)


def mrope_positions(n: int, image_spans: list[tuple[int, list[int]]], merge: int) -> list[list[int]]:
    """The (temporal, height, width) position of each of `n` tokens, images at the given spans."""
    axes: list[list[int]] = [[], [], []]
    pos, i = 0, 0
    for first, (t, h, w) in image_spans + [(n, [0, 0, 0])]:
        first = min(first, n)
        for a in axes:
            a += range(pos, pos + first - i)
        pos += first - i
        if first >= n:
            break
        gh, gw = h // merge, w // merge
        for ti in range(t):
            for hi in range(gh):
                for wi in range(gw):
                    axes[0].append(pos + ti)
                    axes[1].append(pos + hi)
                    axes[2].append(pos + wi)
        i = first + t * gh * gw
        pos += max(gh, gw)
    return axes
