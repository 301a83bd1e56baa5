"""Experiment trackers a run's metrics are mirrored to, chosen by `report_to` (as the HF Trainer's key):
TensorBoard, Weights & Biases and MLflow. metrics.jsonl is always written; a tracker only receives copies.

Each tracker's library is imported when the tracker is opened and nowhere else: `pip install shardfit` runs
without any of them, and `pip install shardfit[tensorboard|wandb|mlflow]` adds one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from shardfit.errors import UserError

log = logging.getLogger("shardfit")

EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def installed(name: str) -> bool:
    """Whether the tracker's library can be imported (found, not imported)."""
    return importlib.util.find_spec(MODULE[name]) is not None


def resolve_report_to(report_to: list[str]) -> list[str]:
    """The trackers `report_to` names: `auto` is TensorBoard when installed; `none` is none. A named tracker that is
    not installed is a UserError that names the extra to install."""
    names: list[str] = []
    for name in report_to:
        if name == "none":
            return []
        if name == "auto":
            if installed("tensorboard") and "tensorboard" not in names:
                names.append("tensorboard")
            continue
        if not installed(name):
            raise UserError(f"'report_to': {name} is not installed. Run `pip install shardfit[{EXTRA[name]}]` "
                            f"(or `pip install {MODULE[name]}`), or remove {name} from report_to.")
        if name not in names:
            names.append(name)
    return names


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only when asked for

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in the run directory. WANDB_MODE=offline (no account, no network) writes it to RUN_DIR/wandb for
    a later `wandb sync`; WANDB_PROJECT names the project (default: shardfit)."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        import wandb  # optional extra: only when report_to names it

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardfit"), name=run_name, config=config,
                              dir=str(run_dir), reinit="finish_previous")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run under experiment MLFLOW_EXPERIMENT_NAME (default: shardfit), at MLFLOW_TRACKING_URI. With no
    URI set, a file store in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns` shows it)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        import mlflow  # optional extra: only when report_to names it

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow keeps its file store in maintenance mode and asks for this opt-in; it is the only store that
            # needs no server and no database, so it is the default for a run that names none.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardfit"))
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        flat = {k: str(v)[:500] for k, v in _flatten(config).items()}
        mlflow.log_params(flat)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_trackers(report_to: list[str], run_dir: Path, run_name: str, config: dict[str, Any]) -> list[Tracker]:
    """Start every tracker `report_to` names (rank 0 only calls this)."""
    out: list[Tracker] = []
    for name in resolve_report_to(report_to):
        try:
            out.append(TRACKERS[name](Path(run_dir), run_name, config))
        except ImportError as e:
            if name in report_to:  # asked for by name: a broken install is the user's to fix
                raise UserError(f"'report_to': {name} is installed but does not import ({e}); reinstall it "
                                f"(pip install -U shardfit[{EXTRA[name]}]) or remove it from report_to.") from None
            log.warning("report_to auto: %s does not import (%s); metrics go to metrics.jsonl only", name, e)
            continue
        log.info("reporting metrics to %s", name)
    return out


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record a tracker plots: every int/float but the step; a per-rank list (memory)
    becomes one scalar per rank."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/rank{i}": float(x) for i, x in enumerate(v)})
    return out
