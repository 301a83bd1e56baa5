"""The config the rank builds its model from, read without torch: which part of a config.json the loaded class's
config is, and the rules both the planner and the rank read from it (the tied head, distinct block-head counts).

The rank loads `models/build.py model_class(config)`: AutoModelForCausalLM where the config's class is in its
mapping, else the file's architectures. For most composite configs that class keeps the towers and reads the whole
config. A few composites are in AutoModelForCausalLM's mapping under a text-only `*ForCausalLM`, which transformers
builds from the config's text_config alone: no tower is loaded, and the head is tied by text_config's setting. The
planner must read those the same way, or it refuses parallelism for a tower the rank never holds.
tests/test_loaded_config.py builds model_class's model on the meta device for every such type this transformers
knows and checks the table below against the loaded model's config.
"""

from __future__ import annotations

from typing import Any

from shardfit.plan.attention_layout import block_counts, text_of

# Composite model_types whose class in AutoModelForCausalLM's mapping is text-only (MllamaForCausalLM,
# Llama4ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Dots3NoteForCausalLM, Qwen4ExpForCausalLM):
# the rank trains their
# language model from text_config, without the tower the file describes.
TEXT_ONLY_CAUSAL_TYPES = ("mllama", "llama4", "qwen3_5", "qwen3_5_moe", "dots3_note", "qwen4_exp")

# Loaded configs (their model_type) whose class has no tied weights: MllamaForCausalLM and NemotronHForCausalLM
# (its `_tied_weights_keys` is empty) build their head apart from the embedding whatever tie_word_embeddings says.
NEVER_TIED_TYPES = ("mllama_text_model", "nemotron_h")


def loads_text_only(model_type: Any) -> bool:
    """Whether the rank loads a config of `model_type` as its text model only (TEXT_ONLY_CAUSAL_TYPES)."""
    return model_type in TEXT_ONLY_CAUSAL_TYPES


def rank_config(built: Any) -> Any:
    """The config of the model the rank builds from `built` (transformers' config class of a config.json): its
    text config where the rank loads the text model only, else `built` whole."""
    if loads_text_only(getattr(built, "model_type", None)):
        return built.get_text_config()
    return built


def tied_of_config(config: Any) -> bool:
    """Whether the model built from `config` (the loaded model's config, `rank_config`) ties its head to its
    embedding: the config's own setting, which transformers ties a multimodal model by whatever its text_config
    says; a config without one (some composites) defers to its text model's. NEVER_TIED_TYPES: never."""
    if getattr(config, "model_type", None) in NEVER_TIED_TYPES:
        return False
    return bool(getattr(config, "tie_word_embeddings", getattr(text_of(config), "tie_word_embeddings", False)))


def distinct_block_heads(config: Any) -> tuple[int, ...]:
    """The attention heads of a per-layer config's blocks where they differ, largest first; () where every block has
    the same count. `config`: a built config whose language model is read (`text_of`)."""
    counts = sorted(set(block_counts(text_of(config), "num_attention_heads")), reverse=True)
    return tuple(counts) if len(counts) > 1 else ()
