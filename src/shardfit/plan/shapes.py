"""A model's shape (layers, widths, vocab) from a catalog id, a config.json, or a local folder; and its counts."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from shardfit.errors import UserError
from shardfit.plan.audio import AudioShape
from shardfit.plan.config_shape import shape_from_config, tower_params
from shardfit.plan.media import VisionShape
from shardfit.plan.model_shape import MLA, ModelShape
from shardfit.plan.sdpa_classes import runs_eager

__all__ = ["MLA", "ModelShape", "catalog", "catalog_config", "hf_config", "resolve_shape", "tower_params"]


@cache
def catalog() -> dict[str, dict[str, Any]]:
    """The bundled catalog, read with libyaml's safe loader where PyYAML has it: every `plan` and launch reads it,
    and the C loader reads it several times faster, to the same plain data."""
    return yaml.load((Path(__file__).with_name("catalog.yaml")).read_text(),
                     Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _read_config_json(path: Path, name: str) -> dict[str, Any]:
    """A config.json as a dict; anything else is a UserError naming the file."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a valid config.json ({e}); re-download the model's config.json.") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}.") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: a config.json holds one JSON object, got {type(cfg).__name__}.")
    return cfg


def local_config(model: str) -> dict[str, Any] | None:
    """The config.json of `model` where it names one, a HF folder holding one, or a hub id whose config.json is in
    the local Hugging Face cache (a UserError naming the file if it is not a JSON object); None for anything else
    (a catalog id, a hub id never downloaded here)."""
    path = _local_config_path(model) or cached_config_path(model)
    return _read_config_json(path, model) if path is not None else None


def _local_config_path(model: str) -> Path | None:
    """The config.json `model` names as a path: the file itself, or the one in the HF folder it names; None where it
    names neither, including a string the OS cannot look up as a path (a name longer than the file system allows,
    `~user` for no such user): such a --model is an id, and its lookup must end in a message, not a traceback."""
    try:
        p = Path(model).expanduser()
    except RuntimeError:  # `~name/...` where no user `name` exists: no path of this machine
        p = Path(model)
    try:
        if p.is_file() and p.name.endswith(".json"):
            return p
        return p / "config.json" if p.is_dir() and (p / "config.json").is_file() else None
    except OSError:  # ENAMETOOLONG and kin: pathlib re-raises all but a missing file's errors
        return None


def cached_config_path(model: str) -> Path | None:
    """The config.json of hub id `model` as an earlier download left it in the Hugging Face cache (HF_HUB_CACHE, or
    HF_HOME/hub, or ~/.cache/huggingface/hub; the snapshot `refs/main` names), found by huggingface_hub without
    touching the network; None where the id is not a hub id or nothing of it is cached. Only the JSON is read: a
    cached model's code (auto_map) never runs here."""
    if not model or model.startswith((".", "/", "~")) or model.endswith((".json", ".gguf")):
        return None
    from huggingface_hub import try_to_load_from_cache  # transformers' own dependency; imported where it is used

    try:
        found = try_to_load_from_cache(model, "config.json")
    # ValueError: not a valid repo id (huggingface_hub's HFValidationError); OSError: a cache entry it cannot list
    # (`snapshots` a file, no permission), which holds nothing a plan can use.
    except (ValueError, OSError):
        return None
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def _cached_shape(path: Path, model: str) -> ModelShape:
    """The shape of hub id `model` from its cached config.json `path`; a UserError about a key in it also says where
    that file is, since the user named an id and may not know the plan read the cache."""
    try:
        return shape_from_config(_read_config_json(path, model), model)
    except UserError as e:
        if str(path) in str(e):
            raise
        raise UserError(f"{e} (--model {model} was read from the Hugging Face cache: {path}; download the model "
                        f"again, or pass a folder holding a corrected config.json)") from None


