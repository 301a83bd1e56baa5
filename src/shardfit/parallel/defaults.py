"""What `compile: auto` and `attn_implementation: auto` become for a run: the fastest choice measured for the
device and the row shape (bench/defaults_probe.py; bench/results/defaults_probe.json holds the measurements,
docs/training.md the rule in words).

- compile: compiled blocks want one static shape, so a compiled run pads every micro-batch to micro_batch rows of
  max_seq_len, which gives back what packing saved, and the first run of a model pays the compile itself. `auto`
  compiles only where neither cost applies: a GPU, packing off.
- attention: with packing the kernel gets a block-diagonal mask, and SDPA's CPU kernel then computes the whole
  masked square; on CPU, for rows up to EAGER_ATTENTION_MAX_LEN tokens, the plain matmul-softmax attention
  (`eager`) was faster. Elsewhere transformers' default (SDPA) stays.
"""

from __future__ import annotations

import dataclasses

from shardfit.config import Config

# Longest row for which eager attention beat SDPA on CPU with packed rows (bench/results/defaults_probe.json).
EAGER_ATTENTION_MAX_LEN = 512


def resolve_compile(value: bool | str, device_type: str, packing: bool) -> bool:
    """`compile` as a bool: `auto` compiles on GPUs when rows are not packed (static shapes cost nothing there)."""
    if value != "auto":
        return bool(value)
    return device_type == "cuda" and not packing


def resolve_attention(value: str, device_type: str, packing: bool, max_seq_len: int) -> str:
    """`attn_implementation` for the run: `auto` becomes `eager` for packed rows of at most
    EAGER_ATTENTION_MAX_LEN tokens on CPU, and stays `auto` (transformers' default, SDPA) otherwise."""
    if value != "auto":
        return value
    if device_type == "cpu" and packing and max_seq_len <= EAGER_ATTENTION_MAX_LEN:
        return "eager"
    return "auto"


def resolve_speed_settings(cfg: Config, device_type: str) -> Config:
    """`cfg` with `compile` and `attn_implementation` resolved for `device_type` (what config.yaml records)."""
    return dataclasses.replace(
        cfg, compile=resolve_compile(cfg.compile, device_type, cfg.packing),
        attn_implementation=resolve_attention(cfg.attn_implementation, device_type, cfg.packing, cfg.max_seq_len))
