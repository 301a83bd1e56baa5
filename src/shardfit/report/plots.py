"""The report's charts as PNG files (matplotlib, headless): one line per run on shared charts, and one memory
chart per run with a line per rank and the plan's prediction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.ticker import MaxNLocator  # noqa: E402

from shardfit.report.collect import AXES, RunData  # noqa: E402

CURVES = (("loss", "training loss", "loss"), ("lr", "learning rate", "lr"), ("grad_norm", "gradient norm", "norm"),
          ("tokens_per_s", "throughput", "tokens / s"))
# A preference run's figures (train/metrics.py STATS): drawn on their own charts, not as generation metrics.
REWARDS = ("rewards_chosen", "rewards_rejected", "rewards_margin")
PREFERENCE = (*REWARDS, "reward_accuracy", "logps_chosen", "logps_rejected")


@dataclass
class Chart:
    file: str
    title: str
    note: str = ""


def _save(fig: Any, out: Path, name: str) -> str:
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def series(records: list[dict[str, Any]], key: str, run: RunData | None = None,
            axis: str = "step") -> tuple[list[float], list[float]]:
    """The (x, value) points of `key`; x on `axis` (step, examples, tokens) of `run`."""
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    xs = [run.at(p[0], axis) if run is not None else float(p[0]) for p in pts]
    return xs, [float(p[1]) for p in pts]


def loss_chart(runs: list[RunData], out: Path, axis: str = "step") -> Chart:
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax.plot(*series(run.train, "loss", run, axis), color=color, label=f"{run.name} train")
        xs, ys = series(run.evals, "eval_loss", run, axis)
        if xs:
            ax.plot(xs, ys, color=color, linestyle="--", marker="o", label=f"{run.name} eval")
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel("loss")
    ax.set_title("loss (training window mean, held-out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Chart(_save(fig, out, "loss.png"), "Loss")


def curve_chart(runs: list[RunData], out: Path, key: str, title: str, ylabel: str,
                axis: str = "step") -> Chart | None:
    if not any(series(r.train, key)[0] for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, run in enumerate(runs):
        ax.plot(*series(run.train, key, run, axis), color=f"C{i}", label=run.name)
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8)
    return Chart(_save(fig, out, f"{key}.png"), title[0].upper() + title[1:])


def eval_metric_chart(runs: list[RunData], out: Path, axis: str = "step") -> Chart | None:
    keys = sorted({k for r in runs for rec in r.evals for k in rec if k.startswith("eval_") and k != "eval_loss"
                   and k.removeprefix("eval_") not in PREFERENCE})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, run in enumerate(runs):
        for j, key in enumerate(keys):
            xs, ys = series(run.evals, key, run, axis)
            if xs:
                ax.plot(xs, ys, color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], marker="o",
                        label=f"{run.name} {key.removeprefix('eval_')}")
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("generation metrics on held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Chart(_save(fig, out, "eval_metrics.png"), "Generation metrics")


def preference_chart(runs: list[RunData], out: Path, key_set: tuple[str, ...], name: str, title: str,
                     ylabel: str, axis: str = "step") -> Chart | None:
    """A preference run's `key_set` figures over the steps, training's solid and held-out's dotted."""
    if not any(series(r.train, k)[0] for r in runs for k in key_set):
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, run in enumerate(runs):
        for j, key in enumerate(key_set):
            for records, prefix, style in ((run.train, "", "-"), (run.evals, "eval_", ":")):
                xs, ys = series(records, prefix + key, run, axis)
                if xs:
                    ax.plot(xs, ys, color=f"C{(i * len(key_set) + j) % 10}", linestyle=style,
                            marker="o" if prefix else None, label=f"{run.name} {prefix}{key}")
    ax.set_xlabel(AXES[axis])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Chart(_save(fig, out, f"{name}.png"), title[0].upper() + title[1:])


def memory_chart(run: RunData, index: int, out: Path) -> Chart | None:
    """Each rank's max_memory_allocated() over the steps against what the plan says it reads (the tensors) for the
    strategy the run used."""
    steps = [r["step"] for r in run.train if r.get("mem_gib")]
    if not steps:
        return None
    per_rank = list(zip(*[r["mem_gib"] for r in run.train if r.get("mem_gib")], strict=False))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for rank, values in enumerate(per_rank):
        ax.plot(steps, values, marker=".", label=f"rank {rank}")
    predicted = run.predicted_gib()
    if predicted:
        ax.axhline(predicted, color="red", linestyle="--", label=f"plan, tensors: {predicted:.2f} GiB ({run.strategy})")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    findings = run.memory_findings()
    ax.set_title(f"{run.name}: peak memory per rank" + (" (IMBALANCED)" if any(
        f.startswith("imbalance") for f in findings) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Chart(_save(fig, out, f"memory-{index}.png"), f"Memory per rank: {run.name}", "; ".join(findings))


def make_charts(runs: list[RunData], out: Path, axis: str = "step") -> list[Chart]:
    """Every chart the runs have data for, written into `out`; the shared charts against `axis` (the memory
    charts, one per run, against its steps)."""
    charts: list[Chart | None] = [loss_chart(runs, out, axis), eval_metric_chart(runs, out, axis),
                                  preference_chart(runs, out, REWARDS, "rewards", "preference rewards (beta x "
                                                   "log-ratio to the reference)", "reward", axis),
                                  preference_chart(runs, out, ("reward_accuracy",), "reward_accuracy",
                                                   "reward accuracy (chosen above rejected; ties half)", "share",
                                                   axis)]
    charts += [curve_chart(runs, out, key, title, ylabel, axis) for key, title, ylabel in CURVES[1:]]
    charts += [memory_chart(run, i, out) for i, run in enumerate(runs)]
    return [c for c in charts if c is not None]
