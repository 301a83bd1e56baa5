"""Scorers: `exact`, `contains`, `regex:PATTERN`, `py:FILE:FUNC`. Each maps (prediction, expected, row) to a score
in [0, 1]; a metric is the mean over the examples.

- exact: the prediction equals the expected answer (surrounding whitespace ignored).
- contains: the expected answer appears in the prediction (case-insensitive).
- regex:PATTERN: the pattern's first match (its first group when it has one) is taken from the prediction and from
  the expected answer, and the two are compared; an expected answer the pattern does not match is compared whole.
  `regex:answer is (\\d+)` scores GSM8K-style answers.
- py:FILE:FUNC: `FUNC(prediction, expected, row)` from the Python file FILE, returning a bool or a number.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfit.errors import UserError

ScoreFn = Callable[[str, str, Any], float]


@dataclass(frozen=True)
class Scorer:
    name: str  # the key in JSON and metrics.jsonl: exact, contains, regex, or the py function's name
    spec: str
    fn: ScoreFn

    def score(self, prediction: str, expected: str, row: Any, where: str) -> float:
        try:
            value = self.fn(prediction, expected, row)
        except Exception as e:  # noqa: BLE001 - a user's scorer failing is bad input, reported with its row
            raise UserError(f"metric {self.spec} failed on {where}: {type(e).__name__}: {e}") from None
        if isinstance(value, bool) or isinstance(value, (int, float)):
            return float(value)
        raise UserError(f"metric {self.spec} returned {type(value).__name__} for {where}; return a bool or a number.")


def _exact(prediction: str, expected: str, row: Any) -> float:
    return float(prediction.strip() == expected.strip())


def _contains(prediction: str, expected: str, row: Any) -> float:
    return float(expected.strip().lower() in prediction.lower())


def _regex(pattern: str) -> ScoreFn:
    compiled = re.compile(pattern)

    def extract(text: str) -> str | None:
        m = compiled.search(text)
        if m is None:
            return None
        return (m.group(1) if compiled.groups else m.group(0)).strip()

    def score(prediction: str, expected: str, row: Any) -> float:
        got = extract(prediction)
        want = extract(expected)
        return float(got is not None and got == (want if want is not None else expected.strip()))

    return score


def _python(spec: str, path: str, func: str) -> ScoreFn:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"metric {spec}: no file {file}; give py:PATH/TO/scorer.py:FUNCTION.")
    module_spec = importlib.util.spec_from_file_location(f"shardfit_scorer_{file.stem}", file)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"metric {spec}: {file} is not a Python file.")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: its error is the message
        raise UserError(f"metric {spec}: importing {file} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise UserError(f"metric {spec}: {file} has no function {func} (it has: {', '.join(names) or 'none'}).")
    return fn


def parse_metric(spec: str) -> Scorer:
    """The scorer a spec names; a UserError with the accepted forms otherwise."""
    if spec == "exact":
        return Scorer("exact", spec, _exact)
    if spec == "contains":
        return Scorer("contains", spec, _contains)
    kind, _, rest = spec.partition(":")
    if kind == "regex" and rest:
        try:
            return Scorer("regex", spec, _regex(rest))
        except re.error as e:
            raise UserError(f"metric {spec}: not a valid regular expression ({e}).") from None
    if kind == "py":
        path, _, func = rest.rpartition(":")
        if path and func:
            return Scorer(func, spec, _python(spec, path, func))
    raise UserError(f"metric {spec!r}: use exact, contains, regex:PATTERN or py:FILE.py:FUNCTION.")


def parse_metrics(specs: list[str]) -> list[Scorer]:
    """Scorers for `specs`, refusing two that would write the same key."""
    scorers = [parse_metric(s) for s in specs]
    names = [s.name for s in scorers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"metrics {specs}: two of them are named {dup[0]}; keep one per kind.")
    return scorers


def _may_bind(tree: ast.Module, name: str) -> bool:
    """Whether the module could define `name` when run: a def or class of that name, an assignment or import that
    binds it anywhere (under `if`, `try`, in a tuple), or a star import (which could bind anything)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                a.name == "*" or (a.asname or a.name).split(".")[0] == name for a in node.names):
            return True
    return False


def _defined(tree: ast.Module) -> list[str]:
    """The functions a module defines at its top level, to name in a refusal."""
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not n.name.startswith("_")]


def check_metrics(specs: list[str]) -> None:
    """What parse_metrics refuses, decided without running anything: a `py:` file is read and parsed, never
    imported, so that `check` runs none of the code a config names (train's ranks import it, as the user asked).
    Only what the file's text settles is refused (no file, not Python, no binding of the name anywhere in it); a
    name bound under `if` or by a star import passes, and the import itself decides at train. A UserError naming
    the metric otherwise."""
    names = []
    for spec in specs:
        kind, _, rest = spec.partition(":")
        path, _, func = rest.rpartition(":")
        if kind != "py" or not (path and func):
            names.append(parse_metric(spec).name)
            continue
        file = Path(path).expanduser()
        if not file.is_file():
            raise UserError(f"metric {spec}: no file {file}; give py:PATH/TO/scorer.py:FUNCTION.")
        try:
            tree = ast.parse(file.read_bytes(), filename=str(file))
        except (SyntaxError, ValueError) as e:
            raise UserError(f"metric {spec}: {file} is not valid Python ({e}).") from None
        if not _may_bind(tree, func):
            raise UserError(f"metric {spec}: {file} has no function {func} (it has: "
                            f"{', '.join(_defined(tree)) or 'none'}).")
        names.append(func)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"metrics {specs}: two of them are named {dup[0]}; keep one per kind.")
