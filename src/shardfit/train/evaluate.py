"""Held-out loss during and after training, with its own cadence."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardfit.data.loader import collate
from shardfit.data.packing import PackedRow
from shardfit.parallel.env import DistEnv
from shardfit.train.metrics import MetricsLog


@torch.no_grad()
def evaluate(module: nn.Module, rows: list[PackedRow], micro_batch: int, pad_id: int, env: DistEnv,
             amp: Any, device: torch.device | None = None, width: int | None = None) -> float | None:
    """Mean token loss over `rows`; every rank runs the same number of forwards (FSDP needs that)."""
    if not rows:
        return None
    module.eval()
    batches = [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]
    per_rank = math.ceil(len(batches) / env.world)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for k in range(per_rank):
        idx = k * env.world + env.rank
        real = idx < len(batches)
        batch = collate(batches[idx if real else 0], pad_id, width).to(device or env.device)
        with amp:
            loss_sum, n = module(batch.input_ids, batch.position_ids, batch.targets)
        if real:
            total += torch.tensor([float(loss_sum), n], dtype=torch.float64, device=env.device)
    if env.distributed:
        dist.all_reduce(total)
    module.train()
    return float(total[0] / max(total[1], 1))


class Evaluator:
    """Evaluates every `every` steps before the last, and once at the end (`run`); writes eval_loss lines."""

    def __init__(self, module: nn.Module, rows: list[PackedRow], metrics: MetricsLog, env: DistEnv, *,
                 micro_batch: int, pad_id: int, amp: Any, device: torch.device, width: int | None, every: int,
                 total_steps: int):
        self.module, self.rows, self.metrics, self.env = module, rows, metrics, env
        self.micro_batch, self.pad_id, self.amp, self.device, self.width = micro_batch, pad_id, amp, device, width
        self.every, self.total = every, total_steps
        self.last: float | None = None

    def maybe_run(self, step: int) -> None:
        if self.rows and step % self.every == 0 and step != self.total:
            self.run(step)

    def run(self, step: int) -> float | None:
        if not self.rows:
            return None
        self.last = evaluate(self.module, self.rows, self.micro_batch, self.pad_id, self.env, self.amp, self.device,
                             self.width)
        self.metrics.write({"step": step, "eval_loss": self.last})
        return self.last
