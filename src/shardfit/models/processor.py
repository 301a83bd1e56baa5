"""The media side of a multimodal model's inputs, without `AutoProcessor`: the image processor (PIL backend, which
needs no torchvision), for Qwen2.5-Omni and Qwen3-Omni also the audio feature extractor (Whisper-style log-mel), and
the token strings an image or a clip takes, read from the model's own config and tokenizer.

AutoProcessor for Qwen2-VL and the Omni models also builds a video processor that needs torchvision, whose wheels
do not match every torch build; images and audio need only the image processor, the feature extractor and the
tokenizer, so shardfit assembles those.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor

from shardfit.config import Config
from shardfit.data.audio import AudioProcessor
from shardfit.data.video import VideoSettings
from shardfit.data.vision import VisionProcessor
from shardfit.errors import UserError
from shardfit.models.anatomy import (
    CHUNKED_AUDIO_MODEL_TYPES,
    FLAGGED_MEDIA_TYPES,
    OMNI_MODEL_TYPES,
    SOFT_TOKEN_MODEL_TYPES,
    TIMESTAMPED_VIDEO_MODEL_TYPES,
    VIDEO_MODEL_TYPES,
    VISION_MODEL_TYPES,
)
from shardfit.models.source import ModelSource

PREPROCESSOR = "preprocessor_config.json"


def vision_model_type(source: ModelSource, trust_remote_code: bool = False) -> str | None:
    """The model type when the model is a multimodal model shardfit trains on media, else None. Qwen-Omni and
    Gemma 3 are one only with their preprocessor_config.json (without it, Omni's thinker and Gemma 3's language
    model train on text)."""
    if source.gguf_file or not (Path(source.folder) / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the model build, with its fix
        return None
    kind = getattr(config, "model_type", None)
    if kind in FLAGGED_MEDIA_TYPES:
        return kind if (Path(source.folder) / PREPROCESSOR).is_file() else None
    return kind if kind in VISION_MODEL_TYPES else None


def _token(tokenizer: Any, source: ModelSource, token_id: int | None, names: tuple[str, ...], what: str) -> str:
    """The token string of `token_id`, or of the first of `names` the tokenizer knows when the config names no
    id (Qwen2.5-Omni's thinker config does not name its vision markers)."""
    if token_id is not None:
        name = tokenizer.convert_ids_to_tokens(token_id)
        if name is not None:
            return name
    for name in names:
        tid = tokenizer.convert_tokens_to_ids(name)
        if tid is not None and tid != tokenizer.unk_token_id:
            return name
    raise UserError(f"'model': the tokenizer of {source.name} lacks the {what} token its config names "
                    f"(id {token_id}); use the base model's tokenizer files.")


def _marker_id(configs: tuple[Any, ...], edge: str) -> int | None:
    """The id of the token before (`edge` start) or after (end) an image, from the first config that names it:
    Qwen's vision_start / vision_end (Qwen2.5-Omni's in its talker config), else GLM-4.5V's image_start / image_end."""
    for kind in ("vision", "image"):
        for config in configs:
            tid = getattr(config, f"{kind}_{edge}_token_id", None)
            if tid is not None:
                return int(tid)
    return None


def load_vision_processor(source: ModelSource, cfg: Config, tokenizer: Any) -> VisionProcessor | None:
    """The image processor and image tokens of a multimodal model (None for a text model), with
    `image_min_pixels` / `image_max_pixels` as the processor's resize bounds (of video frames too); for Qwen2-VL,
    Qwen2.5-VL and Qwen3-VL the video token and `video_max_frames` / `video_fps`; for Qwen2.5-Omni and Qwen3-Omni
    the audio feature extractor and audio tokens, clips cut at `audio_max_seconds`."""
    kind = vision_model_type(source, cfg.trust_remote_code)
    if kind is None:
        return None
    config = AutoConfig.from_pretrained(source.folder, trust_remote_code=cfg.trust_remote_code)
    media = getattr(config, "thinker_config", config)  # Qwen-Omni: the thinker reads the media
    if not (Path(source.folder) / PREPROCESSOR).is_file():
        raise UserError(f"'model': {source.name} is a vision-language model without {PREPROCESSOR}; copy the base "
                        f"model's {PREPROCESSOR} into the folder.")
    if kind in SOFT_TOKEN_MODEL_TYPES:
        return _soft_token_processor(source, cfg, tokenizer, config)
    bounds = {k: v for k, v in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels))
              if v is not None}
    try:
        processor = AutoImageProcessor.from_pretrained(source.folder, backend="pil",
                                                       trust_remote_code=cfg.trust_remote_code, **bounds)
        extractor = AutoFeatureExtractor.from_pretrained(source.folder) if kind in OMNI_MODEL_TYPES else None
    except Exception as e:  # noqa: BLE001 - a user's files: any failure to read them is bad input
        raise UserError(f"'model': cannot load the image processor or audio feature extractor of {source.name}: "
                        f"{type(e).__name__}: {e}") from None
    talker = getattr(config, "talker_config", None)
    start_id, end_id = _marker_id((media, talker), "start"), _marker_id((media, talker), "end")
    image = _token(tokenizer, source, media.image_token_id, (), "image")
    start = _token(tokenizer, source, start_id, ("<|vision_bos|>", "<|vision_start|>"), "vision start")
    end = _token(tokenizer, source, end_id, ("<|vision_eos|>", "<|vision_end|>"), "vision end")
    audio = None
    if extractor is not None:
        # Qwen3-Omni's tower runs a clip in chunks of 2 x n_window frames: its own token count per clip.
        chunk = 2 * int(media.audio_config.n_window) if kind in CHUNKED_AUDIO_MODEL_TYPES else None
        audio = AudioProcessor(extractor, _token(tokenizer, source, media.audio_token_id, (), "audio"),
                               media.audio_token_id,
                               _token(tokenizer, source, media.audio_start_token_id, (), "audio start"),
                               _token(tokenizer, source, getattr(media, "audio_end_token_id", None),
                                      ("<|audio_end|>", "<|audio_eos|>"), "audio end"),
                               cfg.audio_max_seconds, chunk)
    video = None
    if kind in VIDEO_MODEL_TYPES:
        # Qwen2.5-VL spaces a video's temporal positions by seconds (tokens_per_second); Qwen2-VL by one per patch.
        tps = getattr(media.vision_config, "tokens_per_second", None) if kind == "qwen2_5_vl" else None
        # Qwen3-VL: a timestamp and the vision markers around each temporal patch.
        markers = (tokenizer.convert_tokens_to_ids(start), tokenizer.convert_tokens_to_ids(end)) \
            if kind in TIMESTAMPED_VIDEO_MODEL_TYPES else None
        video = VideoSettings(_token(tokenizer, source, media.video_token_id, (), "video"), media.video_token_id,
                              cfg.video_max_frames, cfg.video_fps, tps, markers)
    return VisionProcessor(processor, image, media.image_token_id, start, end,
                           media.vision_config.spatial_merge_size, audio, video)


