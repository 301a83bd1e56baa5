"""The catalog's attention windows and chunks are the published models': the planner's sequence-parallel and
pipeline rules read them from the catalog before anything is built, the rank reads them from the built model's
config, and the two must refuse the same layouts."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

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
