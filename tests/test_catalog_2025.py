"""The 2025-26 fine-tuning targets added to the catalog plan offline on one H100 (exit 0 or 3, never 2: the id is
found), and where a model card, a release note or the published weights state a total, the planned count is it: the
published safetensors counts exactly, the cards' figures within 2 % or, where a card names only its size class, at
the precision it writes it. Each entry's numbers come from copies of the published config.json cited beside it in
catalog.yaml."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.plan.shapes import catalog, resolve_shape

# The weights a published copy of the checkpoint holds (catalog.yaml cites each copy): the hub's API record of
# DeepSeek-R1-Distill-Qwen-32B and -Llama-8B ("safetensors": {"total": ...}) and Mistral-Small-24B-Instruct-2501's
# model.safetensors.index.json (total_size 47,144,806,400 bytes of bf16, two bytes a weight).
PUBLISHED_COUNTS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": 32_763_876_352,
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 8_030_261_248,
    "mistralai/Mistral-Small-24B-Instruct-2501": 47_144_806_400 // 2,
    # A public parameter table beside the Granite 3.x configs ("granite-3-8b": 8_170_864_640, "same arch as
    # granite-3.3-8b"; catalog.yaml cites the config.json copy).
    "ibm-granite/granite-3.3-8b-instruct": 8_170_864_640,
}
# Totals the cards and release notes state, in billions, checked within 2 %.
CARDS = {
    # huggingface.co/mistralai/Mistral-Small-24B-Instruct-2501 (its README copied into OpenMOSE/RWKV-LM-RLHF):
    # "boasting 24B parameters".
    "mistralai/Mistral-Small-24B-Instruct-2501": 24.0,
    # Meta's Llama 4 release notes, as quoted in public summaries: "Llama 4 Maverick: 17B active parameters, 128
    # experts, 400B total".
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": 400.0,
    # The hub's metadata for microsoft/phi-4 as an index page shows it ("Parameters 14.66", ai-nexus model page).
    "microsoft/phi-4": 14.66,
    # ollama's listing of deepseek-v3.1:671b (its GGUF weights: "parameter_size": "671.0B").
    "deepseek-ai/DeepSeek-V3.1": 671.0,
    # xorbitsai/inference's GLM-4.6 page: "Model Size (in billions): 355".
    "zai-org/GLM-4.6": 355.0,
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
    # Phi-4-mini-instruct's card: "the 3.8B parameters Phi-4-mini-instruct model" (3.84B).
    "microsoft/Phi-4-mini-instruct": (38, 1e8),
    # Gemma 3 270M (0.268B, tied: an untied head would make it 0.436B).
    "google/gemma-3-270m": (27, 1e7),
    # Qwen3-VL-2B and -4B, towers included (2.15B, 4.45B).
    "Qwen/Qwen3-VL-2B-Instruct": (2, 1e9),
    "Qwen/Qwen3-VL-4B-Instruct": (4, 1e9),
    # "OLMo 2 7B" (7.30B), Granite 3.3 "8B" (8.17B).
    "allenai/OLMo-2-1124-7B": (7, 1e9),
    "ibm-granite/granite-3.3-8b-instruct": (8, 1e9),
}
# Releases whose config.json has an existing entry's shape (catalog `twin`).
TWINS = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "Qwen/Qwen2.5-7B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": "Qwen/Qwen2.5-14B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": "Qwen/Qwen2.5-32B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "meta-llama/Llama-3.1-8B",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": "meta-llama/Llama-3.3-70B-Instruct",
    # DeepSeek-R1 and V3.1 keep V3's layout, GLM-4.6 GLM-4.5's (only their contexts differ).
    "deepseek-ai/DeepSeek-R1": "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-V3.1": "deepseek-ai/DeepSeek-V3",
    "zai-org/GLM-4.6": "zai-org/GLM-4.5",
}
# Ids the catalog reaches through name variants of an entry it holds, not entries of their own: Qwen3-4B-Thinking-2507
# is Qwen3-4B retrained (AI-Hypercomputer/maxtext configs/models/qwen3-4b-thinking-2507.yml has qwen3-4b.yml's shape),
# gemma-3-270m-it is the 270m's instruction tune.
VARIANTS = {
    "Qwen/Qwen3-4B-Thinking-2507": "Qwen/Qwen3-4B",
    "google/gemma-3-270m-it": "google/gemma-3-270m",
}
MODELS = sorted({"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "Qwen/Qwen3-VL-32B-Instruct", *PUBLISHED_COUNTS, *CARDS,
                 *SIZE_CLASSES, *TWINS, *VARIANTS})


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
def test_a_twin_is_its_base_models_shape(model: str) -> None:
    """Each R1 distill keeps its base model's shape under its own id (and family: Qwen2 or Llama); R1 and V3.1 are
    V3's, GLM-4.6 is GLM-4.5's."""
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


@pytest.mark.parametrize("model", sorted(VARIANTS))
def test_a_name_variant_plans_as_the_entry_it_names(model: str) -> None:
    """The variant is no catalog entry of its own (no duplicate to drift) yet plans with its base's shape."""
    assert model not in catalog()
    shape, base = resolve_shape(model), resolve_shape(VARIANTS[model])
    assert dataclasses.replace(shape, id=base.id) == base


def test_qwen3_vl_32b_is_qwen3_32b_with_the_8b_tower() -> None:
    """Qwen3-VL-32B's text model is Qwen3-32B's (untied), its tower the 8B's 27 blocks of 1152 (out 5120 instead of
    4096): the planned total less the tower is Qwen3-32B's count."""
    vl, text = resolve_shape("Qwen/Qwen3-VL-32B-Instruct"), resolve_shape("Qwen/Qwen3-32B")
    assert vl.params() - vl.extra_params == text.params()
    assert vl.tied is False


@pytest.mark.parametrize("model", ["microsoft/phi-4", "microsoft/Phi-4-mini-instruct"])
def test_phi_4_has_no_window(model: str) -> None:
    """Phi-4's config.json files say sliding_window null, unlike Phi-3 4k's 2047: full attention on every block."""
    shape = resolve_shape(model)
    assert (shape.sliding_window, shape.sliding_layers) == (0, 0)


def test_gemma_3_270m_keeps_one_global_block_in_six() -> None:
    """The 270m's layer_types: blocks 6, 12 and 18 global, the 15 others within 512 tokens."""
    shape = resolve_shape("google/gemma-3-270m")
    assert (shape.layers, shape.sliding_window, shape.sliding_layers) == (18, 512, 15)
