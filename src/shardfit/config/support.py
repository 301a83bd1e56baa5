"""What this build of shardfit can train: configs it would otherwise train as something else are refused."""

from __future__ import annotations

from shardfit.config.schema import METHODS, Config
from shardfit.errors import UserError

# What `train` runs; the planner plans every method of the schema, and advice for train and check only offers these.
TRAINABLE_METHODS = tuple(m for m in METHODS if m != "qlora")


def require_method_support(cfg: Config) -> None:
    """Refuse what this build cannot train instead of silently training something else."""
    if cfg.method not in TRAINABLE_METHODS:
        raise UserError("'method: qlora' cannot be trained by this version of shardfit: 4-bit (NF4) weights need "
                        "bitsandbytes on a CUDA GPU, and the QLoRA loader is not implemented yet. Use 'method: lora' "
                        "(frozen weights in bf16), or plan a QLoRA run with `shardfit plan --method qlora`.")
