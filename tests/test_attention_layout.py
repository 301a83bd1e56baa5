"""The one attention-layout rule (plan/attention_layout.py) that the planner and the rank read a model by: per-layer
configs read block by block or refused with a message, never a traceback; hybrid models refused for what they have
(recurrent layers), not for sliding windows."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import CONFIG_MAPPING, LlamaConfig, MistralConfig, configuration_utils

from shardfit.errors import UserError
from shardfit.plan import attention_layout as rule
from shardfit.plan.config_shape import attention_layout, shape_from_config
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve import sequence

SMALL = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def _refusals(config: Any) -> list[str]:
    """The sequence-parallel and pipeline refusals of the built `config` (2 ranks, 2 stages) for its attention: its
    other refusals (experts, towers, latent attention), which the rules check first, set aside."""
    seq = dataclasses.replace(sequence.facts_of_config(config), multimodal=False, latent_attention=False)
    stage = dataclasses.replace(pipelines.facts_of_config(config), experts=False, multimodal=False)
    out = []
    for check in (lambda: sequence.check_model(2, seq, "m"), lambda: pipelines.check_model(2, stage, "m", "lora")):
        with pytest.raises(UserError) as e:
            check()
        out.append(str(e.value))
    return out


def test_every_layer_type_transformers_names_has_a_kind() -> None:
    """Each `layer_types` name this transformers allows, and each legacy name it remaps, says what its blocks do:
    a name the table lacks would read as unread (refused), so a new one shows up here first."""
    names = set(configuration_utils.ALLOWED_LAYER_TYPES) | set(configuration_utils._LEGACY_LAYER_TYPE_REMAP)
    assert names - set(rule.TYPE_KINDS) == set()
    assert set(configuration_utils._LEGACY_LAYER_TYPE_REMAP.values()) <= set(configuration_utils.ALLOWED_LAYER_TYPES)


# transformers' heterogeneous configs (per_layer_config): their global per-layer attributes raise when read.
PER_LAYER = [
    # NeoMME: windows of 256 or 1024 by block, every sixth block global.
    ("neomme", ("window",), 1024),
    # EmbeddingGemma 2: key/value heads and head widths per block, every sixth block global.
    ("embedding_gemma2", ("window",), 512),
    # dots3_note: heads per block, indexed (DSA) blocks between sliding ones.
    ("dots3_note", ("window", "sparse"), 512),
]


@pytest.mark.parametrize("model_type,kinds,span", PER_LAYER)
def test_per_layer_configs_read_block_by_block(model_type: str, kinds: tuple[str, ...], span: int) -> None:
    """Both resolvers read a per-layer config without raising: the blocks its layer_types say are partial, the
    largest window its blocks set, heads that every block's count divides by; the planner reads its config.json
    alike."""
    built = CONFIG_MAPPING[model_type]()
    text = rule.text_of(built)
    types = text.layer_types
    facts = sequence.facts_of_config(built)
    assert (facts.partial_attention, facts.attention_kinds) == (True, kinds)
    assert pipelines.facts_of_config(built).attention_kinds == kinds
    assert rule.layout_of(built) == rule.AttentionLayout(span, sum(t != "full_attention" for t in types), kinds)
    heads = {block.num_attention_heads for block in text.per_layer_config}
    assert all(h % facts.heads == 0 for h in heads) and facts.heads in heads
    assert attention_layout(built.to_dict(), model_type) == rule.layout_of(built)
    assert all("sliding-window attention layers" in message for message in _refusals(built))


def test_a_window_set_per_block_is_read_per_block() -> None:
    """A Mistral config.json whose per_layer_config turns the window off on two blocks of four: the other two
    slide (the largest window is the span), on the rank and in the planner alike."""
    file = {**SMALL, "model_type": "mistral", "sliding_window": 4096,
            "per_layer_config": {"0": {"sliding_window": None}, "2": {"sliding_window": None},
                                 "3": {"sliding_window": 1024}}}
    built = MistralConfig(**{k: v for k, v in file.items() if k != "model_type"})
    assert rule.layout_of(built) == rule.AttentionLayout(4096, 2, ("window",))
    shape = shape_from_config(file, "local")
    assert (shape.sliding_window, shape.sliding_layers, shape.attention_kinds) == (4096, 2, ("window",))
    off = MistralConfig(**{**SMALL, "sliding_window": None, "per_layer_config": {"1": {"sliding_window": 512}}})
    assert rule.layout_of(off) == rule.AttentionLayout(512, 1, ("window",))


def test_a_window_no_row_can_fill_never_slides() -> None:
    """Phi-3.5-mini and Phi-3 128k publish sliding_window 262144 over 131072 positions: no row the model takes
    reaches past the window, so it attends over the whole row and splits, on the rank and in the planner alike;
    Phi-3 4k's 2047 over 4096 slides."""
    file = {**SMALL, "model_type": "phi3", "sliding_window": 262144, "max_position_embeddings": 131072}
    built = CONFIG_MAPPING["phi3"](**{k: v for k, v in file.items() if k != "model_type"})
    assert not rule.layout_of(built).partial
    sequence.check_model(2, sequence.facts_of_config(built), "phi3")
    assert shape_from_config(file, "local").sliding_layers == 0
    short = {**file, "sliding_window": 2047, "max_position_embeddings": 4096}
    assert rule.layout_of(CONFIG_MAPPING["phi3"](**{k: v for k, v in short.items() if k != "model_type"})) == \
        rule.AttentionLayout(2047, 4, ("window",))
    assert shape_from_config(short, "local").sliding_layers == 4


