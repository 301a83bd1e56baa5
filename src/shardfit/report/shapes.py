"""The shapes of the files a run directory holds, as far as the report reads them: a file that parses but is not
what shardfit writes (a list where an object goes, a number given as text) is a UserError naming the file, the
key and the fix, checked once when the run is read rather than met as a TypeError halfway through a chart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardfit.errors import UserError

# metrics.jsonl values the charts and tables read as numbers
NUMBERS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tokens", "epoch", "wall_s")


def _bad(where: str, key: str, want: str, value: Any) -> UserError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return UserError(f"{where}: '{key}' is {shown}; expected {want}. It is not as shardfit writes it: restore the "
                     "file from the run, or remove it (the report leaves out what is missing).")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _object(data: Any, where: str, key: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad(where, key, "an object", data)
    return data


def _optional(data: dict[str, Any], where: str, key: str, ok: Callable[[Any], bool], want: str) -> None:
    if data.get(key) is not None and not ok(data[key]):
        raise _bad(where, key, want, data[key])


def _numbers(value: Any) -> bool:
    return isinstance(value, list) and all(_number(v) for v in value)


def _objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def metrics_line(rec: Any, where: str) -> None:
    """One line of metrics.jsonl: an object with a whole-number step and numbers for the values charted."""
    rec = _object(rec, where, "the line")
    keys = [k for k in rec if k in NUMBERS or k.startswith("eval_") or k == "mem_gib"]
    if keys and not (isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool)):
        raise _bad(where, "step", "a whole number (the line has " + ", ".join(keys[:3]) + ")", rec.get("step"))
    for k in keys:
        if k != "mem_gib":
            _optional(rec, where, k, _number, "a number")
    _optional(rec, where, "mem_gib", _numbers, "a list of GiB per rank")


def summary(data: Any, where: str) -> None:
    data = _object(data, where, "the file")
    _optional(data, where, "world_size", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
              "a whole number of ranks")
    _optional(data, where, "peak_mem_gib", _numbers, "a list of GiB per rank")
    _optional(data, where, "strategy", lambda v: isinstance(v, str), "a strategy name")


def plan(data: Any, where: str) -> None:
    data = _object(data, where, "the file")
    _optional(data, where, "candidates", _objects, "a list of objects")
    for i, c in enumerate(data.get("candidates") or []):
        at = f"{where}: candidates[{i}]"
        _optional(c, at, "strategy", lambda v: isinstance(v, str), "a strategy name")
        total = _object(c.get("per_gpu_gib"), at, "per_gpu_gib").get("total")
        if not _number(total):
            raise _bad(at, "per_gpu_gib.total", "a number of GiB", total)
    for key in ("model", "hardware"):
        _optional(data, where, key, lambda v: isinstance(v, dict), "an object")


def preflight(data: Any, where: str) -> None:
    data = _object(data, where, "the file")
    _optional(data, where, "findings", _objects, "a list of objects")
    _optional(data, where, "strategy", lambda v: isinstance(v, str), "a strategy name")


def evaluation(data: Any, where: str) -> None:
    data = _object(data, where, "the file")
    models = data.get("models")
    if not isinstance(models, dict) or not models:  # every eval.json has its columns; without them it says nothing
        raise _bad(where, "models", "an object of model columns (shardfit eval writes one per model)", models)
    _optional(data, where, "metrics", lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v),
              "a list of metric names")
    _optional(data, where, "models", lambda v: isinstance(v, dict) and all(isinstance(c, dict) for c in v.values()),
              "an object of model columns")
    for name, col in (data.get("models") or {}).items():
        _optional(col, f"{where}: models.{name}", "metrics", lambda v: isinstance(v, dict), "an object")


def run_record(data: Any, where: str) -> None:
    """run.json: the fingerprint `train` writes as the run starts and compares when it resumes."""
    fix = ("train refuses to resume this run until it is restored (or started over with --set resume=never); the "
           "report reads nothing else from it")
    if not isinstance(data, dict):
        raise UserError(f"{where}: holds a JSON {type(data).__name__}, not the object with a fingerprint shardfit "
                        f"writes: {fix}.")
    if not isinstance(data.get("fingerprint"), dict):
        raise UserError(f"{where}: 'fingerprint' is {type(data.get('fingerprint')).__name__}, not an object of the "
                        f"run's settings: {fix}.")


SHAPES: dict[str, Callable[[Any, str], None]] = {"plan.json": plan, "summary.json": summary,
                                                 "preflight.json": preflight, "eval.json": evaluation,
                                                 "run.json": run_record}
