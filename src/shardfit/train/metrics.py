"""Run outputs: metrics.jsonl, summary.json, memory per rank, optional TensorBoard, and the progress bar."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardfit.parallel.env import DistEnv


def peak_mem_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def gather_floats(value: float, env: DistEnv) -> list[float]:
    """One float from every rank, in rank order (on rank 0 and the others alike)."""
    if not env.distributed:
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    out = [torch.zeros_like(t) for _ in range(env.world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


class MetricsLog:
    """Appends one JSON object per logging step on rank 0 (and mirrors scalars to TensorBoard if installed)."""

    def __init__(self, run_dir: Path, env: DistEnv):
        self.env = env
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if env.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:
                self.tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.env.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record.get("step", 0))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop metric lines logged after the checkpoint, so the log reads as one uninterrupted run."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def progress(total: int, initial: int, enabled: bool) -> Any:
    """A tqdm bar on rank 0 (loss, tokens/s, ETA); silent elsewhere."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                desc="train", unit="step")
