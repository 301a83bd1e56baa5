"""What this build of shardfit can train: configs it would otherwise train as something else are refused."""

from __future__ import annotations

from shardfit.config.schema import Config
from shardfit.errors import UserError


def require_method_support(cfg: Config) -> None:
    """Refuse what this build cannot train instead of silently training something else."""
    if cfg.method == "qlora":
        raise UserError("'method: qlora' cannot be trained by this version of shardfit: 4-bit (NF4) weights need "
                        "bitsandbytes on a CUDA GPU, and the QLoRA loader is not implemented yet. Use 'method: lora' "
                        "(frozen weights in bf16), or plan a QLoRA run with `shardfit plan --method qlora`.")
