"""A model's shape (layers, widths, vocab) from a catalog id, a config.json, or a local folder; and its counts."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from shardfit.errors import UserError
from shardfit.plan.audio import AudioShape, audio_shape_of
from shardfit.plan.media import VisionShape, vision_shape_of


@dataclass(frozen=True)
class ModelShape:
    id: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None
    experts: int = 1
    top_k: int = 1
    # outside the decoder: a multimodal model's vision and audio towers (counted in `vision` and `audio` too)
    extra_params: int = 0
    vision: VisionShape | None = None
    audio: AudioShape | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer in one decoder block (each expert's MLP counted)."""
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        attn = [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden)]
        mlp = [(self.hidden, self.intermediate)] * 2 + [(self.intermediate, self.hidden)]
        return attn + mlp * self.experts + ([(self.hidden, self.experts)] if self.experts > 1 else [])

    def layer_params(self) -> int:
        return sum(i * o for i, o in self.linear_shapes()) + 2 * self.hidden

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embed_params() + self.hidden + self.extra_params

    def lora_params(self, rank: int) -> int:
        """Adapter size for `all-linear` targets (every linear in every block; not the output head)."""
        return self.layers * sum(rank * (i + o) for i, o in self.linear_shapes() if o != self.experts)


@cache
def catalog() -> dict[str, dict[str, Any]]:
    return yaml.safe_load((Path(__file__).with_name("catalog.yaml")).read_text())


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


def _from_config(cfg: dict[str, Any], name: str) -> ModelShape:
    nested = cfg.get("text_config") or (cfg.get("thinker_config") or {}).get("text_config") or cfg
    text = nested if isinstance(nested, dict) else cfg
    try:
        heads = text["num_attention_heads"]
        shape = ModelShape(
            id=name, layers=text["num_hidden_layers"], hidden=text["hidden_size"],
            intermediate=text.get("intermediate_size") or text.get("ffn_hidden_size") or 4 * text["hidden_size"],
            heads=heads, kv_heads=text.get("num_key_value_heads") or text.get("multi_query_group_num") or heads,
            vocab=text.get("vocab_size") or cfg["vocab_size"], head_dim=text.get("head_dim"),
            # Qwen-Omni: the thinker's own setting decides (its head is untied whatever its text config says).
            tied=bool(cfg.get("tie_word_embeddings", (cfg.get("thinker_config") or {}).get(
                "tie_word_embeddings", text.get("tie_word_embeddings", False)))),
            experts=text.get("num_local_experts") or text.get("num_experts") or 1,
            top_k=text.get("num_experts_per_tok") or 1)
        vision = vision_shape_of(cfg)
        audio = audio_shape_of(cfg)
    except KeyError as e:
        raise UserError(f"{name}: config.json has no {e}; shardfit plans decoder-only transformers.") from None
    sizes = {"num_hidden_layers": shape.layers, "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
             "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab}
    for key_name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: config.json's {key_name} is {value!r}; it must be a positive integer.")
    if vision is not None or audio is not None:
        shape = dataclasses.replace(shape, vision=vision, audio=audio, extra_params=tower_params(vision, audio))
    return shape


def tower_params(vision: VisionShape | None, audio: AudioShape | None) -> int:
    """The weights of a multimodal model's towers: what it holds outside the decoder (Qwen2.5-Omni's talker and
    token2wav are never built for training)."""
    return (vision.params() if vision else 0) + (audio.params() if audio else 0)


def resolve_shape(model: str) -> ModelShape:
    """The shape of `model`: a catalog id, a config.json path, a HF folder, or a bundled GGUF model."""
    entries = catalog()
    if model in entries:
        return _from_entry(model, entries[model])
    lower = {k.lower(): k for k in entries}
    for variant in _variants(model.lower()):  # a base model and its -Instruct twin share one shape
        if variant in lower:
            return _from_entry(model if variant != model.lower() else lower[variant], entries[lower[variant]])
    p = Path(model).expanduser()
    if p.is_file() and p.name.endswith(".json"):
        return _from_config(_read_config_json(p, model), model)
    if p.is_dir() and (p / "config.json").is_file():
        return _from_config(_read_config_json(p / "config.json", model), model)
    stem = model.lower().rsplit("/", 1)[-1]
    close = [k for k in entries if stem and stem in k.lower()][:3] or \
        difflib.get_close_matches(model, list(entries), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else " `shardfit plan --list-models` shows the catalog."
    raise UserError(f"--model {model}: not a local folder/config.json and not in the bundled catalog.{hint}")


def _from_entry(name: str, entry: dict[str, Any]) -> ModelShape:
    """A catalog entry as a shape (its `vision` and `audio` mappings as a VisionShape and an AudioShape; with
    either and no `extra_params`, the towers' weights are what lies outside the decoder)."""
    vision = VisionShape(**entry["vision"]) if entry.get("vision") else None
    audio = AudioShape(**entry["audio"]) if entry.get("audio") else None
    extra = entry.get("extra_params", tower_params(vision, audio))
    return ModelShape(id=name, **dict(entry, vision=vision, audio=audio, extra_params=extra))


def _variants(name: str) -> list[str]:
    """`name` and its base/instruct twin (lower case): the catalog holds one of the two for many models."""
    for suffix in ("-instruct", "-chat", "-it"):
        if name.endswith(suffix):
            return [name, name[: -len(suffix)]]
    return [name, name + "-instruct", name + "-it"]


def hf_config(shape: ModelShape) -> Any:
    """A transformers config of the shape's architecture family (Qwen2 for Qwen ids, else Llama): what a weightless
    model is built from when no config.json is at hand (a catalog id)."""
    from transformers import LlamaConfig, Qwen2Config  # configs only; the planner itself needs no transformers

    cls = Qwen2Config if "qwen" in shape.id.lower() else LlamaConfig
    kwargs = dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                  tie_word_embeddings=shape.tied, max_position_embeddings=131072)
    if shape.head_dim:
        kwargs["head_dim"] = shape.head_dim
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
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                architectures=["Qwen2_5_VLForConditionalGeneration"])
    vision = dict(geometry, embed_dim=v.dim, hidden_size=v.out, mlp_ratio=v.mlp // v.dim)
    return Qwen2VLConfig(text_config=text, vision_config=vision, architectures=["Qwen2VLForConditionalGeneration"])