def test_per_block_key_value_heads_leave_a_full_attention_model_split() -> None:
    """A Llama whose key/value heads differ by block attends over the whole row: it splits, and its heads are read
    from its blocks (the global key raises)."""
    built = LlamaConfig(**{**SMALL, "num_attention_heads": 8, "per_layer_config": {"1": {"num_key_value_heads": 1}}})
    facts = sequence.facts_of_config(built)
    assert (facts.heads, facts.kv_heads, facts.partial_attention) == (8, 1, False)
    sequence.check_model(2, facts, "llama")
    pipelines.check_model(2, pipelines.facts_of_config(built), "llama", "lora")


def test_a_config_json_whose_class_reads_a_per_block_key_globally_is_a_message() -> None:
    """transformers' LlamaConfig checks hidden_size against one global head count, which a per_layer_config of
    heads makes raise: the planner names the class and the file, not a traceback."""
    with pytest.raises(UserError, match=r"local: transformers' LlamaConfig cannot be built"):
        shape_from_config({**SMALL, "model_type": "llama", "per_layer_config": {"1": {"num_attention_heads": 2}}},
                          "local")


@pytest.mark.parametrize("odd", [
    dict(sliding_window="4k"),
    dict(sliding_window=True),
    dict(sliding_window=[512, None]),  # two windows for four blocks
    dict(attention_chunk_size=2.5),
    dict(layer_types=["full_attention", "mystery_attention", "full_attention", "full_attention"]),
    dict(layer_types="full_attention"),
])
def test_unusual_settings_are_refused_as_unread_with_a_message(odd: dict[str, Any]) -> None:
    """A window, chunk or layer_types the rule cannot read is partial (the split is refused) and the message says
    the layout could not be read, on both rules."""
    config = SimpleNamespace(**{**SMALL, **odd})
    layout = rule.layout_of(config)
    assert layout.kinds == ("unread",) and layout.partial and layout.span == 1
    assert all("cannot read from its config" in message for message in _refusals(config))


def test_a_list_of_one_window_per_block_is_read_and_layer_types_decide_first() -> None:
    """One window per block reads per block; a window that blocks' layer_types never use is not read at all."""
    config = SimpleNamespace(**SMALL, sliding_window=[None, 512, 0, 1024])
    assert rule.layout_of(config) == rule.AttentionLayout(1024, 2, ("window",))
    full = SimpleNamespace(**SMALL, sliding_window="4k", layer_types=["full_attention"] * 4)
    assert rule.layout_of(full) == rule.AttentionLayout()


# Families whose blocks are (or hold) linear-attention, Mamba-style or convolutional recurrences in this
# transformers, some beside sliding windows or indexed attention.
HYBRID = {
    "nemotron_h": ("recurrent",), "minimax": ("recurrent",), "qwen3_next": ("recurrent",), "jamba": ("recurrent",),
    "bamba": ("recurrent",), "falcon_h1": ("recurrent",), "granitemoehybrid": ("recurrent",),
    "kimi_linear": ("recurrent",), "olmo_hybrid": ("recurrent",), "qwen3_5": ("recurrent",), "zamba": ("recurrent",),
    "zamba2": ("recurrent",), "mamba": ("recurrent",), "mamba2": ("recurrent",), "falcon_mamba": ("recurrent",),
    "rwkv": ("recurrent",), "xlstm": ("recurrent",), "recurrent_gemma": ("window", "recurrent"),
    "lfm3": ("window", "recurrent"), "glm5_next": ("recurrent", "sparse"),
}


@pytest.mark.parametrize("model_type", sorted(HYBRID))
def test_hybrid_models_are_refused_for_their_recurrent_layers(model_type: str) -> None:
    """Sequence and pipeline splits stay refused for hybrid models, with a message that names their recurrent
    layers (and their windows only where they have them)."""
    built = CONFIG_MAPPING[model_type]()
    assert sequence.facts_of_config(built).attention_kinds == HYBRID[model_type]
    for message in _refusals(built):
        assert "recurrent layers (linear attention, Mamba-style state spaces" in message
        assert ("sliding-window" in message) == ("window" in HYBRID[model_type])


def test_the_planner_names_a_hybrid_models_layers_too() -> None:
    """Qwen3-Next planned from its config.json: the shape carries the kind, so the planner's refusal is the
    rank's."""
    built = CONFIG_MAPPING["qwen3_next"]()
    shape = shape_from_config(built.to_dict(), "local")
    assert shape.attention_kinds == ("recurrent",) and shape.sliding_layers == built.layer_types.count(
        "linear_attention")
    with pytest.raises(UserError, match=r"has recurrent layers \(linear attention"):
        sequence.check_model(2, sequence.facts_of_shape(shape), "local")
    with pytest.raises(UserError, match=r"has recurrent layers \(linear attention"):
        pipelines.check_model(2, dataclasses.replace(pipelines.facts_of_shape(shape), experts=False), "local", "lora")


def test_a_model_type_transformers_cannot_build_is_read_by_its_stated_layer_types_only() -> None:
    """A config.json of a model_type this transformers does not know: its layer_types are read by the rule (a
    recurrent block named as such), and a bare window with no class to place it reads as full attention."""
    file = {**SMALL, "model_type": "not_a_transformers_type", "sliding_window": 512}
    assert attention_layout({**file, "layer_types": ["linear_attention", "full_attention"] * 2}, "local") == \
        rule.AttentionLayout(1, 2, ("recurrent",))
    assert attention_layout({**file, "layer_types": None}, "local") == rule.AttentionLayout()