def resolve_shape(model: str) -> ModelShape:
    """The shape of `model`: a catalog id, a config.json path, a HF folder, or a bundled GGUF model."""
    entries = catalog()
    if model in entries:
        return _from_entry(model, entries[model])
    lower = {k.lower(): k for k in entries}
    for variant in _variants(model.lower()):  # a base model and its -Instruct twin share one shape
        if variant in lower:
            return _from_entry(model if variant != model.lower() else lower[variant], entries[lower[variant]])
    local = _local_config_path(model)
    if local is not None:
        return shape_from_config(_read_config_json(local, model), model)
    cached = cached_config_path(model)
    if cached is not None:
        return _cached_shape(cached, model)
    stem = model.lower().rsplit("/", 1)[-1]
    close = [k for k in entries if stem and stem in k.lower()][:3] or \
        difflib.get_close_matches(model, list(entries), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else " `shardfit plan --list-models` shows the catalog."
    raise UserError(f"--model {model}: not a local folder/config.json, not in the local Hugging Face cache and not in "
                    f"the bundled catalog.{hint}")


def _from_entry(name: str, entry: dict[str, Any]) -> ModelShape:
    """A catalog entry as a shape: a published config.json kept whole (`config`, the families whose layouts the
    compact form cannot say: experts, shared experts, dense blocks, latent attention), the compact form (its
    `vision` and `audio` mappings as a VisionShape and an AudioShape; with either and no `extra_params`, the towers'
    weights are what lies outside the decoder), or `twin`: another entry's shape under this name."""
    entry = _untwinned(entry)
    if "config" in entry:
        return shape_from_config(entry["config"], name)
    vision = VisionShape(**entry["vision"]) if entry.get("vision") else None
    audio = AudioShape(**entry["audio"]) if entry.get("audio") else None
    extra = entry.get("extra_params", tower_params(vision, audio))
    return ModelShape(id=name, **dict(entry, vision=vision, audio=audio, extra_params=extra),
                      eager_only=runs_eager(entry.get("model_type"), "sdpa"))


def _variants(name: str) -> list[str]:
    """`name` and its twins (lower case) that share its shape: the base model and its -Instruct / -Chat / -It /
    -Thinking / -Base releases, with or without a date stamp (Qwen3-4B-Instruct-2507 is Qwen3-4B retrained); the
    catalog holds one of them for many models."""
    stem = re.sub(r"-\d{4}$", "", name)
    stem = re.sub(r"-(instruct|chat|it|thinking|base)$", "", stem)
    out = [name, stem, stem + "-instruct", stem + "-it"]
    return list(dict.fromkeys(out))


def _untwinned(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry a `twin` entry names (a release whose config.json has its twin's shape under another name, such as
    Qwen2.5-Coder-7B-Instruct and Qwen2.5-7B-Instruct, which the name-based `_variants` cannot pair), else `entry`."""
    return catalog()[entry["twin"]] if "twin" in entry else entry


def catalog_config(model: str) -> dict[str, Any] | None:
    """The published config.json a catalog entry (or its twin) keeps whole, or None (a compact entry, or not in the
    catalog)."""
    entry = catalog().get(model)
    entry = _untwinned(entry) if entry else None
    return dict(entry["config"]) if entry and "config" in entry else None


# Compact catalog entries whose id names a family transformers builds apart from Llama (its norms, biases and
# MLP differ): the first pattern the lower-cased id contains picks the config class.
# ChatGLM2/3 (remote code) are built as Qwen2: biases on q, k and v only and a gated MLP, the same weights as their
# fused query_key_value and dense_h_to_4h (Llama's attention_bias would add an o_proj bias they do not have).
FAMILY_CONFIGS = (("gemma-3-", "Gemma3TextConfig"), ("gemma-2-", "Gemma2Config"), ("gemma", "GemmaConfig"),
                  ("glm-4", "GlmConfig"), ("chatglm", "Qwen2Config"), ("phi-3", "Phi3Config"),
                  ("mistral", "MistralConfig"))


def _compact_config_class(shape: ModelShape) -> Any:
    """The transformers config class a compact entry's family is built from: Mixtral for a mixture of experts,
    Qwen3 for Qwen ids whose attention normalizes q and k, Qwen2 for the other Qwen ids, the `FAMILY_CONFIGS`
    family the id names, and Llama for the rest."""
    import transformers  # configs only; the planner needs none

    lower = shape.id.lower()
    if shape.moe:
        return transformers.MixtralConfig
    if "qwen" in lower:
        return transformers.Qwen3Config if shape.qk_norm else transformers.Qwen2Config
    name = next((cls for pattern, cls in FAMILY_CONFIGS if pattern in lower), "LlamaConfig")
    return getattr(transformers, name)


def _declared_keys(cls: Any) -> set[str]:
    """The keys a transformers config class declares (its dataclass fields, or its `__init__`'s parameters): a key
    it does not declare is kept on the config as an attribute its model never reads (Mistral's class has no
    attention_bias: its projections are bias-free whatever the key says)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters)


def hf_config(shape: ModelShape) -> Any:
    """A transformers config of the shape's architecture family: the catalog's own config.json where it keeps one,
    else the compact entry's family (`_compact_config_class`) at its sizes: what a weightless model is built from
    when no config.json is at hand (a catalog id)."""
    from transformers import AutoConfig  # configs only; the planner needs none

    kept = catalog_config(shape.id)
    if kept is not None:
        return AutoConfig.for_model(kept.pop("model_type"), **kept)

    cls = _compact_config_class(shape)
    kwargs: dict[str, Any] = dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                  num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                                  tie_word_embeddings=shape.tied, max_position_embeddings=131072)
    if shape.head_dim:
        kwargs["head_dim"] = shape.head_dim
    if shape.moe:
        kwargs.update(num_local_experts=shape.experts, num_experts_per_tok=shape.top_k)
    declared = _declared_keys(cls)
    if "attention_bias" in declared:  # Llama's, GLM's, Gemma's default is no bias, not the entry's
        kwargs["attention_bias"] = shape.attn_bias
    if "sliding_window" in declared:
        # The entry's window, not the class's default: MistralConfig's 4096 is no window of Mistral-Nemo's, Gemma 3's
        # 4096 not gemma-3-1b's 512, and Phi3Config's None not Phi-3 4k's published 2047; the rank refuses layouts
        # by the built config and the plan by the shape, which must agree.
        kwargs["sliding_window"] = shape.sliding_window if shape.sliding_layers and shape.sliding_window else None
    if shape.vision is not None and ("-vl" in shape.id.lower() or shape.audio is not None):
        # M-RoPE splits each head's rotary half over time, height and width as Qwen does ([16, 24, 24] at 128).
        half = shape.hd // 2
        sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}
        return vl_config(shape.vision, kwargs) if shape.audio is None else omni_config(shape.vision, shape.audio,
                                                                                       kwargs)
    return cls(**kwargs)


