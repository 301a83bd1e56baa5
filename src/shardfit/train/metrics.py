"""What a run reports while it trains: metrics.jsonl (and its copies to the trackers), memory per rank, the
progress bar, and the step logger that decides when to write."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from shardfit.parallel.env import DistEnv
from shardfit.train.trackers import Tracker, scalars_of

# The figures metrics.jsonl shows for a preference run, each summed over its pairs (rows for KTO) with its count
# (train/preference.py `PreferenceLoss.last_stats`).
STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "logps_chosen", "logps_rejected")

SAMPLES_FILE = "eval_samples.jsonl"


def resident_peak_gib() -> float:
    """This process's peak resident set, GiB. Linux's VmHWM is the high-water mark of the process's own memory
    map; getrusage's ru_maxrss is not: the kernel carries it across exec, so a process started by a large one (a
    rank under the CLI's torchrun, a run under a benchmark driver) would report at least its parent's size."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # where there is no /proc: KiB on Linux


def peak_mem_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resident_peak_gib()


def gather_floats(value: float, env: DistEnv) -> list[float]:
    """One float from every rank, in rank order (on rank 0 and the others alike)."""
    if not env.distributed:
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    out = [torch.zeros_like(t) for _ in range(env.world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


class MetricsLog:
    """Appends one JSON object per logging step on rank 0, and mirrors its numbers to the run's trackers
    (TensorBoard, W&B, MLflow: `report_to`)."""

    def __init__(self, run_dir: Path, env: DistEnv, trackers: Sequence[Tracker] = ()):
        self.env = env
        self.path = Path(run_dir) / "metrics.jsonl"
        self.trackers = list(trackers) if env.is_main else []

    def write(self, record: dict[str, Any]) -> None:
        if not self.env.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = scalars_of(record)
        for t in self.trackers:
            t.log(scalars, int(record.get("step", 0)))

    def write_samples(self, items: list[dict[str, Any]]) -> None:
        """Answers generated at an evaluation (eval_metrics), one line each, to eval_samples.jsonl."""
        if not self.env.is_main:
            return
        with (self.path.parent / SAMPLES_FILE).open("a") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop lines logged after the checkpoint, so the log reads as one uninterrupted run."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def progress(total: int, initial: int, enabled: bool, desc: str = "train", unit: str = "step") -> Any:
    """A tqdm bar on rank 0 (rate and ETA; the caller adds loss, tokens/s); silent elsewhere."""
    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                desc=desc, unit=unit, leave=desc == "train")


class StepLogger:
    """The training loss and throughput over a window of steps, written every `every` steps (and at the last):
    one metrics.jsonl line, and the progress bar's loss and tokens/s. Every rank calls it (the window's loss and
    the memory of each rank are gathered), rank 0 writes."""

    def __init__(self, metrics: MetricsLog, env: DistEnv, every: int, total_steps: int, start_step: int,
                 epoch_of: Any, t_start: float, show: bool):
        self.metrics, self.env, self.every, self.total = metrics, env, every, total_steps
        self.epoch_of, self.t_start = epoch_of, t_start
        self.bar = progress(total_steps, start_step, show)
        self.losses: list[float] = []  # one per written window: summary.json's train_loss is the last
        self._loss = torch.zeros((), dtype=torch.float64, device=env.device)
        self._steps, self._tokens, self._t0 = 0, 0, time.perf_counter()
        # A mixture of experts: the window's load-balancing loss, and its lowest and highest expert load.
        self._aux = torch.zeros((), dtype=torch.float64, device=env.device)
        self._load = torch.tensor([float("inf"), 0.0], dtype=torch.float64, device=env.device)
        self._routed = False
        self._pref: torch.Tensor | None = None  # a preference run's window of figures (train/preference.py STATS)

    def add_routing(self, aux_sum: torch.Tensor, global_targets: int, load: torch.Tensor) -> None:
        """A micro-batch's routing: its load-balancing loss (summed as the loss is) and expert load ([lowest,
        highest]), kept on the device until the window is written."""
        self._routed = True
        self._aux += aux_sum.detach().double() / max(global_targets, 1)
        load = load.to(self._load.device, torch.float64)
        self._load = torch.stack([torch.minimum(self._load[0], load[0]), torch.maximum(self._load[1], load[1])])

    def _routing_record(self) -> dict[str, Any]:
        """The window's routing figures for metrics.jsonl (every rank's: summed, lowest, highest), or nothing."""
        if not self._routed:
            return {}
        if self.env.distributed:
            dist.all_reduce(self._aux)
            low, high = -self._load[0:1], self._load[1:2]
            dist.all_reduce(low, op=dist.ReduceOp.MAX)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            self._load = torch.cat([-low, high])
        record = {"aux_loss": round(float(self._aux) / self._steps, 6),
                  "expert_load_min": round(float(self._load[0]), 4), "expert_load_max": round(float(self._load[1]), 4)}
        self._aux.zero_()
        self._load = torch.tensor([float("inf"), 0.0], dtype=torch.float64, device=self.env.device)
        return record

    def add_preference(self, stats: torch.Tensor) -> None:
        """A preference micro-batch's figures (sums and counts; train/preference.py `PreferenceLoss.last_stats`)."""
        self._pref = stats.clone() if self._pref is None else self._pref + stats

    def _preference_record(self) -> dict[str, Any]:
        """The window's preference figures (every rank's), or nothing for SFT."""
        if self._pref is None:
            return {}
        if self.env.distributed:
            dist.all_reduce(self._pref)
        record = preference_record(self._pref)
        self._pref = None
        return record

    def add_loss(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        """A micro-batch's summed loss, as a share of its step's mean over the global batch."""
        self._loss += loss_sum.detach().double() / max(global_targets, 1)

    def writes_at(self, step: int) -> bool:
        """Whether `end_step` writes the window (and reads the device) at step `step`."""
        return step % self.every == 0 or step == self.total

    def end_step(self, step: int, tokens: int, step_tokens: int, grad_norm: torch.Tensor, lr: float) -> None:
        """Count a finished optimizer step; write the window when `step` is on the cadence or the last."""
        self._steps += 1
        self._tokens += step_tokens
        self.bar.update(1)
        if not self.writes_at(step):
            return
        if self.env.distributed:
            dist.all_reduce(self._loss)
        loss = float(self._loss) / self._steps
        self.losses.append(loss)
        tps = self._tokens / max(time.perf_counter() - self._t0, 1e-9)
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.metrics.write({"step": step, "epoch": round(self.epoch_of(step), 4), "loss": round(loss, 6), "lr": lr,
                            "grad_norm": round(float(gn), 6), "tokens": tokens, "tokens_per_s": round(tps, 2),
                            "mem_gib": [round(x, 4) for x in gather_floats(peak_mem_gib(self.env.device), self.env)],
                            "wall_s": round(time.perf_counter() - self.t_start, 3), **self._routing_record(),
                            **self._preference_record()})
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:.0f}")
        self._loss.zero_()
        self._steps, self._tokens, self._t0 = 0, 0, time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (evaluation, checkpoints) out of the window's tokens/s."""
        self._t0 += seconds

    def close(self) -> None:
        self.bar.close()


def preference_record(stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """metrics.jsonl's figures from summed `stats` ((len(STATS), 2) sums and counts): each mean, and the margin."""
    out: dict[str, float] = {}
    for (name, (total, count)) in zip(STATS, stats.tolist(), strict=True):
        if name != "loss" and count > 0:
            out[f"{prefix}{name}"] = round(total / count, 6)
    if f"{prefix}rewards_chosen" in out and f"{prefix}rewards_rejected" in out:
        out[f"{prefix}rewards_margin"] = round(out[f"{prefix}rewards_chosen"] - out[f"{prefix}rewards_rejected"], 6)
    return out
