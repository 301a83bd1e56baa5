"""Tiny vision-language models of the 2026 families (Qwen3-VL dense and MoE, GLM-4.5V), saved as HF folders a user's run
would read: the bundled tokenizer with the vision tokens added, and a small-image processor built from the image
processor alone (AutoProcessor would also build a video processor, which needs torchvision)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Glm4vImageProcessorPil,
    Glm4vMoeConfig,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

from tests.helpers import VL_TOKENS

# The sizes of the tests' other tiny models; Qwen3-VL's 16-pixel patches, 2x2 merge and deepstack from two blocks.
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, pad_token_id=2, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
           router_aux_loss_coef=0.01)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
CONFIGS = {"qwen3_vl": (Qwen3VLConfig, {}), "qwen3_vl_moe": (Qwen3VLMoeConfig, MOE)}


def make_tiny_qwen3_vl(out: Path, tokenizer_dir: Path, arch: str = "qwen3_vl", seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen3-VL (`qwen3_vl`) or Qwen3-VL-MoE (`qwen3_vl_moe`): images up to 128x128
    pixels (at most 16 image tokens)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(VL_TOKENS)})
    start, end, image, video = tok.convert_tokens_to_ids(list(VL_TOKENS))
    cls, extra = CONFIGS[arch]
    config = cls(text_config=dict(TEXT, vocab_size=len(tok), **extra), vision_config=VISION, image_token_id=image,
                 video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=128 * 128).save_pretrained(out)
    return out


GLM_TOKENS = ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>")
# GLM-4.5V's layout shrunk: shared and routed experts after a dense first block, half-rotary M-RoPE, biases.
GLM_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=2, bos_token_id=1,
                eos_token_id=2, partial_rotary_factor=0.5, attention_bias=True, moe_intermediate_size=32,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
GLM_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, image_size=56)


def make_tiny_glm4v_moe(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny GLM-4.5V (`glm4v_moe`): GLM's image markers added to the tokenizer, images up to
    112x112 pixels (at most 16 image tokens)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(GLM_TOKENS)})
    start, end, image, video = tok.convert_tokens_to_ids(list(GLM_TOKENS))
    config = Glm4vMoeConfig(text_config=dict(GLM_TEXT, vocab_size=len(tok)), vision_config=GLM_VISION,
                            image_token_id=image, video_token_id=video, image_start_token_id=start,
                            image_end_token_id=end)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    Glm4vImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112}).save_pretrained(out)
    return out


def make_tiny_vl_family(out: Path, tokenizer_dir: Path, arch: str) -> Path:
    """The tiny model of model type `arch` (qwen3_vl, qwen3_vl_moe, glm4v_moe)."""
    if arch == "glm4v_moe":
        return make_tiny_glm4v_moe(out, tokenizer_dir)
    return make_tiny_qwen3_vl(out, tokenizer_dir, arch)
