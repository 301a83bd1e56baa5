"""What `compile: auto` and `attn_implementation: auto` become for a run: the fastest choice measured for the
device and the row shape (bench/defaults_probe.py; bench/results/defaults_probe.json holds the measurements,
docs/training.md the rule in words).

- compile: compiled blocks want one static shape, so a compiled run pads every micro-batch to micro_batch rows of
  max_seq_len, which gives back what packing saved, and the first run of a model pays the compile itself. `auto`
  compiles only where neither cost applies: a GPU, packing off.
- attention: with packing the kernel gets a block-diagonal mask, and SDPA's CPU kernel then computes the whole
  masked square. Compiled, the plain matmul-mask-softmax attention (`eager`, fused by inductor) beat it for packed
  rows of 256 tokens (2.8 -> 2.15 s per step); uncompiled it did not (0.76x SDPA's speed at 4 x 128 packed). So
  `auto` is `eager` only for compiled blocks on CPU with packed rows up to EAGER_ATTENTION_MAX_LEN tokens, and
  transformers' default (SDPA) everywhere else.
"""

from __future__ import annotations

import dataclasses

from shardfit.config import Config

# Longest packed row at which compiled eager attention was measured faster than SDPA on CPU.
EAGER_ATTENTION_MAX_LEN = 256


def resolve_compile(value: bool | str, device_type: str, packing: bool) -> bool:
    """`compile` as a bool: `auto` compiles on GPUs when rows are not packed (static shapes cost nothing there)."""
    if value != "auto":
        return bool(value)
    return device_type == "cuda" and not packing


def resolve_attention(value: str, device_type: str, packing: bool, max_seq_len: int, compiled: bool) -> str:
    """`attn_implementation` for the run: `auto` becomes `eager` for compiled blocks on CPU with packed rows of at
    most EAGER_ATTENTION_MAX_LEN tokens, and stays `auto` (transformers' default, SDPA) otherwise."""
    if value != "auto":
        return value
    if device_type == "cpu" and compiled and packing and max_seq_len <= EAGER_ATTENTION_MAX_LEN:
        return "eager"
    return "auto"


def resolve_speed_settings(cfg: Config, device_type: str) -> Config:
    """`cfg` with `compile` and `attn_implementation` resolved for `device_type` (what config.yaml records)."""
    compiled = resolve_compile(cfg.compile, device_type, cfg.packing)
    return dataclasses.replace(cfg, compile=compiled, attn_implementation=resolve_attention(
        cfg.attn_implementation, device_type, cfg.packing, cfg.max_seq_len, compiled))
