"""The 2026 catalog additions plan offline, and their weight counts are the published models': the total the model
card states, and the count of transformers' own class built on the meta device from the catalog entry, exactly.
Each entry's numbers come from a copy of the model's published config.json cited beside it in catalog.yaml."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardfit.cli.main import main
from shardfit.plan.shapes import hf_config, resolve_shape

# The model cards' figures, in billions, and the precision they are written to.
CARDS = {
    # huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct: "Number of Parameters: 30.5B in total and 3.3B activated".
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": {"total": 30.5, "active": 3.3},
    # huggingface.co/mistralai/Mistral-Nemo-Base-2407: "a pretrained generative text model of 12B parameters".
    "mistralai/Mistral-Nemo-Base-2407": {"total": 12.0},
}
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
    """The planned weight count is the card's total: within 1 %, and equal at the precision the card writes it
    (Mistral-Nemo's "12B" is 12.25B, which the card rounds to the billion)."""
    card = CARDS[model]["total"]
    planned = resolve_shape(model).params() / 1e9
    assert round(planned, _decimals(card)) == card
    if _decimals(card):
        assert abs(planned - card) / card < 0.01


def test_the_active_count_is_the_model_cards() -> None:
    """Qwen3-Coder-30B-A3B's card counts 3.3B activated: the planned active weights (attention, eight of 128
    experts, router, head: 3.04B) with the embedding table Qwen counts as activated (0.31B), written to the card's
    one decimal (3.35B, which the card truncates)."""
    shape = resolve_shape("Qwen/Qwen3-Coder-30B-A3B-Instruct")
    with_embedding = shape.active_params() + shape.vocab * shape.hidden
    assert int(with_embedding / 1e8) == round(CARDS["Qwen/Qwen3-Coder-30B-A3B-Instruct"]["active"] * 10)


@pytest.mark.parametrize("model", MODELS)
def test_the_planned_total_is_transformers_built_model(model: str) -> None:
    """transformers' class of the entry, built on the meta device from the config the catalog gives it, holds
    exactly the planned number of weights."""
    shape = resolve_shape(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(hf_config(shape))
    assert sum(p.numel() for p in built.parameters()) == shape.params()
