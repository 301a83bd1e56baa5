"""The catalog's attention windows and chunks are the published models': the planner's sequence-parallel and
pipeline rules read them from the catalog before anything is built, the rank reads them from the built model's
config, and the two must refuse the same layouts."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from shardfit.plan.attention_layout import TYPE_KINDS, layout_of, text_of
from shardfit.plan.shapes import catalog, hf_config, resolve_shape
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve import sequence

# The published config.json files' windows where transformers' class default differs (Phi3Config: None;
# Gemma3TextConfig: 4096): microsoft/Phi-3-mini-4k-instruct and Phi-3-medium-4k-instruct set sliding_window 2047;
# google/gemma-3-1b-it sets 512 and gemma-3-4b/12b/27b-it 1024, each with every sixth block global (the class's
# default pattern, which the 1b and 12b files also state and the 4b file leaves out).
PUBLISHED = [
    ("microsoft/Phi-3-mini-4k-instruct", "Phi3Config", 2047),
    ("microsoft/Phi-3-medium-4k-instruct", "Phi3Config", 2047),
    ("google/gemma-3-1b-it", "Gemma3TextConfig", 512),
    ("google/gemma-3-4b-it", "Gemma3TextConfig", 1024),
    ("google/gemma-3-12b-it", "Gemma3TextConfig", 1024),
    ("google/gemma-3-27b-it", "Gemma3TextConfig", 1024),
]


def _partial_everywhere(shape: Any, built: Any) -> None:
    """Both rules read partial attention from the catalog's shape and from the built config alike."""
    assert pipelines.facts_of_shape(shape).partial_attention and pipelines.facts_of_config(built).partial_attention
    assert sequence.facts_of_shape(shape).partial_attention and sequence.facts_of_config(built).partial_attention


@pytest.mark.parametrize("model,family,window", PUBLISHED)
def test_the_catalogs_windows_are_the_published_ones(model: str, family: str, window: int) -> None:
    """The catalog's window and sliding-block count are what transformers builds the family with from the
    published window: Phi-3 4k windows every block, Gemma 3 five blocks of every six."""
    shape = resolve_shape(model)
    built = getattr(transformers, family)(num_hidden_layers=shape.layers, sliding_window=window)
    types = getattr(built, "layer_types", None) or ["sliding_attention"] * shape.layers
    assert (shape.sliding_window, shape.sliding_layers) == (window, types.count("sliding_attention"))
    _partial_everywhere(shape, built)


