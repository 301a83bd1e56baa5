"""Videos in data rows, given as their frames: a list of image files or a folder of them (sorted by name), taken to
be `video_fps` frames per second and sampled down to `video_max_frames`. Video files are not decoded (that needs
FFmpeg); a row naming one stops with the command that extracts its frames.

A Qwen2-VL-style vision tower sees a video as temporal patches: each pair of consecutive frames (the tower's
temporal patch size) is one patch deep, so a video's grid is (frames / 2, rows, columns) and its tokens are
grid / (merge x merge). Each frame goes through the model's image processor (same resize, rescale and normalisation
as an image, so no video processor and no torchvision is needed); its patches are then interleaved by pairs, in the
layout the tower's patch embedding reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardfit.data.formats import BadRow

VIDEO = "<video>"
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpg", ".mpeg", ".wmv")


def video_frames(value: Any, base: Path, where: str) -> list[str]:
    """The frame files of one video of a row (not yet checked to decode): a list of image paths, or a folder whose
    image files are the frames in name order. Paths are relative to `base` (the data file's folder)."""
    if isinstance(value, list):
        if not value or not all(isinstance(p, str) for p in value):
            raise BadRow(f"{where}: a video given as frames is a non-empty list of image paths")
        return [_resolved(p, base) for p in value]
    if not isinstance(value, str) or not value:
        raise BadRow(f"{where}: a video is a list of frame images or a folder of them")
    p = Path(_resolved(value, base))
    if p.suffix.lower() in VIDEO_SUFFIXES:
        raise BadRow(f"{where}: {p.name}: video files are not decoded; give its frames instead (a folder of images, "
                     f"e.g. ffmpeg -i {p.name} -vf fps=2 {p.stem}_frames/%05d.png, then name the folder)")
    if not p.is_dir():
        raise BadRow(f"{where}: video frames folder not found: {p} (paths are relative to the data file's folder)")
    frames = sorted(str(f) for f in p.iterdir() if f.suffix.lower() in FRAME_SUFFIXES)
    if not frames:
        raise BadRow(f"{where}: {p} holds no frame images ({', '.join(FRAME_SUFFIXES[:4])} ...)")
    return frames


def _resolved(path: str, base: Path) -> str:
    p = Path(path.removeprefix("file://")).expanduser()
    return str(p if p.is_absolute() else base / p)


@dataclass(frozen=True)
class VideoSettings:
    """What encoding a video needs beyond the image processor: the video placeholder token, the frame caps, and how
    the model spaces a video's temporal positions."""

    token: str  # Qwen: <|video_pad|>
    token_id: int
    max_frames: int
    fps: float  # frames per second of the given frames
    # Qwen2.5-VL: temporal positions advance tokens_per_second x seconds per temporal patch; Qwen2-VL (None): one per
    # temporal patch.
    tokens_per_second: float | None = None

    def sampled(self, frames: tuple[str, ...]) -> tuple[tuple[str, ...], float]:
        """At most `max_frames` frames, evenly spread over the video, and their frame rate (lower when frames were
        dropped)."""
        n = len(frames)
        if n <= self.max_frames:
            return frames, self.fps
        keep = [round(i * (n - 1) / (self.max_frames - 1)) for i in range(self.max_frames)] \
            if self.max_frames > 1 else [0]
        return tuple(frames[i] for i in keep), self.fps * len(keep) / n

    def time_interval(self, temporal_patch: int, fps: float) -> float:
        """The temporal position step from one temporal patch to the next."""
        if self.tokens_per_second is None:
            return 1.0
        return self.tokens_per_second * temporal_patch / fps


def load_video(image_processor: Any, frames: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel patches of one video (rows: patches in (time, row, column) order) and its (t, h, w) grid. The last
    frame is repeated to fill the last temporal patch, as the models' own video processors do."""
    from PIL import Image  # Pillow only for image data: text-only runs never import it

    temporal = int(image_processor.temporal_patch_size)
    images = []
    for p in frames:
        with Image.open(p) as im:
            images.append(im.convert("RGB"))
    if {im.size for im in images} != {images[0].size}:
        raise BadRow(f"the frames of a video differ in size ({', '.join(sorted({str(im.size) for im in images}))}); "
                     "extract them at one size")
    images += [images[-1]] * (-len(images) % temporal)
    out = image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]  # every frame (1, h, w): one size, one grid
    _, h, w = grid[0].tolist()
    per_frame = out["pixel_values"].reshape(len(images), h * w, 3, temporal, -1)
    # A frame's patch repeats the frame along the temporal axis; a video's patch holds consecutive frames there.
    steps = len(images) // temporal
    video = torch.stack([per_frame[g * temporal + k, :, :, 0] for g in range(steps) for k in range(temporal)])
    video = video.reshape(steps, temporal, h * w, 3, -1).permute(0, 2, 3, 1, 4).reshape(steps * h * w, -1)
    return video, torch.tensor([[steps, h, w]])


@dataclass(frozen=True)
class VideoPixels:
    """The videos of one example, decoded when a batch needs them (held as frame paths)."""

    image_processor: Any
    videos: tuple[tuple[str, ...], ...]

    def load(self) -> torch.Tensor:
        """Pixel patches of every video, in order."""
        return torch.cat([load_video(self.image_processor, v)[0] for v in self.videos])
