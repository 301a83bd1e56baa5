"""What this build of shardfit can train: configs it would otherwise fail on halfway are refused up front."""

from __future__ import annotations

import importlib.util

from shardfit.config.schema import Config
from shardfit.errors import UserError


def qlora_compute_dtype(cfg: Config) -> str:
    """The dtype QLoRA's 4-bit weights dequantize to: `qlora.compute_dtype`, or the run's precision for auto."""
    return cfg.precision if cfg.qlora.compute_dtype == "auto" else cfg.qlora.compute_dtype


def require_method_support(cfg: Config) -> None:
    """Refuse what this installation cannot train instead of failing after the model is loaded: QLoRA stores its
    frozen weights with torchao's NF4 tensors, an optional dependency."""
    if cfg.method == "qlora" and importlib.util.find_spec("torchao") is None:
        raise UserError("'method: qlora' needs torchao, which stores the frozen weights in 4 bits (NF4) and lets "
                        "FSDP2 shard them: pip install -c constraints.txt torchao==0.18.0 (or `pip install "
                        "shardfit[qlora]`; `make setup` installs it). Or use 'method: lora' (frozen weights in the "
                        "compute precision).")
