"""The 2026 catalog additions plan offline, and their weight counts are the published models': the total the model
card states, and the count of transformers' own class built on the meta device from the catalog entry, exactly.
Each entry's numbers come from a copy of the model's published config.json cited beside it in catalog.yaml."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardfit.cli.main import main
from shardfit.plan import shapes
from shardfit.plan.shapes import hf_config, resolve_shape

# The model cards' figures, in billions, and the precision they are written to.
CARDS = {
    # huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct: "Number of Parameters: 30.5B in total and 3.3B activated".
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": {"total": 30.5, "active": 3.3},
    # huggingface.co/mistralai/Mistral-Nemo-Base-2407: "a pretrained generative text model of 12B parameters".
    "mistralai/Mistral-Nemo-Base-2407": {"total": 12.0},
    # huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct: "Number of Parameters: 80B in total and 3B activated".
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {"total": 80.0, "active": 3.0},
    # The Qwen2.5-Coder cards: "Number of Parameters: 0.49B" / "3.09B" / "7.61B".
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": {"total": 0.49},
    "Qwen/Qwen2.5-Coder-3B-Instruct": {"total": 3.09},
    "Qwen/Qwen2.5-Coder-7B-Instruct": {"total": 7.61},
    # huggingface.co/01-ai/Yi-1.5-34B: the card names it by size only, "Yi-1.5-34B".
    "01-ai/Yi-1.5-34B": {"total": 34.0},
}
# Twins: releases planned with another entry's shape (catalog `twin`), as their config.json files show.
TWINS = {
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-Coder-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen/Qwen2.5-Coder-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "01-ai/Yi-1.5-34B": "01-ai/Yi-34B",
}
# Cards whose total is written to the billion and is more than 1 % from the count: checked at the card's precision
# only (Mistral-Nemo's "12B" is 12.25B, Yi-1.5-34B's "34B" 34.39B).
ROUNDED = {"mistralai/Mistral-Nemo-Base-2407", "01-ai/Yi-1.5-34B"}
MODELS = list(CARDS)


def _decimals(figure: float) -> int:
    """How many decimals a card's figure is written with (30.5 -> 1, 12.0 -> 0)."""
    return 0 if figure == int(figure) else len(str(figure).split(".")[1])


@pytest.mark.parametrize("model", MODELS)
def test_the_entry_plans_offline_on_eight_h100s(model: str) -> None:
    """`shardfit plan --model ID --gpus 8xH100` finds the id in the bundled catalog and plans it (0: a plan fits;
    3: none fits), with no download and no traceback."""
    assert main(["plan", "--model", model, "--gpus", "8xH100"]) in (0, 3)


@pytest.mark.parametrize("model", MODELS)
def test_the_planned_total_is_the_model_cards(model: str) -> None:
    """The planned weight count is the card's total within 1 %, or (`ROUNDED`) at the precision the card writes it."""
    card = CARDS[model]["total"]
    planned = resolve_shape(model).params() / 1e9
    if model in ROUNDED:
        assert round(planned, _decimals(card)) == card
    else:
        assert abs(planned - card) / card < 0.01


@pytest.mark.parametrize("model", [m for m in MODELS if "active" in CARDS[m]])
def test_the_active_count_is_the_model_cards(model: str) -> None:
    """Qwen's cards count the embedding table among the activated weights and cut the figure to the precision they
    write: the planned active weights (attention or DeltaNet, the routed and shared experts, routers, head) with the
    embedding, truncated, are the card's (Qwen3-Coder-30B-A3B: 3.04B + 0.31B = 3.35B, "3.3B"; Qwen3-Next-80B-A3B:
    3.56B + 0.31B = 3.87B, "3B")."""
    card = CARDS[model]["active"]
    shape = resolve_shape(model)
    with_embedding = (shape.active_params() + shape.vocab * shape.hidden) / 1e9
    scale = 10 ** _decimals(card)
    assert int(with_embedding * scale) == round(card * scale)


@pytest.mark.parametrize("model", MODELS)
def test_the_planned_total_is_transformers_built_model(model: str) -> None:
    """transformers' class of the entry, built on the meta device from the config the catalog gives it, holds
    exactly the planned number of weights."""
    shape = resolve_shape(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(hf_config(shape))
    assert sum(p.numel() for p in built.parameters()) == shape.params()


def test_qwen3_next_is_planned_as_its_cards_hybrid_layout() -> None:
    """Qwen3-Next-80B-A3B's card: "12 * (3 * (Gated DeltaNet -> MoE) -> 1 * (Gated Attention -> MoE))", DeltaNet
    heads 32 for V and 16 for QK of 128: the plan reads 36 DeltaNet blocks of that width and 12 softmax ones."""
    shape = resolve_shape("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert (shape.layers, shape.linear_layers) == (48, 36)
    assert (shape.linear_v_heads, shape.linear_k_heads, shape.linear_k_dim, shape.linear_v_dim) == (32, 16, 128, 128)
    assert (shape.experts, shape.top_k, shape.expert_width, shape.shared_intermediate) == (512, 10, 512, 512)


@pytest.mark.parametrize("model", sorted(TWINS))
def test_a_twin_plans_with_its_twins_shape_under_its_own_name(model: str) -> None:
    """A `twin` entry is the named entry's shape, under the release's own id (and its -Instruct / -Chat / -Base
    releases find it by name as every entry's do)."""
    shape, twin = resolve_shape(model), resolve_shape(TWINS[model])
    assert shape.id == model
    assert dataclasses.replace(shape, id=twin.id) == twin


def test_a_twin_of_a_kept_config_json_builds_from_that_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A twin of an entry that keeps its config.json whole gives that config to the built model as well."""
    entries = {**shapes.catalog(), "example/Coder-A3B": {"twin": "Qwen/Qwen3-30B-A3B"}}
    monkeypatch.setattr(shapes, "catalog", lambda: entries)
    assert shapes.catalog_config("example/Coder-A3B") == shapes.catalog_config("Qwen/Qwen3-30B-A3B")
    assert resolve_shape("example/Coder-A3B").params() == resolve_shape("Qwen/Qwen3-30B-A3B").params()
