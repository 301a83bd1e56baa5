"""The 2026 model families as tiny real models, and the matrix of what the tests prove for each.

Each tiny config is the family's published config (the catalog's own copy, src/shardfit/plan/catalog.yaml) with
its sizes shrunk and its layout kept: routed and shared experts, dense blocks among the mixtures, latent attention,
sliding windows, biases. `MATRIX` lists the (family, method, strategy) cases tests/test_families.py trains and
`MEDIA_MATRIX` those a media family's own tests train; the README's table of supported families is rendered from
both (`table()`), so it claims no more than the tests run.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardfit.plan.shapes import catalog_config
from tests.helpers import save_with_tokenizer

# family -> the catalog id whose published layout it shrinks
FAMILIES = {
    "Qwen3 (dense)": None,
    "Qwen3-MoE": "Qwen/Qwen3-30B-A3B",
    "gpt-oss": "openai/gpt-oss-20b",
    "GLM-4.5": "zai-org/GLM-4.5-Air",
    "DeepSeek-V3": "deepseek-ai/DeepSeek-V3",
    "Llama 4 (text)": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "Gemma 3 (text)": "google/gemma-3-27b-it",
}
# What tests/test_families.py trains (1 process: single; 2 gloo ranks: zero3), each with a check of its loss.
TRAINED = list(FAMILIES)
MATRIX = [(family, method, "single") for family in TRAINED for method in ("lora", "full")] + \
    [(family, "lora", "zero3") for family in ("Qwen3-MoE", "gpt-oss", "DeepSeek-V3", "Llama 4 (text)")] + \
    [(family, "lora", "zero3") for family in ("Qwen3 (dense)", "GLM-4.5", "Gemma 3 (text)")]
# Of the zero3 cases, those make test leaves to make test-all (heavy): the layouts Qwen3-MoE's case already shards
# as one FSDP2 unit a block (a dense block; GLM-4.5's and DeepSeek-V3's mixtures are Qwen3-MoE's plus shared
# experts, DeepSeek-V3's latent attention trained by its single-process cases; Llama 4's and gpt-oss's experts
# are stacks like Qwen3-MoE's fused ones; Gemma 3's windows are gpt-oss's).
HEAVY_ZERO3 = ("Qwen3 (dense)", "GLM-4.5", "Gemma 3 (text)", "gpt-oss", "DeepSeek-V3", "Llama 4 (text)")
# Families trained on media rows by a test file of their own: (family, method, strategy) -> the test that trains
# the case (tests/test_qwen3_omni.py checks that each exists).
OMNI3 = "Qwen3-Omni-MoE (thinker: text, images, audio)"
QWEN3_VL, QWEN3_VL_MOE = "Qwen3-VL (images, video)", "Qwen3-VL-MoE (images, video)"
GLM45V = "GLM-4.5V (images)"
GEMMA3_VL = "Gemma 3 (images)"
MEDIA_MATRIX = {
    (OMNI3, "lora", "single"): "tests/test_qwen3_omni.py::test_a_run_trains_on_image_and_audio_rows",
    (OMNI3, "full", "single"): "tests/test_qwen3_omni.py::test_full_fine_tune_trains_the_thinker",
    (OMNI3, "lora", "zero3"): "tests/test_qwen3_omni.py::test_zero3_rank_without_media_matches_one_process",
    # Qwen3-VL: runs on rows with an image, a video and both (test_vl_families.py runs image rows alone too).
    (QWEN3_VL, "lora", "single"): "tests/test_qwen3_vl_video.py::test_a_run_trains_on_video_rows[qwen3_vl]",
    (QWEN3_VL_MOE, "lora", "single"): "tests/test_qwen3_vl_video.py::test_a_run_trains_on_video_rows[qwen3_vl_moe]",
    (QWEN3_VL_MOE, "lora", "zero3"): "tests/test_qwen3_vl_video.py::test_zero3_rank_without_media_matches_one_process",
    (QWEN3_VL, "lora", "zero3"):
        "tests/test_vl_families.py::test_zero3_matches_one_process_on_the_other_families[qwen3_vl]",
    (GLM45V, "lora", "single"): "tests/test_vl_families.py::test_a_run_trains_on_image_rows[glm4v_moe]",
    (GLM45V, "lora", "zero3"):
        "tests/test_vl_families.py::test_zero3_matches_one_process_on_the_other_families[glm4v_moe]",
    (GEMMA3_VL, "lora", "single"): "tests/test_gemma3_vl.py::test_a_lora_run_trains_on_image_rows",
    (GEMMA3_VL, "lora", "zero3"): "tests/test_gemma3_vl.py::test_zero3_rank_without_image_matches_one_process",
}

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=2)
# Keys each family's size shrinks to, where the published config names them.
SHRINK = dict(moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
              num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, n_group=1, topk_group=1, first_k_dense_replace=1, sliding_window=16)


def tiny_text_config(family: str) -> Any:
    """The family's text model, tiny: its published config with every size shrunk (layout kept)."""
    source = FAMILIES[family]
    if source is None:
        return AutoConfig.for_model("qwen3", **SMALL, tie_word_embeddings=True)
    published = catalog_config(source)
    text = copy.deepcopy(published.get("text_config") or published)
    text.pop("architectures", None)
    model_type = {"llama4": "llama4_text", "gemma3": "gemma3_text"}.get(published["model_type"],
                                                                      text.pop("model_type", published["model_type"]))
    text.pop("model_type", None)
    for key in ("layer_types", "intermediate_size_mlp", "rope_parameters", "rope_scaling", "query_pre_attn_scalar"):
        text.pop(key, None)
    text.update(SMALL)
    text.update({k: v for k, v in SHRINK.items() if k in text})
    if model_type == "llama4_text":
        text.update(intermediate_size=32, intermediate_size_mlp=96, num_experts_per_tok=1)
    if "kv_lora_rank" in text:  # latent attention: every head reads the shared latent
        text.update(num_key_value_heads=SMALL["num_attention_heads"])
        text.pop("head_dim")
    text["tie_word_embeddings"] = bool(published.get("tie_word_embeddings", model_type.startswith("gemma")))
    return AutoConfig.for_model(model_type, **text)


