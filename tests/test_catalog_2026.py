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
    # Qwen3.5: the cards' "Language Model / Number of Parameters" ("2B" on huggingface.co/Qwen/Qwen3.5-2B, the size in
    # each release's name for the others); the MoE totals and activated counts as transformers' qwen3_5_moe page and
    # the 397B's MLX card give them ("35B total/3B active", "397B", "~17B").
    "Qwen/Qwen3.5-0.8B": {"total": 0.8},
    "Qwen/Qwen3.5-2B": {"total": 2.0},
    "Qwen/Qwen3.5-4B": {"total": 4.0},
    "Qwen/Qwen3.5-9B": {"total": 9.0},
    "Qwen/Qwen3.5-27B": {"total": 27.0},
    "Qwen/Qwen3.5-35B-A3B": {"total": 35.0, "active": 3.0},
    "Qwen/Qwen3.5-122B-A10B": {"total": 122.0},
    "Qwen/Qwen3.5-397B-A17B": {"total": 397.0, "active": 17.0},
    # The Baichuan2 cards and ids name the size class: "Baichuan2-7B", "Baichuan2-13B".
    "baichuan-inc/Baichuan2-7B-Base": {"total": 7.0},
    "baichuan-inc/Baichuan2-13B-Base": {"total": 13.0},
    # huggingface.co/THUDM/chatglm3-6b: "ChatGLM3-6B"; huggingface.co/deepseek-ai/deepseek-llm-7b-base: "7B".
    "THUDM/chatglm3-6b": {"total": 6.0},
    "deepseek-ai/deepseek-llm-7b-base": {"total": 7.0},
}
# Twins: releases planned with another entry's shape (catalog `twin`), as their config.json files show.
TWINS = {
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-Coder-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen/Qwen2.5-Coder-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "01-ai/Yi-1.5-34B": "01-ai/Yi-34B",
    "baichuan-inc/Baichuan2-7B-Chat": "baichuan-inc/Baichuan2-7B-Base",
    "THUDM/chatglm2-6b": "THUDM/chatglm3-6b",
    "deepseek-ai/deepseek-math-7b-base": "deepseek-ai/deepseek-llm-7b-base",
}
# Cards whose total is written to the billion and is more than 1 % from the count: checked at the card's precision
# only (Mistral-Nemo's "12B" is 12.25B, Yi-1.5-34B's "34B" 34.39B; the small Qwen3.5 cards' "0.8B", "2B", "4B" are
# 0.75B, 1.88B and 4.21B; ChatGLM3's "6B" 6.24B; deepseek-llm's "7B" 6.91B).
ROUNDED = {"mistralai/Mistral-Nemo-Base-2407", "01-ai/Yi-1.5-34B", "Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-2B",
           "Qwen/Qwen3.5-4B", "THUDM/chatglm3-6b", "deepseek-ai/deepseek-llm-7b-base"}
# Cards naming a size class, the count cut to the figure's precision: Baichuan2's "7B" is 7.51B and "13B" 13.90B.
FLOORED = {"baichuan-inc/Baichuan2-7B-Base", "baichuan-inc/Baichuan2-13B-Base"}
# Releases loaded through remote code: no transformers class to build, so their counts are checked against a hand
# count from their config.json's keys (HAND_COUNTS) instead.
REMOTE_CODE = {"baichuan-inc/Baichuan2-7B-Base", "baichuan-inc/Baichuan2-13B-Base", "THUDM/chatglm3-6b"}
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
    """The planned weight count is the card's total within 1 %, or (`ROUNDED`) at the precision the card writes it, or
    (`FLOORED`) cut to that precision."""
    card = CARDS[model]["total"]
    planned = resolve_shape(model).params() / 1e9
    if model in ROUNDED:
        assert round(planned, _decimals(card)) == card
    elif model in FLOORED:
        scale = 10 ** _decimals(card)
        assert int(planned * scale) == round(card * scale)
    else:
        assert abs(planned - card) / card < 0.01


