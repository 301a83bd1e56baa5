"""Videos in data rows: a video file (decoded with PyAV, the `video` extra) or its frames (a list of image files or a
folder of them, sorted by name). A file is sampled at `video_fps` frames per second; given frames are taken to be at
`video_fps` already. Either way at most `video_max_frames` frames are kept, evenly spread over the video.

A Qwen2-VL-style vision tower sees a video as temporal patches: each pair of consecutive frames (the tower's
temporal patch size) is one patch deep, so a video's grid is (frames / 2, rows, columns) and its tokens are
grid / (merge x merge). Each frame goes through the model's image processor (same resize, rescale and normalisation
as an image, so no video processor and no torchvision is needed); its patches are then interleaved by pairs, in the
layout the tower's patch embedding reads.

Qwen3-VL writes a video as one block per temporal patch: its time as text ("<1.5 seconds>", the mean of the
patch's first and last frame in the source video), then vision_start, the patch's tokens, vision_end
(`VideoSettings.tokens`); its M-RoPE positions treat each block as a one-patch-deep image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardfit.data.formats import BadRow
from shardfit.data.images import decoded

VIDEO = "<video>"
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpg", ".mpeg", ".wmv")


@dataclass(frozen=True)
class VideoClip:
    """One video of a row: its frame image files in time order, or a video `file` with the frame count and length
    its container's header gives."""

    frames: tuple[str, ...] = ()
    file: str | None = None
    file_frames: int = 0
    seconds: float = 0.0
    rate: float = 0.0  # a file's frame rate as its header gives it (Qwen3-VL's timestamps count in its frames)

    def __len__(self) -> int:
        return self.file_frames if self.file else len(self.frames)


def video_clip(value: Any, base: Path, where: str) -> VideoClip:
    """One video of a row (its frame images not yet checked to decode): a list of image paths, a folder whose image
    files are the frames in name order, or a video file (its header read here). Paths are relative to `base` (the
    data file's folder)."""
    if isinstance(value, list):
        if not value or not all(isinstance(p, str) for p in value):
            raise BadRow(f"{where}: a video given as frames is a non-empty list of image paths")
        return VideoClip(frames=tuple(_resolved(p, base) for p in value))
    if not isinstance(value, str) or not value:
        raise BadRow(f"{where}: a video is a video file, a folder of frame images or a list of them")
    p = Path(_resolved(value, base))
    if p.suffix.lower() in VIDEO_SUFFIXES:
        return _probed(p, where)
    if not p.is_dir():
        raise BadRow(f"{where}: video frames folder not found: {p} (paths are relative to the data file's folder)")
    frames = sorted(str(f) for f in p.iterdir() if f.suffix.lower() in FRAME_SUFFIXES)
    if not frames:
        raise BadRow(f"{where}: {p} holds no frame images ({', '.join(FRAME_SUFFIXES[:4])} ...)")
    return VideoClip(frames=tuple(frames))


def _av(where: str, p: Path) -> Any:
    try:
        import av  # PyAV (FFmpeg's decoders in a wheel) only for rows with video files: the `video` extra
    except ImportError:
        raise BadRow(f"{where}: {p.name}: decoding video files needs PyAV: pip install 'shardfit[video]' (or give "
                     f"the frames: ffmpeg -i {p.name} -vf fps=2 {p.stem}_frames/%05d.png, then name the folder)"
                     ) from None
    return av