def make_family_model(family: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny model of `family`, saved as an HF folder with the bundled tokenizer."""
    torch.manual_seed(seed)
    return save_with_tokenizer(AutoModelForCausalLM.from_config(tiny_text_config(family)), out, tokenizer_dir)


def table() -> str:
    """The README's table: a family per row, each method x strategy the tests train, and its catalog sizes."""
    combos = [("lora", "single"), ("full", "single"), ("lora", "zero3")]
    head = "| family | catalog ids (plan) | " + " | ".join(f"{m} {s}" for m, s in combos) + " |"
    rows = [head, "|" + "---|" * (len(combos) + 2)]
    ids = {"Qwen3 (dense)": "Qwen/Qwen3-0.6B ... 32B", "Qwen3-MoE": "Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B",
           "gpt-oss": "openai/gpt-oss-20b, openai/gpt-oss-120b", "GLM-4.5": "zai-org/GLM-4.5-Air, zai-org/GLM-4.5",
           "DeepSeek-V3": "deepseek-ai/DeepSeek-V3", "Llama 4 (text)": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
           "Gemma 3 (text)": "google/gemma-3-27b-it", OMNI3: "Qwen/Qwen3-Omni-30B-A3B-Instruct",
           QWEN3_VL: "Qwen/Qwen3-VL-8B-Instruct", QWEN3_VL_MOE: "Qwen/Qwen3-VL-30B-A3B-Instruct, ...-235B-A22B",
           GLM45V: "zai-org/GLM-4.5V", GEMMA3_VL: "google/gemma-3-4b-it ... 27b-it"}
    for family in [*FAMILIES, *dict.fromkeys(f for f, _, _ in MEDIA_MATRIX)]:
        marks = ["tested" if (family, m, s) in MATRIX or (family, m, s) in MEDIA_MATRIX else "-" for m, s in combos]
        rows.append(f"| {family} | {ids[family]} | " + " | ".join(marks) + " |")
    return "\n".join(rows)