@pytest.mark.parametrize("model", [m for m in MODELS if "active" in CARDS[m]])
def test_the_active_count_is_the_model_cards(model: str) -> None:
    """Qwen's cards count the embedding table among the activated weights and cut the figure to the precision they
    write: the planned active weights (attention or DeltaNet, the routed and shared experts, routers, head) with the
    embedding, truncated, are the card's (Qwen3-Coder-30B-A3B: 3.04B + 0.31B = 3.35B, "3.3B"; Qwen3-Next-80B-A3B:
    3.56B + 0.31B = 3.87B, "3B"; Qwen3.5-35B-A3B: 2.95B + 0.51B = 3.45B, "3B"; Qwen3.5-397B-A17B: 16.33B + 1.02B =
    17.35B, "17B"). Qwen3.5-122B-A10B's "10B" is not this sum (9.01B + 0.76B = 9.77B), so it is not checked here."""
    card = CARDS[model]["active"]
    shape = resolve_shape(model)
    with_embedding = (shape.active_params() + shape.vocab * shape.hidden) / 1e9
    scale = 10 ** _decimals(card)
    assert int(with_embedding * scale) == round(card * scale)


@pytest.mark.parametrize("model", [m for m in MODELS if m not in REMOTE_CODE])
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


def _dense_count(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
                 qkv_bias: bool) -> int:
    """A decoder's weights by hand: embedding and an untied head (vocab x hidden each); per block q and o (hidden^2
    each), k and v (hidden x kv_heads x head width each), their biases where the config sets them, a gated MLP (3 x
    hidden x intermediate) and two norms; the final norm."""
    width = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * width + (hidden + 2 * kv_heads * width) * qkv_bias
    return 2 * vocab * hidden + layers * (attention + 3 * hidden * intermediate + 2 * hidden) + hidden


# The remote-code releases counted from their config.json keys (catalog.yaml cites each file): Baichuan2's W_pack is
# q, k and v fused without bias (3 x hidden^2) and its NormHead a vocab x hidden head; ChatGLM3's query_key_value is
# q plus 2 groups of k and v (kv_channels 128) with add_qkv_bias, its dense_h_to_4h gate and up fused (2 x
# ffn_hidden_size), output_layer untied.
HAND_COUNTS = {
    "baichuan-inc/Baichuan2-7B-Base": _dense_count(32, 4096, 11008, 32, 32, 125696, qkv_bias=False),
    "baichuan-inc/Baichuan2-13B-Base": _dense_count(40, 5120, 13696, 40, 40, 125696, qkv_bias=False),
    "THUDM/chatglm3-6b": _dense_count(28, 4096, 13696, 32, 2, 65024, qkv_bias=True),
}


@pytest.mark.parametrize("model", sorted(REMOTE_CODE))
def test_a_remote_code_release_counts_as_its_fused_layout(model: str) -> None:
    """A release transformers cannot build holds, planned, exactly the hand count of its config.json's fused
    projections (Baichuan2-7B: 7,505,973,248; ChatGLM3-6B: 6,243,584,000)."""
    assert resolve_shape(model).params() == HAND_COUNTS[model]


def test_chatglm3_is_planned_and_built_with_its_two_query_groups() -> None:
    """ChatGLM3-6B's multi-query attention keeps 2 key/value groups for 32 heads, with biases on q, k and v only; the
    stand-in `check` and `plan --simulate` build for it (remote code has no class) is Qwen2, whose weights are the
    same to the parameter (Llama's attention_bias would add 28 o_proj biases of 4096)."""
    shape = resolve_shape("THUDM/chatglm3-6b")
    assert (shape.heads, shape.kv_heads, shape.attn_bias) == (32, 2, True)
    config = hf_config(shape)
    assert config.model_type == "qwen2"
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in built.parameters()) == HAND_COUNTS["THUDM/chatglm3-6b"]


def test_qwen3_5_is_planned_as_its_cards_hybrid_layout() -> None:
    """Qwen3.5-397B-A17B's layout as its MLX card (mlx-community/Qwen3.5-397B-A17B-4bit) copies it from the original:
    15 x (3 x Gated DeltaNet + 1 x Full Attention), every block MoE, DeltaNet heads 16 QK / 64 V of 128, 512 experts
    of 1024 with 10 routed and 1 shared: the plan reads 45 DeltaNet blocks of that width and 15 softmax ones, and no
    vision tower (the rank builds the text model only)."""
    shape = resolve_shape("Qwen/Qwen3.5-397B-A17B")
    assert (shape.layers, shape.linear_layers) == (60, 45)
    assert (shape.linear_v_heads, shape.linear_k_heads, shape.linear_k_dim, shape.linear_v_dim) == (64, 16, 128, 128)
    assert (shape.experts, shape.top_k, shape.expert_width, shape.shared_intermediate) == (512, 10, 1024, 1024)
    assert shape.vision is None and shape.extra_params == 0
