"""Load a YAML config, apply `--set key=value` overrides, and validate every key and type.

Every user mistake becomes a `UserError` (exit code 2) naming the file, line and key, with a "did you mean"
for near misses. Nothing here imports torch, so `shardfit plan`/`check` start fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import socket
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Union

import yaml

from shardfit import method, objective
from shardfit.config.paths import close_sibling, exists_here, looked_in, refuse_no_path
from shardfit.config.schema import CHOICES, COLUMN_FIELDS, REPORT_TO, Config, DpoSettings, LoraSettings, QLoraSettings
from shardfit.config.support import adapter_dtype_problem
from shardfit.config.targets import targets_problem
from shardfit.errors import UserError

# The sections of the config: mappings of keys of their own (`lora.rank`), each a dataclass.
SECTIONS = {LoraSettings: "{rank: 8, alpha: 16}", QLoraSettings: "{quant_type: nf4, compute_dtype: auto}",
            DpoSettings: "{beta: 0.1, loss: sigmoid}"}
_HINTS = {cls: typing.get_type_hints(cls) for cls in (Config, *SECTIONS)}


# A YAML document whose aliases expand beyond this many nodes is refused: each alias is a reference to a node
# defined earlier, so a few lines can stand for billions of values (a "billion laughs" document).
MAX_YAML_NODES = 100_000
# Lists in lists in mappings...: a config nests two or three levels; PyYAML's composer recurses per level and
# overflows Python's stack near a few hundred.
MAX_YAML_DEPTH = 64


def read_yaml(p: Path) -> tuple[Any, dict[str, int]]:
    """The YAML document of `p` and the line of each dotted key (`lora.rank`), for error messages. Text that is
    not UTF-8, not YAML, a recursive anchor or an alias bomb is a UserError naming the file (and line)."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); a config is a YAML "
                        "text file. Is this a binary, compressed or Latin-1 file? Save it as UTF-8.") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read the config: {e.strerror}.") from None
    try:
        _check_depth(text, p)
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}{line}: not valid YAML: {getattr(e, 'problem', e)}.") from None
    if root is None:
        return None, {}
    _expanded_size(root, p)
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                line = key_node.start_mark.line + 1
                if key in lines and lines[key] != line:  # YAML keeps the last silently; one of them is a mistake
                    raise UserError(f"{p}:{line}: '{key}' is given twice (also on line {lines[key]}); keep one.")
                lines[key] = line
                walk(value_node, key + ".")

    walk(root, "")
    try:
        return yaml.safe_load(text), lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}{line}: not valid YAML: {getattr(e, 'problem', e)}.") from None


