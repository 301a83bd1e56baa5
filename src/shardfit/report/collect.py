"""Read what a run directory holds into one typed object (files that are missing stay None or empty)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.config.load import read_yaml
from shardfit.errors import UserError
from shardfit.plan.estimate import Breakdown, peak_reading
from shardfit.report.shapes import SHAPES, metrics_line

IMBALANCE = 0.10  # ranks whose peak memory differs by more than this share of the largest are flagged


@dataclass
class RunData:
    path: Path
    name: str
    config: dict[str, Any]
    plan: dict[str, Any] | None
    summary: dict[str, Any] | None
    preflight: dict[str, Any] | None
    evaluation: dict[str, Any] | None  # eval.json of `shardfit eval`
    train: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl lines with a training loss
    evals: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl lines with eval_loss

    @property
    def strategy(self) -> str | None:
        for source in (self.summary, self.preflight):
            if source and source.get("strategy"):
                return source["strategy"]
        return None

    @property
    def world(self) -> int:
        if self.summary and self.summary.get("world_size"):
            return int(self.summary["world_size"])
        return max((len(r.get("mem_gib") or []) for r in self.train), default=1)

    @property
    def global_batch(self) -> int | None:
        """Examples per optimizer step (micro_batch x grad_accum x ranks): summary.json's examples_per_step, else
        from the run's config; None when neither says."""
        if self.summary and isinstance(self.summary.get("examples_per_step"), int):
            return self.summary["examples_per_step"]
        mb, ga = self.config.get("micro_batch"), self.config.get("grad_accum", 1)
        if not isinstance(mb, int) or not isinstance(ga, int):
            return None
        return mb * ga * self.world

    def at(self, step: int, axis: str) -> float:
        """Where `step` lies on the x axis `axis`: the step itself, the examples seen by its end, or the tokens
        trained on by its end (metrics.jsonl's running count; between logged steps, in proportion)."""
        if axis == "examples":
            return float(step * (self.global_batch or 0))
        if axis == "tokens":
            pts = [(0, 0.0), *sorted((r["step"], float(r["tokens"])) for r in self.train
                                     if isinstance(r.get("tokens"), (int, float)))]
            for (s0, t0), (s1, t1) in itertools.pairwise(pts):
                if s0 <= step <= s1 and s1 > s0:
                    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
            last_step, last_tokens = pts[-1]
            return last_tokens * step / last_step if last_step else 0.0  # past the last logged step: its rate
        return float(step)

    def predicted_gib(self) -> float | None:
        """What the plan says a rank's logged peak reads, for the strategy the run used (every rank is planned
        alike): training logs torch.cuda.max_memory_allocated(), the tensors alone, so the plan's `allocated`
        reading (shardfit.plan.estimate.peak_reading), not its total with the allocator's reserve and the runtime."""
        if not self.plan or not self.strategy:
            return None
        names = {f.name for f in dataclasses.fields(Breakdown)}
        card = float((self.plan.get("hardware") or {}).get("gpu_mem_gib") or float("inf"))
        for c in self.plan.get("candidates", []):
            if c.get("strategy") == self.strategy:
                b = Breakdown(**{k: float(v) for k, v in c["per_gpu_gib"].items() if k in names})
                return peak_reading(b, card, "allocated")
        return None

    def peak_per_rank(self) -> list[float]:
        """The highest memory each rank reached (summary.json, else the largest logged value)."""
        if self.summary and self.summary.get("peak_mem_gib"):
            return [float(x) for x in self.summary["peak_mem_gib"]]
        peaks: list[float] = []
        for r in self.train:
            for i, x in enumerate(r.get("mem_gib") or []):
                if i >= len(peaks):
                    peaks.append(float(x))
                else:
                    peaks[i] = max(peaks[i], float(x))
        return peaks

    def memory_findings(self) -> list[str]:
        """Imbalance between ranks, and ranks over the plan's prediction, in words (empty when neither)."""
        out = []
        peaks = self.peak_per_rank()
        if len(peaks) > 1 and max(peaks) > 0:
            spread = (max(peaks) - min(peaks)) / max(peaks)
            if spread > IMBALANCE:
                hi, lo = peaks.index(max(peaks)), peaks.index(min(peaks))
                out.append(f"imbalance: rank {hi} peaked at {max(peaks):.2f} GiB, rank {lo} at {min(peaks):.2f} GiB "
                           f"({spread:.0%} apart; a balanced run stays within {IMBALANCE:.0%})")
        predicted = self.predicted_gib()
        if predicted:
            over = [i for i, p in enumerate(peaks) if p > predicted * (1 + IMBALANCE)]
            if over:
                out.append(f"over plan: rank(s) {', '.join(map(str, over))} peaked above the plan's "
                           f"{predicted:.2f} GiB of tensors by more than {IMBALANCE:.0%}")
        return out


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); it is not a file shardfit wrote. Remove it or "
                        "restore the run's own copy.") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}).") from None


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be a file shardfit wrote.") from None


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training lines and the evaluation lines of a metrics.jsonl."""
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    if not path.is_file():
        return train, evals
    for lineno, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
        except RecursionError:
            raise UserError(f"{path}:{lineno}: nested too deeply to be a line shardfit wrote.") from None
        metrics_line(rec, f"{path}:{lineno}")
        if "loss" in rec:
            train.append(rec)
        if "eval_loss" in rec:
            evals.append(rec)
    return train, evals


def read_run(path: str | Path) -> RunData:
    """A run directory's files; a folder that holds none of them, or a file that is not as shardfit writes it,
    is a UserError naming the file and key."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: no such run directory.")
    if not (p / "metrics.jsonl").is_file() and not (p / "summary.json").is_file():
        raise UserError(f"{p} is not a shardfit run directory (no metrics.jsonl or summary.json); point at a "
                        "run's output_dir.")
    config = _config(p / "config.yaml")
    train, evals = read_metrics(p / "metrics.jsonl")
    # Every file that is there is checked, run.json too (the report shows none of it, but a damaged one stops the
    # run's resume) and a file that parses to null: none of them is left out without a word.
    present = [name for name in SHAPES if (p / name).is_file()]
    files = {name: _json(p / name) for name in present}
    for name, data in files.items():
        SHAPES[name](data, str(p / name))
    files = {name: files.get(name) for name in SHAPES}
    return RunData(p, p.resolve().name, config, files["plan.json"], files["summary.json"], files["preflight.json"],
                   files["eval.json"], train, evals)