def _probed(p: Path, where: str) -> VideoClip:
    """A video file's frame count and length from its container's header (nothing decoded)."""
    if not p.is_file():
        raise BadRow(f"{where}: video file not found: {p} (paths are relative to the data file's folder)")
    av = _av(where, p)
    try:
        with av.open(str(p)) as container:
            if not container.streams.video:
                raise BadRow(f"{where}: {p} has no video stream")
            stream = container.streams.video[0]
            if stream.duration is not None:
                seconds = float(stream.duration * stream.time_base)
            else:
                seconds = (container.duration or 0) / 1_000_000  # the container's duration is in microseconds
            rate = float(stream.average_rate or 0)
            frames = stream.frames or round(seconds * rate)
            rate = rate or (frames / seconds if seconds > 0 else 0.0)
    except (av.FFmpegError, OSError) as e:
        raise BadRow(f"{where}: {p} does not decode as a video ({e}); re-encode it, e.g. ffmpeg -i {p.name} "
                     f"-c:v libx264 {p.stem}_fixed.mp4") from None
    if frames <= 0 or seconds <= 0:
        raise BadRow(f"{where}: {p} gives no frame count or length in its header; re-encode it, e.g. ffmpeg -i "
                     f"{p.name} -c:v libx264 {p.stem}_fixed.mp4")
    return VideoClip(file=str(p.resolve()), file_frames=frames, seconds=seconds, rate=rate)


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
    # Qwen3-VL: the (vision_start, vision_end) token ids around each temporal patch's block, a timestamp before it;
    # None: the video's tokens in one run (Qwen2-VL, Qwen2.5-VL).
    frame_markers: tuple[int, int] | None = None

    def sampled(self, clip: VideoClip) -> SampledVideo:
        """The frames the model sees, evenly spread over the video, and their rate: given frames are at `fps` and
        thinned to `max_frames`; a file is sampled at `fps` frames per second (at most its own frames and
        `max_frames`)."""
        n = len(clip)
        if clip.file:
            want = min(self.max_frames, n, max(1, math.floor(clip.seconds * self.fps)))
        else:
            want = min(self.max_frames, n)
        if want == n:
            picks = tuple(range(n))
        else:
            picks = tuple(round(i * (n - 1) / (want - 1)) for i in range(want)) if want > 1 else (0,)
        fps = want / clip.seconds if clip.file else self.fps * want / n
        return SampledVideo(clip, picks, fps, clip.rate if clip.file else self.fps)

    def time_interval(self, temporal_patch: int, fps: float) -> float:
        """The temporal position step from one temporal patch to the next."""
        if self.tokens_per_second is None:
            return 1.0
        return self.tokens_per_second * temporal_patch / fps

    def tokens(self, tokenizer: Any, video: SampledVideo, grid: list[int], per_patch: int,
               temporal_patch: int) -> tuple[list[int], list[tuple[int, list[int], float]]]:
        """The tokens a video's placeholder becomes (`per_patch` tokens per temporal patch of its (t, h, w) `grid`)
        and its M-RoPE spans among them: (offset, grid, temporal step). Qwen2-VL-style: one run of t x per_patch
        tokens, one span. Qwen3-VL (`frame_markers`): per temporal patch "<S seconds>" (S to one decimal, as its
        processor writes it), vision_start, the patch's tokens and vision_end, each patch a span of grid
        (1, h, w), as its get_rope_index splits the video's grid."""
        t, h, w = grid
        if self.frame_markers is None:
            return [self.token_id] * (t * per_patch), [(0, list(grid), self.time_interval(temporal_patch, video.fps))]
        start, end = self.frame_markers
        ids: list[int] = []
        spans: list[tuple[int, list[int], float]] = []
        for seconds in video.patch_seconds(temporal_patch):
            # The text between two special tokens is tokenised on its own, so alone it gives the same tokens.
            ids += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False) + [start]
            spans.append((len(ids), [1, h, w], 1.0))
            ids += [self.token_id] * per_patch + [end]
        return ids, spans


@dataclass(frozen=True)
class SampledVideo:
    """A video's kept frames (`picks`: their indices among its frames) and the rate they stand for."""

    clip: VideoClip
    picks: tuple[int, ...]
    fps: float
    source_fps: float = 0.0  # the rate of the clip's own frames: a file's header rate; given frames: video_fps

    def patch_seconds(self, temporal_patch: int) -> list[float]:
        """The time of each temporal patch in the source video (Qwen3-VL's timestamps): each kept frame at its index
        / `source_fps`, the last repeated to fill the last patch, a patch at the mean of its first and last frame."""
        picks = list(self.picks) + [self.picks[-1]] * (-len(self.picks) % temporal_patch)
        times = [i / self.source_fps for i in picks]
        return [(times[g] + times[g + temporal_patch - 1]) / 2 for g in range(0, len(times), temporal_patch)]

    def images(self) -> list[Any]:
        """The kept frames as RGB images (a file is decoded up to its last kept frame)."""
        if not self.clip.file:
            return [decoded(self.clip.frames[i]) for i in self.picks]
        p = Path(self.clip.file)
        av = _av("video", p)
        wanted, last, got = set(self.picks), max(self.picks), {}
        with av.open(str(p)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    got[i] = frame.to_image().convert("RGB")
                if i >= last:
                    break
        if len(got) < len(wanted):
            raise BadRow(f"{p} decoded to {len(got)} of the frames its header promised ({self.clip.file_frames}); "
                         f"re-encode it, e.g. ffmpeg -i {p.name} -c:v libx264 {p.stem}_fixed.mp4")
        return [got[i] for i in self.picks]


def load_video(image_processor: Any, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel patches of one video from its frames (RGB images; rows: patches in (time, row, column) order) and its
    (t, h, w) grid. The last frame is repeated to fill the last temporal patch, as the models' own video processors
    do."""
    temporal = int(image_processor.temporal_patch_size)
    if {im.size for im in images} != {images[0].size}:
        raise BadRow(f"the frames of a video differ in size ({', '.join(sorted({str(im.size) for im in images}))}); "
                     "extract them at one size")
    images = list(images) + [images[-1]] * (-len(images) % temporal)
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
    """The videos of one example, decoded when a batch needs them."""

    image_processor: Any
    videos: tuple[SampledVideo, ...]

    def load(self) -> torch.Tensor:
        """Pixel patches of every video, in order."""
        return torch.cat([load_video(self.image_processor, v.images())[0] for v in self.videos])
