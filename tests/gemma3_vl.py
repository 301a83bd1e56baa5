"""A tiny Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`) saved as an HF folder a user's run would
read: the catalog's google/gemma-3-27b-it config with its sizes shrunk and its layout kept (a SigLIP tower without
a head, a pooling projector, sliding-window and global layers), the bundled tokenizer with Gemma's image tokens
added, and Gemma 3's PIL image processor at the tiny tower's size (processor files without a hub)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, Gemma3Config, Gemma3ImageProcessorPil

from shardfit.plan.shapes import catalog_config
from tests.families import tiny_text_config

GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# The published tower is 27 SigLIP layers on 896-pixel images in 14-pixel patches, pooled 4x4 to 256 soft tokens;
# shrunk: 2 layers on 56-pixel images (16 patches), pooled 2x2 to 4 soft tokens per image.
VISION = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=56)
SOFT_TOKENS = 4


def make_tiny_gemma3_vl(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny Gemma 3 vision-language model, saved with tokenizer and image processor."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA_TOKENS)})
    boi, eoi, image = tok.convert_tokens_to_ids(list(GEMMA_TOKENS))
    published = catalog_config("google/gemma-3-27b-it")
    text = tiny_text_config("Gemma 3 (text)").to_dict()
    text.update(vocab_size=len(tok), sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    vision = copy.deepcopy(published["vision_config"])
    vision.update(VISION)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=SOFT_TOKENS,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                          tie_word_embeddings=True)
    model = AutoModelForImageTextToText.from_config(config)
    # The projector's weight starts at zero in transformers' init: random, so the image path changes the loss.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    side = VISION["image_size"]
    Gemma3ImageProcessorPil(size={"height": side, "width": side}).save_pretrained(out)
    return out
