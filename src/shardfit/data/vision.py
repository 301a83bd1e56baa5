"""Tokenise a conversation with images (and audio, for Qwen2.5-Omni's thinker) for a Qwen2-VL-style model: the
chat template and assistant-only labels as for text, each image's pixels through the model's image processor, each
image placeholder expanded to the number of tokens the vision tower's merger emits for it, each audio placeholder
to the number the audio tower emits for its clip (never trained), and the 3-D M-RoPE positions the model expects.

Positions are computed per example, as the model's own `get_rope_index` does for one sequence: text advances one
position per token on all three axes; an image's tokens take (start, start + row, start + column) and the next text
starts at start + max(rows, columns). Audio tokens advance like text (Qwen2.5-Omni's `get_rope_index` gives a
clip consecutive positions on all three axes). Carrying them per example is what lets packing keep each example's own
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardfit.data.audio import AudioClips, AudioInput, AudioProcessor
from shardfit.data.formats import BadRow
from shardfit.data.images import decoded, fit_of
from shardfit.data.media import AUDIO, IMAGE
from shardfit.data.tokenize import IGNORE, Encoded, encode_messages
from shardfit.data.video import VIDEO, VideoClip, VideoPixels, VideoSettings, load_video

Span = tuple[int, list[int], float]  # an image's or video's M-RoPE span: (first token, (t, h, w) grid, temporal step)
Expansion = tuple[list[int], list[Span]]  # the tokens a medium's placeholder becomes, and its spans among them


@dataclass(frozen=True)
class VisionProcessor:
    """What encoding needs from a vision-language model: its image processor and the tokens an image takes."""

    image_processor: Any
    image_token: str  # the placeholder the language model reads image features into (Qwen: <|image_pad|>)
    image_token_id: int
    start: str  # the markers the chat template puts around an image (Qwen: <|vision_start|>, <|vision_end|>)
    end: str
    merge: int  # spatial merge of the vision tower: merge x merge patches make one language-model token
    audio: AudioProcessor | None = None  # a model with an audio tower too (Qwen2.5-Omni's thinker)
    video: VideoSettings | None = None  # a model that trains on videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
    # Gemma 3: every image is a fixed grid of soft tokens (1, side, side), read with 1-D positions and attended to
    # both ways within the image; None for Qwen2-VL-style models, whose grid is the processor's patch grid.
    soft_grid: tuple[int, int, int] | None = None

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
    """Pixel patches of every image (rows: patches, in image order) and each image's (t, h, w) patch grid. Each
    image is decoded within bounds (data/images.py) and goes through the processor on its own (as the processor
    itself loops), so an image it refuses (an extreme shape) is a BadRow naming the file. Gemma 3's processor gives
    each image as one (3, side, side) square and no grid: its grid is the soft-token grid (`soft_grid`)."""
    fit = fit_of(vp.image_processor)
    pixels, grids = [], []
    for p in paths:
        image = decoded(p, fit)
        try:
            out = vp.image_processor(images=[image], return_tensors="pt")
        except ValueError as e:
            raise BadRow(f"image {p} ({image.size[0]}x{image.size[1]} pixels): the model's image processor refuses "
                         f"it ({e}); crop or pad it to a less extreme shape, or remove it") from None
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"] if vp.soft_grid is None else torch.tensor([vp.soft_grid]))
    return torch.cat(pixels), torch.cat(grids)


def encode_with_images(tokenizer: Any, vp: VisionProcessor, messages: list[dict[str, str]],
                       images: tuple[str, ...], max_len: int, audios: tuple[AudioInput, ...] = (),
                       videos: tuple[VideoClip, ...] = (), label_from: int = 0) -> Encoded:
    """One example with its pixels, image and video grids, audio clips and M-RoPE positions; a row whose media
    tokens do not fit in `max_len` is a `BadRow` (truncating inside a medium would leave features with no tokens
    to fill)."""
    ap, vs = vp.audio, vp.video
    if (audios and ap is None) or (videos and vs is None):
        raise BadRow(f"the row has {'audio' if audios else 'videos'} but the model does not read them")
    markers = {IMAGE: vp.image_token, AUDIO: ap.audio_token if ap else None, VIDEO: vs.token if vs else None}
    rendered = []
    for m in messages:
        content = m["content"]
        for tag, token in markers.items():
            if token is not None:
                start, end = (ap.start, ap.end) if tag == AUDIO and ap is not None else (vp.start, vp.end)
                content = content.replace(tag, start + token + end)
        rendered.append(dict(m, content=content))
    enc = encode_messages(tokenizer, rendered, max_len=1 << 30, label_from=label_from)
    grids = load_pixels(vp, images)[1] if images else None  # decoded once here for the grids; pixels come later
    # Each video: its frames (sampled to video_max_frames) and its grid.
    clips = [vs.sampled(v) for v in videos] if vs is not None else []
    vgrids = torch.cat([load_video(vp.image_processor, c.images())[1] for c in clips]) if clips else None
    # token -> (what, the tokens and M-RoPE spans each of its media becomes, token string)
    kinds: dict[int, tuple[str, list[Expansion], str]] = {
        vp.image_token_id: ("image", [([vp.image_token_id] * vp.tokens_per_image(g), [(0, g, 1.0)])
                                      for g in (grids.tolist() if grids is not None else [])], vp.image_token)}
    if ap is not None:
        kinds[ap.audio_token_id] = ("audio clip", [([ap.audio_token_id] * ap.tokens(ap.n_samples(a)), [])
                                                   for a in audios], ap.audio_token)
    if vs is not None:
        temporal = int(vp.image_processor.temporal_patch_size)
        kinds[vs.token_id] = ("video", [vs.tokens(tokenizer, c, g, vp.tokens_per_image([1, *g[1:]]), temporal)
                                        for c, g in zip(clips, vgrids.tolist() if clips else [], strict=True)],
                              vs.token)
    for tok, (what, media, own) in kinds.items():
        n_slots = sum(1 for t in enc.input_ids if t == tok)
        if n_slots != len(media):
            raise BadRow(f"{len(media)} {what}(s) but the chat template produced {n_slots} {what} slot(s); the "
                         f"text itself must not contain {own}")
    ids, targets, spans, last_end = _expanded(enc, {tok: media for tok, (_, media, _) in kinds.items()})
    truncated = len(ids) > max_len
    if truncated:
        if last_end > max_len:
            n_media = sum(len(seq) for _, media, _ in kinds.values() for seq, _ in media)
            present = [k for k, on in (("image", images), ("audio", audios), ("video", videos)) if on]
            keys = {"image": "image_max_pixels", "audio": "audio_max_seconds", "video": "video_max_frames"}
            raise BadRow(f"its {n_media} {' and '.join(present)} tokens and text take {len(ids)} tokens, beyond "
                         f"max_seq_len={max_len}; raise max_seq_len, or lower "
                         f"{' / '.join(keys[k] for k in present)} (fewer tokens per {' or '.join(present)})")
        ids, targets = ids[:max_len], targets[:max_len - 1] + [IGNORE]
    mrope = mrope_positions(len(ids), spans, vp.merge) if vp.soft_grid is None else None  # Gemma 3: 1-D positions
    return Encoded(ids, targets, truncated, mrope=mrope, pixel_values=ImagePixels(vp, images) if images else None,
                   image_grid_thw=grids, audio=AudioClips(ap, audios) if audios and ap is not None else None,
                   video=VideoPixels(vp.image_processor, tuple(clips)) if clips else None,
                   video_grid_thw=vgrids)


def _expanded(enc: Encoded, media: dict[int, list[Expansion]]) -> tuple[list[int], list[int], list[Span], int]:
    """`enc`'s tokens with each media placeholder replaced by its medium's tokens (in order, per kind), the targets
    (media tokens are inputs only: the last keeps the placeholder's label), the M-RoPE spans at their places, and
    where the last medium's tokens end."""
    ids: list[int] = []
    targets: list[int] = []
    spans: list[Span] = []
    last_end = 0
    seen = dict.fromkeys(media, 0)
    for tok, tgt in zip(enc.input_ids, enc.targets, strict=True):
        if tok in media:
            seq, at = media[tok][seen[tok]]
            seen[tok] += 1
            spans += [(len(ids) + offset, grid, step) for offset, grid, step in at]
            ids += seq
            targets += [IGNORE] * (len(seq) - 1) + [tgt]
            last_end = len(ids)
        else:
            ids.append(tok)
            targets.append(tgt)
    return ids, targets, spans, last_end


def mrope_positions(n: int, spans: list[tuple[int, list[int], float]], merge: int) -> list[list[int]]:
    """The (temporal, height, width) position of each of `n` tokens, images and videos at the given spans (first
    token, (t, h, w) grid, temporal step): a medium's tokens take (start + int(t x step), start + row, start +
    column) and the text after it starts at start + max(rows, columns), as the models' own get_rope_index."""
    axes: list[list[int]] = [[], [], []]
    pos, i = 0, 0
    for first, (t, h, w), step in spans + [(n, [0, 0, 0], 1.0)]:
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
                    axes[0].append(pos + int(ti * step))
                    axes[1].append(pos + hi)
                    axes[2].append(pos + wi)
        i = first + t * gh * gw
        pos += max(gh, gw)
    return axes
