"""What this installation of shardfit can train: configs it would otherwise fail on halfway are refused up front."""

from __future__ import annotations

import importlib.util

from shardfit import method
from shardfit.config.schema import Config
from shardfit.errors import UserError

# `loss_chunk: auto`: a chunk of the loss holds its fp32 logits, a 16-bit copy and their gradient at once
# (train/loss.py), so rows x vocab x 4 bytes sets the loss's transient memory; with a large vocabulary 1024 rows of
# it were the largest thing alive in a small model's step. A chunk gets 32 MiB of fp32 logits, but never fewer rows
# than keep its matmul against the head computing faster than it reads the head's weight (plan/cards.py
# `Card.compute_bound_rows`): fewer rows would make the head's matmuls wait on memory.
LOSS_CHUNK_BYTES = 32 * 2**20
LOSS_CHUNK_MIN_ROWS = 64
LOSS_CHUNK_MAX_ROWS = 1024

TORCHAO_HINT = "pip install -c constraints.txt torchao==0.18.0 (or `pip install shardfit[qlora]`; `make setup` " \
               "installs it)"


def trainable_methods() -> tuple[str, ...]:
    """What `train` runs here; the planner plans every method of the schema, and advice for train and check only
    offers these. QLoRA stores its frozen weights with torchao's NF4 tensors, an optional dependency (found, not
    imported: importing it takes seconds)."""
    return tuple(m.name for m in method.TABLE if m.needs is None or importlib.util.find_spec(m.needs) is not None)


def qlora_compute_dtype(cfg: Config) -> str:
    """The dtype QLoRA's 4-bit weights dequantize to: `qlora.compute_dtype`, or the run's precision for auto."""
    return cfg.precision if cfg.qlora.compute_dtype == "auto" else cfg.qlora.compute_dtype


def require_method_support(cfg: Config) -> None:
    """Refuse what this installation cannot train instead of failing after the model is loaded."""
    if cfg.method not in trainable_methods():
        raise UserError(f"'method: {cfg.method}' needs torchao, which stores the frozen weights in 4 bits (NF4) and "
                        f"lets FSDP2 shard them: {TORCHAO_HINT}. Or use 'method: lora' (frozen weights in the "
                        "compute precision).")


def loss_chunk_rows(setting: int | str, vocab: int, min_rows: int = LOSS_CHUNK_MIN_ROWS) -> int:
    """Rows of logits the chunked loss computes at once: `loss_chunk` as set, or for `auto` the largest power of two
    whose fp32 logits fit LOSS_CHUNK_BYTES, at least `min_rows` (rounded up to a power of two) and
    LOSS_CHUNK_MIN_ROWS, at most LOSS_CHUNK_MAX_ROWS."""
    if setting != "auto":
        return int(setting)
    fit = LOSS_CHUNK_BYTES // (4 * max(vocab, 1))
    fit = 1 << (fit.bit_length() - 1) if fit >= 1 else 1
    floor = max(LOSS_CHUNK_MIN_ROWS, 1 << max(0, int(min_rows) - 1).bit_length())
    return min(LOSS_CHUNK_MAX_ROWS, max(floor, fit))


def adapter_dtype_problem(cfg: Config, precision: str | None = None) -> str | None:
    """What makes `lora.dtype: bf16` untrainable for `cfg` (None: nothing, or the default fp32): bf16 adapters
    compute without autocast, so every weight they meet must be bf16 too. `precision`: the run's as resolved
    (`auto` decided); None checks only an explicit `precision`. The one rule config loading and resolve share."""
    if cfg.lora.dtype == "fp32":
        return None
    if not method.get(cfg.method).adapters:
        return (f"is bf16, but method {cfg.method} trains no adapters (its trained weights keep fp32 masters under "
                "autocast or FSDP2's mixed precision). Remove lora.dtype, or use method lora or qlora.")
    run = precision or cfg.precision
    if run != "auto" and run != "bf16":
        how = "auto resolved to " if cfg.precision == "auto" else ""
        return (f"is bf16, but precision is {how}{run}: bf16 adapters run without autocast, so the frozen weights "
                "must be bf16 too. Set precision: bf16 (on a device that computes bf16), or remove lora.dtype "
                "(fp32 adapters under autocast).")
    if method.get(cfg.method).quantized and cfg.qlora.compute_dtype not in ("auto", "bf16"):
        return (f"is bf16, but qlora.compute_dtype is {cfg.qlora.compute_dtype}: without autocast the 4-bit "
                "weights must dequantize to the adapters' bf16. Set qlora.compute_dtype: auto, or remove lora.dtype.")
    return None
