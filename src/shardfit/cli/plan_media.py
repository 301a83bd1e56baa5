"""The images and audio `plan` counts in each sample: from the flags, else from a sample of the config's data
(read only for a model with a tower)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.audio import AudioLoad, check_audio_fits
from shardfit.plan.media import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, MediaLoad, check_fits, parse_image_size
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload

if TYPE_CHECKING:  # the data readers load only for a config with a tower
    from shardfit.data.image_census import MediaSample


def audio_load(args: argparse.Namespace, config_max_seconds: float | None) -> AudioLoad | None:
    """The audio clips of a sample from --audio-per-sample / --audio-seconds (both or neither)."""
    if args.audio_per_sample is None and args.audio_seconds is None:
        return None
    if args.audio_per_sample is None or args.audio_seconds is None or args.audio_seconds <= 0:
        raise UserError("--audio-per-sample and --audio-seconds go together, e.g. --audio-per-sample 1 "
                        "--audio-seconds 10.")
    return AudioLoad(args.audio_per_sample, args.audio_seconds, config_max_seconds)


def media_load(args: argparse.Namespace, config_max_pixels: int | None) -> MediaLoad | None:
    """The images of a sample from --images-per-sample / --image-size (both or neither)."""
    if args.images_per_sample is None and args.image_size is None:
        return None
    if args.images_per_sample is None or args.image_size is None:
        raise UserError("--images-per-sample and --image-size go together, e.g. --images-per-sample 2 --image-size "
                        "1024x768.")
    width, height = parse_image_size(args.image_size)
    max_pixels = args.image_max_pixels or config_max_pixels or DEFAULT_MAX_PIXELS
    return MediaLoad(args.images_per_sample, width, height, max_pixels=max_pixels)


def data_sample(cfg: Config) -> Callable[[], MediaSample]:
    """The config's sampled rows, read on first use and once for the image and the audio census."""
    from shardfit.data.image_census import sampled_media  # the data readers: only for a config with a tower

    return functools.cache(lambda: sampled_media(cfg.data))


def audio_from_data(cfg: Config, sample: MediaSample, quiet: bool) -> AudioLoad | None:
    """The clips of a sample as the config's data holds them (a sample of rows, WAV headers only); the line
    saying so goes to stderr unless `quiet`."""
    from shardfit.data.audio_census import audio_census  # the data readers: only for a config with an audio tower

    census = audio_census(sample)
    if census is None:
        return None
    if not quiet:
        print(f"plan: {census.describe()}", file=sys.stderr)
    return AudioLoad(census.most_per_row, census.seconds, cfg.audio_max_seconds)


def media_from_data(cfg: Config, sample: MediaSample, quiet: bool) -> MediaLoad | None:
    """The images of a sample as the config's data holds them (a sample of rows, image headers only); the line
    saying what was taken goes to stderr (stdout stays the plan, JSON included)."""
    from shardfit.data.image_census import image_census  # Pillow and the data readers: only for a VL config

    census = image_census(sample)
    if census is None:
        return None
    if not quiet:
        print(f"plan: {census.describe()}", file=sys.stderr)
    return MediaLoad(census.most_per_row, census.width, census.height,
                     min_pixels=cfg.image_min_pixels or DEFAULT_MIN_PIXELS,
                     max_pixels=cfg.image_max_pixels or DEFAULT_MAX_PIXELS)


def with_media(args: argparse.Namespace, cfg: Config | None, shape: ModelShape,
                w: Workload) -> tuple[Workload, Any, Any]:
    """The workload with each sample's images and audio (from the flags, else from a sample of the config's
    data), and what was counted of them."""
    sample = data_sample(cfg) if args.config else None
    media = media_load(args, cfg.image_max_pixels if args.config else None)
    if media is None and sample is not None and (shape.vision is not None or shape.soft_tower is not None):
        media = media_from_data(cfg, sample(), args.json)
    if media is not None:
        if shape.vision is not None:  # the tower's own geometry (every Qwen-VL so far: 14-pixel patches, 2x2)
            media = dataclasses.replace(media, patch=shape.vision.patch, merge=shape.vision.merge)
        elif shape.soft_tower is not None:  # Gemma 3: mm_tokens_per_image tokens per image, any size
            media = shape.soft_tower.load(media)
        check_fits(media, w.seq_len)
        rows, cols = media.grid()
        w = dataclasses.replace(w, images=media.images_per_sample, image_rows=rows, image_cols=cols)
    audio = audio_load(args, cfg.audio_max_seconds if args.config else None)
    if audio is None and sample is not None and shape.audio is not None:
        audio = audio_from_data(cfg, sample(), args.json)
    if audio is not None:
        if shape.audio is not None:  # the tower's own token count (Qwen3-Omni's per chunk of frames)
            audio = dataclasses.replace(audio, chunk=shape.audio.token_chunk)
        check_audio_fits(audio, w.seq_len, media.tokens_per_sample() if media is not None else 0)
        w = dataclasses.replace(w, audio_clips=audio.clips_per_sample, audio_frames=audio.frames())
    return w, media, audio
