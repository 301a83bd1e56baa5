"""A tiny Qwen3-Omni-MoE, shrunk from the published config the catalog keeps (src/shardfit/plan/catalog.yaml): the
thinker's MoE text model (interleaved M-RoPE), its Qwen3-VL-style vision tower with deepstack mergers and its
chunked audio tower, plus a small talker and code2wav, so that a folder holds what a real checkpoint holds and the
run has to drop the speech side. Saved as a user's run would read it: the bundled tokenizer with Qwen3-Omni's media
tokens added, and one preprocessor_config.json with a small-image processor (16-pixel patches) and a Whisper feature
extractor (AutoProcessor would also build a video processor, which needs torchvision)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeForConditionalGeneration,
    WhisperFeatureExtractor,
)

from shardfit.plan.shapes import catalog_config

SOURCE = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
# Qwen3-Omni's own token strings; the ids the config names are the ones the tokenizer gives them.
TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>",
          "<|audio_pad|>")
TEXT = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
            pad_token_id=2, bos_token_id=1, eos_token_id=2, router_aux_loss_coef=0.01,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
AUDIO = dict(encoder_layers=1, d_model=32, encoder_ffn_dim=64, encoder_attention_heads=2, output_dim=32,
             downsample_hidden_size=8)
# The speech side, shrunk only so that it is cheap to save: training never builds it.
TALKER = dict(text_config=dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2,
                               num_experts_per_tok=1, shared_expert_intermediate_size=16, vocab_size=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
              code_predictor_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64,
                                         num_code_groups=2),
              num_code_groups=2, thinker_hidden_size=32, accept_hidden_layer=1, spatial_merge_size=2)
CODE2WAV = dict(codebook_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                num_hidden_layers=1, num_quantizers=2, upsample_rates=[2, 2], upsampling_ratios=[2],
                decoder_dim=16, sliding_window=8)


def tiny_qwen3_omni_config(vocab_size: int, ids: dict[str, int]) -> object:
    """The published Qwen3-Omni-MoE config with every size shrunk (layout kept) and the media token ids `ids`."""
    published = catalog_config(SOURCE)
    thinker = copy.deepcopy(published["thinker_config"])
    thinker["text_config"].update(TEXT, vocab_size=vocab_size)
    thinker["vision_config"].update(VISION)
    thinker["audio_config"].update(AUDIO)
    thinker.update(ids, position_id_per_seconds=13)
    talker = copy.deepcopy(TALKER)
    talker.update(audio_token_id=ids["audio_token_id"], image_token_id=ids["image_token_id"],
                  video_token_id=ids["video_token_id"], vision_start_token_id=ids["vision_start_token_id"],
                  audio_start_token_id=ids["audio_start_token_id"])
    return AutoConfig.for_model(published["model_type"], thinker_config=thinker, talker_config=talker,
                                code2wav_config=CODE2WAV, enable_audio_output=True,
                                architectures=published["architectures"])


def make_tiny_qwen3_omni(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen3-Omni-MoE (thinker, talker, code2wav) that trains on media: images up to
    128x128 pixels (at most 16 image tokens), clips as 128-bin log-mel frames."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(TOKENS)})
    start, end, image, video, a_start, a_end, audio = tok.convert_tokens_to_ids(list(TOKENS))
    ids = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
               audio_start_token_id=a_start, audio_end_token_id=a_end, audio_token_id=audio)
    Qwen3OmniMoeForConditionalGeneration(tiny_qwen3_omni_config(len(tok), ids)).save_pretrained(out)
    tok.save_pretrained(out)
    images = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=128 * 128).to_dict()
    (out / "preprocessor_config.json").write_text(json.dumps({**images, **WhisperFeatureExtractor(
        feature_size=128).to_dict()}, indent=2))
    return out
