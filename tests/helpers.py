"""Plain helpers the tests call: tiny real models, config files, the CLI in a subprocess. Fixtures that build
shared models live in conftest.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2_5OmniConfig, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "src" / "shardfit" / "demo" / "train.jsonl"


def make_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", tie: bool = True, seed: int = 0) -> Path:
    """A randomly initialised tiny model of a real architecture, saved as an HF folder with the tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def write_config(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m shardfit ...` in a subprocess, as a user runs it (`input`: what the user types)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=full_env, input=input)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_omni_config():
    """A Qwen2.5-Omni config shrunk in every part (thinker text/vision/audio, talker, token2wav)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    audio = dict(encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32)
    talker = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, embedding_size=32, head_dim=8, rope_parameters=rope)
    dit = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16, head_dim=16,
               enc_emb_dim=16, enc_dim=32, enc_channels=[32, 32, 32, 32, 64], enc_attention_channels=16,
               enc_se_channels=16, num_embeds=64, mel_dim=16, repeats=2)
    bigvgan = dict(mel_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                   resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])
    return Qwen2_5OmniConfig(thinker_config=dict(text_config=text, vision_config=vision, audio_config=audio),
                             talker_config=talker, token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))
