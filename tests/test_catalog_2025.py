"""The 2025-26 fine-tuning targets added to the catalog plan offline on one H100 (exit 0 or 3, never 2: the id is
found), and where a model card, a release note or the published weights state a total, the planned count is it: the
published safetensors counts exactly, the cards' figures within 2 % or, where a card names only its size class, at
the precision it writes it. Each entry's numbers come from copies of the published config.json cited beside it in
catalog.yaml."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.plan.shapes import resolve_shape

# The weights a published copy of the checkpoint holds (catalog.yaml cites each copy): the hub's API record of
# DeepSeek-R1-Distill-Qwen-32B and -Llama-8B ("safetensors": {"total": ...}) and Mistral-Small-24B-Instruct-2501's
# model.safetensors.index.json (total_size 47,144,806,400 bytes of bf16, two bytes a weight).
PUBLISHED_COUNTS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": 32_763_876_352,
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 8_030_261_248,
    "mistralai/Mistral-Small-24B-Instruct-2501": 47_144_806_400 // 2,
}
# Totals the cards and release notes state, in billions, checked within 2 %.
CARDS = {
    # huggingface.co/mistralai/Mistral-Small-24B-Instruct-2501 (its README copied into OpenMOSE/RWKV-LM-RLHF):
    # "boasting 24B parameters".
    "mistralai/Mistral-Small-24B-Instruct-2501": 24.0,
    # Meta's Llama 4 release notes, as quoted in public summaries: "Llama 4 Maverick: 17B active parameters, 128
    # experts, 400B total".
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": 400.0,
}
# Cards that name the size class only, checked at the precision they write it: SmolLM3's "a 3B parameter language
# model" (3.08B), Kimi K2's "1 trillion total parameters" / "Total Parameters 1T" (1.03T; the card's table also gives
# 61 layers, 384 experts of 2048, 8 selected and 1 shared, 64 heads, as the entry has them), Mistral 7B's
# "7-billion-parameter" (7.24B for v0.2, 7.25B for v0.3's larger vocabulary).
# Each as (figure, unit): 3 x 1e9 is "3B", 1 x 1e12 "1T".
SIZE_CLASSES = {
    "HuggingFaceTB/SmolLM3-3B": (3, 1e9),
    "moonshotai/Kimi-K2-Instruct": (1, 1e12),
    "mistralai/Mistral-7B-Instruct-v0.2": (7, 1e9),
    "mistralai/Mistral-7B-Instruct-v0.3": (7, 1e9),
}
# Releases whose config.json has an existing entry's shape (catalog `twin`).
TWINS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "Qwen/Qwen2.5-7B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": "Qwen/Qwen2.5-14B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": "Qwen/Qwen2.5-32B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "meta-llama/Llama-3.1-8B",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": "meta-llama/Llama-3.3-70B-Instruct",
}
MODELS = sorted({"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", *PUBLISHED_COUNTS, *CARDS, *SIZE_CLASSES, *TWINS})


@pytest.mark.parametrize("model", MODELS)
def test_the_entry_plans_offline_on_one_h100(model: str, capsys: pytest.CaptureFixture) -> None:
    """`shardfit plan --model ID --gpus 1xH100 --json` finds the id in the bundled catalog (0: a plan fits; 3: none
    fits on one card, as for the 400B and 1T mixtures), with no download and no traceback."""
    assert main(["plan", "--model", model, "--gpus", "1xH100", "--json"]) in (0, 3)
    assert "not in the bundled catalog" not in capsys.readouterr().err


@pytest.mark.parametrize("model", sorted(PUBLISHED_COUNTS))
def test_the_planned_count_is_the_published_checkpoints(model: str) -> None:
    assert resolve_shape(model).params() == PUBLISHED_COUNTS[model]


@pytest.mark.parametrize("model", sorted(CARDS))
def test_the_planned_total_is_within_two_percent_of_the_card(model: str) -> None:
    planned = resolve_shape(model).params() / 1e9
    assert abs(planned - CARDS[model]) / CARDS[model] < 0.02


@pytest.mark.parametrize("model", sorted(SIZE_CLASSES))
def test_the_planned_total_rounds_to_the_cards_size_class(model: str) -> None:
    figure, unit = SIZE_CLASSES[model]
    assert round(resolve_shape(model).params() / unit) == figure


@pytest.mark.parametrize("model", sorted(TWINS))
def test_a_distill_twin_is_its_base_models_shape(model: str) -> None:
    """Each R1 distill keeps its base model's shape under its own id (and family: Qwen2 or Llama)."""
    shape, twin = resolve_shape(model), resolve_shape(TWINS[model])
    assert shape.id == model
    assert dataclasses.replace(shape, id=twin.id) == twin


def test_the_qwen_1_5b_distill_keeps_qwen2_5_maths_untied_head() -> None:
    """DeepSeek-R1-Distill-Qwen-1.5B's config.json says tie_word_embeddings false (Qwen2.5-Math-1.5B's), unlike
    Qwen2.5-1.5B-Instruct: one more 151936 x 1536 head than that twin would plan."""
    distill, instruct = resolve_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"), \
        resolve_shape("Qwen/Qwen2.5-1.5B-Instruct")
    assert (distill.tied, instruct.tied) == (False, True)
    assert distill.params() - instruct.params() == 151936 * 1536


@pytest.mark.parametrize("model", ["mistralai/Mistral-7B-Instruct-v0.2", "mistralai/Mistral-7B-Instruct-v0.3",
                                   "mistralai/Mistral-Small-24B-Instruct-2501", "HuggingFaceTB/SmolLM3-3B"])
def test_windowless_releases_attend_over_the_whole_row(model: str) -> None:
    """Mistral v0.2 dropped v0.1's 4096-token window (and v0.3 and Small 3 have none either); SmolLM3 has none: the
    plan reads full attention on every block, not MistralConfig's default window."""
    shape = resolve_shape(model)
    assert (shape.sliding_window, shape.sliding_layers) == (0, 0)


def test_maverick_alternates_dense_and_expert_blocks() -> None:
    """Maverick's interleave_moe_layer_step 2: 24 of its 48 blocks are mixtures of 128 experts (top 1 and a shared
    one), the others dense of 16384, with Scout's 8192-token chunks on three blocks of four."""
    shape = resolve_shape("meta-llama/Llama-4-Maverick-17B-128E-Instruct")
    assert (shape.layers, shape.experts, shape.top_k) == (48, 128, 1)
    assert (shape.sliding_window, shape.sliding_layers) == (8192, 36)