def _config(path: Path) -> dict[str, Any]:
    """The run's config.yaml as a mapping, read as strictly as any config (not UTF-8, bad YAML, nesting, alias
    bombs: a UserError naming the file and line)."""
    if not path.is_file():
        return {}
    config, _ = read_yaml(path)
    if config is not None and not isinstance(config, dict):
        raise UserError(f"{path}: expected a mapping of config keys, got {type(config).__name__}; it is not the "
                        "config.yaml shardfit wrote. Restore it, or remove it (the report then shows no config).")
    return config or {}


# The x axes the shared charts can use: steps, examples seen, tokens trained on.
AXES = {"step": "step", "examples": "examples seen", "tokens": "tokens trained on"}


def choose_axis(runs: list[RunData], asked: str = "auto") -> tuple[str, str]:
    """The x axis of the shared charts and why. `auto`: steps, unless the runs take different numbers of examples
    per step (a step of one is then not a step of the other): examples seen, or tokens where a batch is unknown."""
    if asked != "auto":
        return asked, ""
    batches = {r.global_batch for r in runs}
    if len(runs) < 2 or len(batches) == 1:
        return "step", ""
    sizes = ", ".join(f"{r.name}: {r.global_batch or '?'}" for r in runs)
    axis = "tokens" if None in batches else "examples"
    return axis, (f"the runs take different global batches (examples per step: {sizes}), so the curves are drawn "
                  f"against {AXES[axis]}; `shardfit report --x step` draws them against steps")


def unique_names(runs: list[RunData]) -> None:
    """Make the runs' names distinct (two runs both called `run` become `a/run` and `b/run`)."""
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.path.resolve().name}"