def omni_config(v: VisionShape, a: AudioShape, text: dict[str, Any]) -> Any:
    """A Qwen2.5-Omni config of the tower shapes and text sizes, speech output off (training never builds the
    talker): what a catalog Omni id simulates with both towers."""
    from transformers import Qwen2_5OmniConfig  # configs only, as in hf_config

    vision = dict(depth=v.depth, num_heads=v.heads, patch_size=v.patch, spatial_merge_size=v.merge,
                  temporal_patch_size=v.temporal_patch, in_channels=v.in_channels, hidden_size=v.dim,
                  intermediate_size=v.mlp, out_hidden_size=v.out)
    audio = dict(encoder_layers=a.layers, d_model=a.dim, encoder_ffn_dim=a.ffn, encoder_attention_heads=a.heads,
                 output_dim=a.out, num_mel_bins=a.mels, n_window=a.window, max_source_positions=a.positions)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio,
                   tie_word_embeddings=text["tie_word_embeddings"])
    return Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False,
                             architectures=["Qwen2_5OmniForConditionalGeneration"])


def vl_config(v: VisionShape, text: dict[str, Any]) -> Any:
    """A Qwen2-VL (or, for a gated tower, Qwen2.5-VL) config of the vision shape and text sizes: what a catalog
    VL id simulates with its vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig  # configs only, as in hf_config

    geometry = dict(depth=v.depth, num_heads=v.heads, patch_size=v.patch, spatial_merge_size=v.merge,
                    temporal_patch_size=v.temporal_patch, in_channels=v.in_channels)
    if v.gated:
        vision = dict(geometry, hidden_size=v.dim, intermediate_size=v.mlp, out_hidden_size=v.out)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                                architectures=["Qwen2_5_VLForConditionalGeneration"])
    vision = dict(geometry, embed_dim=v.dim, hidden_size=v.out, mlp_ratio=v.mlp // v.dim)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                         architectures=["Qwen2VLForConditionalGeneration"])
