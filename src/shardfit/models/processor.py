"""The vision side of a vision-language model's inputs, without `AutoProcessor`: the image processor (PIL backend,
which needs no torchvision) and the token strings an image takes, read from the model's own config and tokenizer.

AutoProcessor for Qwen2-VL also builds a video processor that needs torchvision, whose wheels do not match every
torch build; images need only the image processor and the tokenizer, so shardfit assembles those two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoImageProcessor

from shardfit.config import Config
from shardfit.data.vision import VisionProcessor
from shardfit.errors import UserError
from shardfit.models.anatomy import VISION_MODEL_TYPES
from shardfit.models.source import ModelSource


def vision_model_type(source: ModelSource, trust_remote_code: bool = False) -> str | None:
    """The model type when the model is a vision-language model shardfit trains on images, else None."""
    if source.gguf_file or not (Path(source.folder) / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(source.folder, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the model build, with its fix
        return None
    kind = getattr(config, "model_type", None)
    return kind if kind in VISION_MODEL_TYPES else None


def load_vision_processor(source: ModelSource, cfg: Config, tokenizer: Any) -> VisionProcessor | None:
    """The image processor and image tokens of a vision-language model (None for a text model), with
    `image_min_pixels` / `image_max_pixels` as the processor's resize bounds."""
    if vision_model_type(source, cfg.trust_remote_code) is None:
        return None
    config = AutoConfig.from_pretrained(source.folder, trust_remote_code=cfg.trust_remote_code)
    if not (Path(source.folder) / "preprocessor_config.json").is_file():
        raise UserError(f"'model': {source.name} is a vision-language model without preprocessor_config.json; copy "
                        "the base model's preprocessor_config.json into the folder.")
    bounds = {k: v for k, v in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels))
              if v is not None}
    try:
        processor = AutoImageProcessor.from_pretrained(source.folder, backend="pil",
                                                       trust_remote_code=cfg.trust_remote_code, **bounds)
    except Exception as e:  # noqa: BLE001 - a user's files: any failure to read them is bad input
        raise UserError(f"'model': cannot load the image processor of {source.name}: {type(e).__name__}: {e}") \
            from None
    names = tokenizer.convert_ids_to_tokens([config.image_token_id, config.vision_start_token_id,
                                             config.vision_end_token_id])
    if any(n is None for n in names):
        raise UserError(f"'model': the tokenizer of {source.name} lacks the image tokens its config names "
                        f"(ids {config.image_token_id}, {config.vision_start_token_id}, "
                        f"{config.vision_end_token_id}); use the base model's tokenizer files.")
    return VisionProcessor(processor, names[0], config.image_token_id, names[1], names[2],
                           config.vision_config.spatial_merge_size)