def _check_depth(text: str, p: Path) -> None:
    """A UserError for a document nested deeper than MAX_YAML_DEPTH, found from the parser's events (which keep
    no stack of their own) before the composer, which recurses once per level, would overflow Python's stack."""
    depth = 0
    for event in yaml.parse(text):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise UserError(f"{p}:{event.start_mark.line + 1}: the YAML is nested more than {MAX_YAML_DEPTH} "
                                "levels deep; a config needs two or three. Is this the file you meant?")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _expanded_size(root: yaml.Node, p: Path) -> int:
    """How many nodes the document stands for once its aliases are expanded; a UserError past MAX_YAML_NODES or
    for an anchor that contains itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_:
            raise UserError(f"{p}:{node.start_mark.line + 1}: a YAML anchor refers to itself; write the value out.")
        open_.add(id(node))
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1 + sum(size(c) for c in children)
        open_.discard(id(node))
        sizes[id(node)] = total
        if total > MAX_YAML_NODES:
            raise UserError(f"{p}:{node.start_mark.line + 1}: the YAML expands to more than {MAX_YAML_NODES:,} "
                            "values through its aliases (&anchor / *alias); a config needs a few dozen.")
        return total

    return size(root)


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _choice(value: Any) -> str:
    """A choice as YAML spells it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(v) for v in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """Return (ok, value) for `value` checked against a type hint, converting only safe cases."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, out = _coerce(value, arm)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is typing.Literal:
        return value in typing.get_args(hint), value
    if hint is Any:
        return True, value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return False, value
        (item_hint,) = typing.get_args(hint) or (Any,)
        out = []
        for item in value:
            ok, item = _coerce(item, item_hint)
            if not ok:
                return False, value
            out.append(item)
        return True, out
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # PyYAML reads `1e-4` as a string (YAML 1.1); accept what users mean
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _build(cls: type, raw: dict[str, Any], where: str, lines: dict[str, int], prefix: str = "") -> Any:
    hints = _HINTS[cls]
    names = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        loc = f"{where}:{lines[dotted]}" if dotted in lines else where
        if key not in names:
            raise UserError(
                f"{loc}: unknown config key '{dotted}'{_suggest(str(key), names)}. "
                f"Valid keys: {', '.join(names)}."
            )
        hint = hints[key]
        if hint in SECTIONS:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise UserError(f"{loc}: '{dotted}' must be a mapping such as {SECTIONS[hint]}, got {value!r}.")
            kwargs[key] = _build(hint, value, where, lines, prefix=f"{dotted}.")
            continue
        ok, value = _coerce(value, hint)
        if not ok:
            raise UserError(f"{loc}: '{dotted}' must be {_type_name(hint)}, got {value!r} ({type(value).__name__}).")
        if dotted in CHOICES and value not in CHOICES[dotted]:
            raise UserError(
                f"{loc}: '{dotted}' is '{value}'{_suggest(str(value), [str(c) for c in CHOICES[dotted]])}; "
                f"choose one of: {', '.join(_choice(c) for c in CHOICES[dotted])}."
            )
        kwargs[key] = value
    return cls(**kwargs)


def parse_overrides(overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Turn `["lr=1e-4", "lora.rank=16"]` into a nested dict; values are parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set '{item}': expected key=value, e.g. --set lr=1e-4 or --set lora.rank=16.")
        key, _, text = item.partition("=")
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set '{item}': '{part}' is not a mapping.")
        node[parts[-1]] = value
    return nested


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class NotHere:
    """A data file the config names with nothing at it on this machine (check's warning: the run may train where
    it is)."""

    key: str  # data or eval_data
    path: str  # as the config gives it
    looked_in: tuple[str, ...] = ()  # the folders a relative path was tried in (the cwd, the config's folder)
    near: str = ""  # a close name that is here, not surely the one meant (config/paths.py `likeness`)
    link: str = ""  # where a link at the path points, when that is not here

    def describe(self) -> str:
        """The path, where a link at it points, and where it was looked for, for a message."""
        link = f" (a link to {self.link}, which is not here)" if self.link else ""
        return f"{self.path}{link}{looked_in(self.looked_in)}"

    def hint(self) -> str:
        """A close name that is here, as a question ending a message; nothing without one."""
        return f" A close name is here: did you mean {self.near}?" if self.near else ""


def _data_path(path: str, loc: str, key: str) -> Path:
    """The path a data value names, `~` expanded; a value that can be no file on any machine (a URL, the home of a
    user this machine does not know) is a UserError naming the key."""
    if re.match(r"^[A-Za-z][\w+.-]*://", path):
        raise UserError(f"{loc}: '{key}' is a URL ({path}); shardfit reads local files. Download it and give the "
                        "path to the .json or .jsonl file.")
    try:
        return Path(path).expanduser()
    except RuntimeError:  # `~user/...` of a user this machine does not know
        raise UserError(f"{loc}: '{key}' names the home of a user {socket.gethostname()} does not know ({path}). "
                        "Give the file's full path.") from None


def _refuse_folder(p: Path, loc: str, key: str) -> None:
    """A data value must be a file: a folder is refused naming the key, with the data files it holds."""
    if not p.is_dir():
        return
    try:
        files = sorted(f.name for f in p.iterdir() if f.suffix in (".json", ".jsonl"))[:5]
        held = f" (it holds {', '.join(files)})" if files else " (it holds no .json or .jsonl file)"
    except OSError:  # a folder this user may not list: refused all the same, without its contents
        held = ""
    raise UserError(f"{loc}: '{key}' {p} is a folder{held}; give the path of the .json or .jsonl file in it.")


def _check_paths(cfg: Config, where: str, lines: dict[str, int], base_dir: Path | None,
                 absent: list[NotHere] | None = None) -> Config:
    """Data files must exist; relative paths are tried against the cwd, then the config file's folder. With
    `absent` (check), a file with nothing at it here is listed there and kept as given instead of refused."""

    def resolve(key: str, path: str) -> str:
        loc = f"{where}:{lines[key]}" if key in lines else where
        p = _data_path(path, loc, key)
        tries = [p] if p.is_absolute() or base_dir is None else [p, base_dir / p]
        for t in tries:
            if exists_here(t, f"{loc}: '{key}' {t}"):
                _refuse_folder(t, loc, key)
                exists_here(t, f"{loc}: '{key}' {t}", read=True)  # as train reads it (and hashes it first)
                return str(t)
        refuse_no_path(path, tries, f"{loc}: '{key}'", key)
        near = None
        for t in tries:
            near = near or close_sibling(t, named)
            if near is not None and near.sure:  # the folder is here: a typo, not storage this machine lacks
                raise UserError(f"{loc}: '{key}' file not found: {path}; did you mean {near.path}?")
        looked = () if p.is_absolute() else tuple(dict.fromkeys(  # the working directory, then the config's folder
            os.path.abspath(b) for b in [Path.cwd(), *([base_dir] if base_dir is not None else [])]))
        link = next((os.readlink(t) for t in tries if t.is_symlink()), "")
        gone = NotHere(key, path, looked, str(near.path) if near else "", link)
        if absent is None:
            raise UserError(f"{loc}: '{key}' file not found: {gone.describe()}. Give a path to a .json or .jsonl "
                            f"file.{gone.hint()}")
        absent.append(gone)
        return path

    def resolve_all(key: str, value: str | list[str] | None) -> str | list[str] | None:
        if value is None:
            return None
        if isinstance(value, list):
            return [resolve(key, v) for v in value]
        return resolve(key, value)

    given = [v for value in (cfg.data, cfg.eval_data) for v in ([value] if isinstance(value, str) else value or [])]
    named = (*given, *(base_dir / v for v in given if base_dir is not None))  # never suggested as a typo's match
    cfg.data = resolve_all("data", cfg.data)  # type: ignore[assignment]
    cfg.eval_data = resolve_all("eval_data", cfg.eval_data)
    return cfg


def _number(x: float) -> str:
    """A bound or value as the user would write it: integers whole (a seed's bound is not 1.84467e+19)."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_error(value: Any, meta: dict[str, Any]) -> str | None:
    """What is wrong with `value` against a key's declared range, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}."
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ge, gt, lt = meta.get("ge"), meta.get("gt"), meta.get("lt")
        if ge is not None and value < ge:
            return f"must be at least {_number(ge)}, got {_number(value)}."
        if gt is not None and value <= gt:
            return f"must be greater than {_number(gt)}, got {_number(value)}."
        if lt is not None and value >= lt:
            return f"must be below {_number(lt)}, got {_number(value)}."
    if meta.get("nonempty"):
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(v, str) and not v.strip() for v in items):
            return "must not be empty."
    return None


def validate(cfg: Config, where: str = "config", lines: dict[str, int] | None = None) -> Config:
    """Every key against its declared range (schema metadata), then the checks that span keys."""
    lines = lines or {}

    def fail(key: str, msg: str) -> None:
        loc = f"{where}:{lines[key]}" if key in lines else where
        raise UserError(f"{loc}: '{key}' {msg}")

    for obj, prefix in ((cfg, ""), (cfg.lora, "lora."), (cfg.qlora, "qlora."), (cfg.dpo, "dpo.")):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if value is None or dataclasses.is_dataclass(value):
                continue
            problem = _range_error(value, f.metadata)
            if problem:
                fail(prefix + f.name, problem)
    # shardfit's own targets refuse even a partial miss: peft would skip the entry and train fewer adapters.
    if method.get(cfg.method).adapters and (problem := targets_problem(cfg.lora.targets,
                                                                      skip_partial=False)) is not None:
        fail("lora.targets", problem.message)
    if not cfg.qlora.double_quant:
        fail("qlora.double_quant", "is false, but torchao's NF4 weights always quantize their block scales (double "
             "quantization: 0.127 bit per weight instead of 0.5, the QLoRA paper's choice). Remove the key or set "
             "it to true.")
    for name in cfg.report_to:
        if name not in REPORT_TO:
            fail("report_to", f"has '{name}'{_suggest(name, REPORT_TO)}; choose from: {', '.join(REPORT_TO)}.")
    if "none" in cfg.report_to and len(cfg.report_to) > 1:
        fail("report_to", f"lists 'none' with others ({cfg.report_to}); use none alone, or leave it out.")
    for spec in cfg.eval_metrics:
        problem = metric_spec_problem(spec)
        if problem:
            fail("eval_metrics", problem)
    for field_name, column in cfg.data_columns.items():
        if field_name not in COLUMN_FIELDS:
            fail("data_columns", f"has '{field_name}'{_suggest(field_name, COLUMN_FIELDS)}: the fields are "
                 f"{', '.join(COLUMN_FIELDS)}, each mapped to the column of your rows that holds it.")
        if not isinstance(column, str) or not column:
            fail("data_columns", f"maps '{field_name}' to {column!r}; give the column's name as a string.")
    if cfg.dpo.precompute_reference is False and objective.get(cfg.objective).reference \
            and not method.get(cfg.method).adapters:
        fail("dpo.precompute_reference", f"is false, but method {cfg.method} has no adapters to switch off for the "
             "reference: set it to auto or true (the reference's log-probabilities are computed once before the "
             "first step, with no second copy of the weights).")
    if problem := objective.micro_batch_problem(cfg.objective, cfg.micro_batch):
        fail("micro_batch", f"is {cfg.micro_batch}, but {problem}. Set micro_batch: 2 or more (lower max_seq_len or "
             "use grad_ckpt: full if memory is short).")
    problem = adapter_dtype_problem(cfg)
    if problem:
        fail("lora.dtype", problem)
    if cfg.method == "freeze" and not cfg.freeze_trainable:
        fail("freeze_trainable", "is empty: method 'freeze' needs module name patterns that train, "
             "e.g. freeze_trainable: ['layers.11', 'norm'].")
    return cfg


def metric_spec_problem(spec: str) -> str | None:
    """What is wrong with a generation metric spec (exact | contains | regex:PATTERN | py:FILE:FUNC), or None.
    Only the form is checked here; a py: scorer's file and function are checked when they are loaded."""
    if spec in ("exact", "contains"):
        return None
    kind, _, rest = spec.partition(":")
    if kind == "regex" and rest:
        try:
            re.compile(rest)
        except re.error as e:
            return f"has '{spec}': not a valid regular expression ({e})."
        return None
    if kind == "py" and rest.rpartition(":")[0] and rest.rpartition(":")[2]:
        return None
    return (f"has '{spec}'{_suggest(spec, ('exact', 'contains'))}; a metric is exact, contains, regex:PATTERN "
            "or py:FILE.py:FUNCTION.")


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    defaults: dict[str, Any] | None = None,
    check_files: bool = True,
    absent: list[NotHere] | None = None,
) -> Config:
    """Read `path` (YAML) over `defaults`, apply `--set` overrides, validate, and return a `Config`. Data files
    with nothing at them are refused, or, given `absent` (check, which may not run where the run trains), listed
    there."""
    raw: dict[str, Any] = dict(defaults or {})
    where = "config"
    lines: dict[str, int] = {}
    base_dir = None
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise UserError(f"config file not found: {p}. Pass a YAML file, e.g. `shardfit train my.yaml`.")
        loaded, lines = read_yaml(p)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{p}: the config must be a mapping of keys (model: ..., data: ...), "
                            f"got {type(loaded).__name__}.")
        raw = _merge(raw, loaded)
        base_dir = p.parent
    if overrides:
        raw = _merge(raw, parse_overrides(overrides))
        for key in _flatten(parse_overrides(overrides)):
            lines.pop(key, None)
    cfg = _build(Config, raw, where, lines)
    cfg = validate(cfg, where, lines)
    if check_files:
        cfg = _check_paths(cfg, where, lines, base_dir, absent)
    return cfg


def _flatten(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out.extend(_flatten(v, prefix + k + "."))
    return out
