"""What this installation of shardfit can train: configs it would otherwise fail on halfway are refused up front."""

from __future__ import annotations

import importlib.util

from shardfit.config.schema import METHODS, Config
from shardfit.errors import UserError

TORCHAO_HINT = "pip install -c constraints.txt torchao==0.18.0 (or `pip install shardfit[qlora]`; `make setup` " \
               "installs it)"


def trainable_methods() -> tuple[str, ...]:
    """What `train` runs here; the planner plans every method of the schema, and advice for train and check only
    offers these. QLoRA stores its frozen weights with torchao's NF4 tensors, an optional dependency (found, not
    imported: importing it takes seconds)."""
    if importlib.util.find_spec("torchao") is None:
        return tuple(m for m in METHODS if m != "qlora")
    return METHODS


def qlora_compute_dtype(cfg: Config) -> str:
    """The dtype QLoRA's 4-bit weights dequantize to: `qlora.compute_dtype`, or the run's precision for auto."""
    return cfg.precision if cfg.qlora.compute_dtype == "auto" else cfg.qlora.compute_dtype


def require_method_support(cfg: Config) -> None:
    """Refuse what this installation cannot train instead of failing after the model is loaded."""
    if cfg.method not in trainable_methods():
        raise UserError(f"'method: {cfg.method}' needs torchao, which stores the frozen weights in 4 bits (NF4) and "
                        f"lets FSDP2 shard them: {TORCHAO_HINT}. Or use 'method: lora' (frozen weights in the "
                        "compute precision).")