def _soft_token_processor(source: ModelSource, cfg: Config, tokenizer: Any, config: Any) -> VisionProcessor:
    """Gemma 3's image side: its image processor (every image resized to the tower's square, pan-and-scan off: one
    crop per image, as the processor does by default) and an image's text as Gemma3Processor writes it, a blank
    line, <start_of_image>, mm_tokens_per_image soft tokens, <end_of_image>, a blank line. image_min_pixels /
    image_max_pixels do not apply: the tower sees a fixed size."""
    try:
        processor = AutoImageProcessor.from_pretrained(source.folder, backend="pil", do_pan_and_scan=False,
                                                       trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a user's files: any failure to read them is bad input
        raise UserError(f"'model': cannot load the image processor of {source.name}: {type(e).__name__}: "
                        f"{e}") from None
    image = _token(tokenizer, source, config.image_token_id, ("<image_soft_token>",), "image")
    start = _token(tokenizer, source, config.boi_token_id, ("<start_of_image>",), "start of image")
    end = _token(tokenizer, source, config.eoi_token_id, ("<end_of_image>",), "end of image")
    side = math.isqrt(int(config.mm_tokens_per_image))
    if side * side != config.mm_tokens_per_image:
        raise UserError(f"'model': {source.name}'s mm_tokens_per_image {config.mm_tokens_per_image} is not a square "
                        "(its projector pools the tower's patches to a square grid); use the base model's config.")
    return VisionProcessor(processor, image, config.image_token_id, f"\n\n{start}", f"{end}\n\n", 1,
                           soft_grid=(1, side, side))


def save_processor(vp: VisionProcessor, out: Path) -> None:
    """Write the processor files beside the tokenizer's: the image processor's preprocessor_config.json, with the
    audio feature extractor's settings merged in (the Omni models keep both in that one file)."""
    vp.image_processor.save_pretrained(str(out))
    if vp.audio is not None:
        path = Path(out) / PREPROCESSOR
        merged = {**json.loads(path.read_text()), **vp.audio.feature_extractor.to_dict()}
        path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