def test_llama4s_chunked_attention_reaches_the_rules() -> None:
    """Llama 4 attends within 8192-token chunks on three blocks of four (its config's attention_chunk_size, the
    blocks transformers' Llama4TextConfig marks chunked_attention): the catalog's shape says so, so auto does not
    split rows or cut stages the rank then refuses."""
    shape = resolve_shape("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    built = hf_config(shape)
    text = built.text_config
    assert (shape.sliding_window, shape.sliding_layers) == (text.attention_chunk_size,
                                                            text.layer_types.count("chunked_attention"))
    assert (shape.sliding_window, shape.sliding_layers) == (8192, 36)
    _partial_everywhere(shape, built)


@pytest.mark.parametrize("model", sorted(k for k, v in catalog().items() if "config" in v))
def test_every_kept_config_reads_as_its_built_model(model: str) -> None:
    """Every catalog entry that keeps its published config.json whole builds the transformers class it names:
    the rules' reading of the catalog's shape (windows, chunks) is their reading of that class."""
    shape = resolve_shape(model)
    built = hf_config(shape)
    assert sequence.facts_of_shape(shape).partial_attention == sequence.facts_of_config(built).partial_attention
    assert pipelines.facts_of_shape(shape).partial_attention == pipelines.facts_of_config(built).partial_attention


@pytest.mark.parametrize("model", sorted(k for k, v in catalog().items() if "config" not in v and "twin" not in v))
def test_every_compact_entry_builds_with_its_own_window(model: str) -> None:
    """A compact entry is built from its family's class at the entry's window, not the class default (Mistral's
    4096 on Mistral-Nemo, which has none; Gemma 3's 4096 on gemma-3-1b's 512; Phi-3's None on Phi-3 4k's 2047): the
    rank refuses by the built config what the planner refuses by the shape."""
    shape = resolve_shape(model)
    built = hf_config(shape)
    text = getattr(built, "text_config", built)
    window = getattr(text, "sliding_window", None)
    assert window == (shape.sliding_window or None), (model, window)
    assert sequence.facts_of_shape(shape).partial_attention == sequence.facts_of_config(built).partial_attention
    assert pipelines.facts_of_shape(shape).partial_attention == pipelines.facts_of_config(built).partial_attention


SMALL = dict(num_hidden_layers=12, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
# config.json files as their families publish them: the window, and the layout left to the class (Mistral-7B-v0.1,
# Phi-3 4k, Gemma 2, Gemma 3's 4b text_config) or switched by Qwen's use_sliding_window.
LOCAL = [
    ("mistral", dict(sliding_window=4096)),
    ("phi3", dict(sliding_window=2047)),
    ("gemma2", dict(sliding_window=4096, head_dim=16)),
    ("gemma3_text", dict(sliding_window=1024, head_dim=16)),
    ("gemma3_text", dict(sliding_window=512, sliding_window_pattern=6, head_dim=16)),
    ("cohere2", dict(sliding_window=4096)),
    ("qwen2", dict(sliding_window=4096, use_sliding_window=False, max_window_layers=12)),
    ("qwen2", dict(sliding_window=4096, use_sliding_window=True, max_window_layers=4)),
    ("qwen3", dict(sliding_window=4096)),
    ("mixtral", dict(sliding_window=None, num_local_experts=4)),
    # keys left to the class's defaults or its own pattern keys: Qwen's max_window_layers (28), Mistral's window
    # (4096), Gemma 3's sliding_window_pattern, Cohere 2 whatever use_sliding_window says, EXAONE 4's text
    # pattern beside its layer_types (as published), and families whose class never reads the window key
    # (dots1, SmolLM3 without use_sliding_window).
    ("qwen2", dict(num_hidden_layers=36, sliding_window=4096, use_sliding_window=True)),
    ("mistral", dict()),
    ("gemma3_text", dict(sliding_window=512, sliding_window_pattern=3, head_dim=16)),
    ("exaone4", dict(sliding_window=4096, sliding_window_pattern="LLLG",
                     layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
                     + ["full_attention"] * 5)),
    ("cohere2", dict(sliding_window=4096, use_sliding_window=False)),
    ("dots1", dict(sliding_window=4096)),
    ("smollm3", dict(sliding_window=4096)),
]


@pytest.mark.parametrize("model_type,keys", LOCAL, ids=[f"{t}-{i}" for i, (t, _) in enumerate(LOCAL)])
def test_a_local_config_json_reads_its_windows_as_transformers_builds_them(model_type: str,
                                                                           keys: dict[str, Any]) -> None:
    """A model planned from its own config.json (a local folder, not the catalog) gets the windows transformers'
    class builds from that file, where the file leaves the layout to the class's defaults: the planner's rules
    refuse what the rank refuses and allow what it allows."""
    from transformers import AutoConfig

    from shardfit.plan.config_shape import shape_from_config

    cfg = {**SMALL, "model_type": model_type, **keys}
    shape = shape_from_config(cfg, "local")
    built = AutoConfig.for_model(**cfg)
    types = getattr(built, "layer_types", None) or \
        ["sliding_attention" if built.sliding_window else "full_attention"] * built.num_hidden_layers
    assert shape.sliding_layers == types.count("sliding_attention")
    assert shape.sliding_window == ((built.sliding_window or 0) if shape.sliding_layers else 0)
    assert sequence.facts_of_shape(shape).partial_attention == sequence.facts_of_config(built).partial_attention
    assert pipelines.facts_of_shape(shape).partial_attention == pipelines.facts_of_config(built).partial_attention


def _without_layer_types(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict as a config.json that leaves the block layout to its class: no `layer_types`, at any depth."""
    return {k: _without_layer_types(v) if isinstance(v, dict) else v for k, v in d.items() if k != "layer_types"}


def _has(config: Any, key: str) -> bool:
    """Whether `config` sets `key`; a heterogeneous config's per-layer key, which raises when read globally,
    counts."""
    try:
        return hasattr(config, key)
    except RuntimeError:
        return True


def _layered_classes() -> list[str]:
    """Every model_type whose transformers config class, built with its defaults, has a language model's config
    (one with num_hidden_layers) that sets a window, a chunk or layer_types, per-layer configs included."""
    from transformers import CONFIG_MAPPING

    found = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            text = text_of(CONFIG_MAPPING[model_type]())
        except Exception:  # noqa: BLE001 - a class that needs arguments cannot be swept
            continue
        if _has(text, "num_hidden_layers") and any(_has(text, k) for k in ("sliding_window", "attention_chunk_size",
                                                                          "layer_types")):
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", _layered_classes())
def test_every_layered_class_reads_alike_by_the_rule_the_planner_and_the_rank(model_type: str) -> None:
    """For every transformers family with a window, chunk or layer_types: the rule reads its class's defaults
    without raising, every layer type it has is one the rule knows, and its partial blocks are those that do not
    attend over the whole row; a config.json of those defaults that leaves the layout out (as published files do)
    gets from the planner the verdict and the kinds both resolvers reach on the class built from it: no false
    refusal of a full-attention model (dots1, smollm3, Qwen with use_sliding_window off), no split allowed that the
    rank refuses (Qwen without max_window_layers, EXAONE 4's "LLLG" pattern), the same named reason."""
    from transformers import CONFIG_MAPPING

    from shardfit.plan.config_shape import attention_layout

    built = CONFIG_MAPPING[model_type]()
    layout, types = layout_of(built), getattr(text_of(built), "layer_types", None)
    if types is not None:
        assert set(types) <= set(TYPE_KINDS), set(types) - set(TYPE_KINDS)
        assert layout.blocks == sum(TYPE_KINDS[t] != () for t in types) or layout.kinds == ("chunk",)
    file = _without_layer_types(built.to_dict())
    planned = attention_layout(file, "local")
    rebuilt = CONFIG_MAPPING[model_type](**{k: v for k, v in file.items() if k != "model_type"})
    seq, stage = sequence.facts_of_config(rebuilt), pipelines.facts_of_config(rebuilt)
    assert (planned.partial, planned.kinds) == (seq.partial_attention, seq.attention_kinds) == \
        (stage.partial_attention, stage.attention_kinds)
    assert seq.partial_attention == sequence.facts_of_config(built).partial_attention == layout.partial


def test_a_config_its_class_cannot_build_is_a_message_naming_the_class() -> None:
    """EXAONE 4's text pattern without the layer_types its published file lists: transformers' own class cannot lay
    the blocks out (so the model would not load); the planner says so, naming the file's class, not a traceback
    and not a "size that is not a number"."""
    from shardfit.errors import UserError
    from shardfit.plan.config_shape import shape_from_config

    with pytest.raises(UserError, match=r"local: transformers' Exaone4Config cannot be built from this config\.json"):
        shape_from_config({**SMALL, "model_type": "exaone4", "sliding_window": 4096, "sliding_window_pattern": "LLLG"},
                          "local")


def test_a_llama4_config_without_its_chunk_takes_the_class_default() -> None:
    """A Llama 4 text config.json that leaves attention_chunk_size out is built by transformers with 8192-token
    chunks on three blocks of four: the planner reads them so, and refuses what the rank refuses."""
    from transformers import CONFIG_MAPPING

    from shardfit.plan.config_shape import shape_from_config

    cfg = {**SMALL, "model_type": "llama4_text", "num_local_experts": 4}
    shape = shape_from_config(cfg, "local")
    built = CONFIG_MAPPING["llama4_text"](**{k: v for k, v in cfg.items() if k != "model_type"})
    assert (shape.sliding_window, shape.sliding_layers) == (8192, built.layer_types.count("chunked_attention")) == \
        (8192, 9)
    assert sequence.facts_of_config(built).partial_attention and sequence.facts_of_shape(shape).partial_attention
