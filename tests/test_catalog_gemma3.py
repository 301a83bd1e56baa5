"""Gemma 3's catalog entries are the published config.json files: 4b, 12b and 27b-it keep their SigLIP
vision_config, so the planner counts the tower the built model holds and plans them as the multimodal models they
are; 1b-it is text-only."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForConditionalGeneration

from shardfit.plan.shapes import hf_config, resolve_shape

TOWERED = ["google/gemma-3-4b-it", "google/gemma-3-12b-it", "google/gemma-3-27b-it"]
# The text shapes of the published config.json files (layers, hidden, intermediate, heads, kv_heads, head_dim,
# vocab) and the blocks within the 1024-token window (five of every six).
TEXT = {
    "google/gemma-3-4b-it": (34, 2560, 10240, 8, 4, 256, 262208, 29),
    "google/gemma-3-12b-it": (48, 3840, 15360, 16, 8, 256, 262208, 40),
    "google/gemma-3-27b-it": (62, 5376, 21504, 32, 16, 128, 262208, 52),
}


@pytest.mark.parametrize("model", TOWERED)
def test_the_catalogs_vision_weights_are_the_built_towers(model: str) -> None:
    """The weights the plan adds for the vision tower are those of transformers' Gemma 3 tower and projector, built
    on the meta device from the catalog's config, to the parameter."""
    shape = resolve_shape(model)
    with torch.device("meta"):
        built = Gemma3ForConditionalGeneration(hf_config(shape))
    tower = sum(p.numel() for p in built.model.vision_tower.parameters())
    projector = sum(p.numel() for p in built.model.multi_modal_projector.parameters())
    assert shape.extra_params == tower + projector


@pytest.mark.parametrize("model", TOWERED)
def test_the_catalogs_gemma3_is_the_published_multimodal_model(model: str) -> None:
    """The catalog's text shape is the published one, its windows are the built config's, and it plans as a
    soft-token image model (256 tokens per 896-pixel image in 14-pixel patches)."""
    shape = resolve_shape(model)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab,
            shape.sliding_layers) == TEXT[model]
    text = hf_config(shape).text_config
    assert shape.sliding_window == text.sliding_window == 1024
    assert shape.sliding_layers == text.layer_types.count("sliding_attention")
    assert shape.tied and text.query_pre_attn_scalar == (168 if model.endswith("27b-it") else 256)
    assert shape.soft_tower is not None
    assert (shape.soft_tower.tokens, shape.soft_tower.side, shape.soft_tower.patch) == (256, 896, 14)


def test_gemma3_1b_is_text_only() -> None:
    """1b-it has no vision tower: nothing is added for one and it plans no images."""
    shape = resolve_shape("google/gemma-3-1b-it")
    assert shape.extra_params == 0 and shape.soft_tower is None
    assert (shape.sliding_window, shape.sliding_layers) == (512, 22)
