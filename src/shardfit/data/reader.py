"""Read rows from .jsonl (one object per line) or .json (an array of objects), keeping where each came from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfit.errors import UserError


@dataclass(frozen=True)
class Row:
    """One raw example and its origin, so every later error can say `file:line`."""

    data: Any
    where: str


def read_rows(path: str | Path) -> Iterator[Row]:
    """Yield the rows of one data file. Undecodable JSON raises `UserError` naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"data file not found: {p}")
    text = _read_text(p)
    stripped = text.lstrip()
    if p.suffix == ".json" or stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{e.lineno}: not valid JSON ({e.msg}). A .json file holds one array of objects; "
                            f"use .jsonl for one object per line.") from None
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            raise UserError(f"{p}: expected a JSON array of objects, got {type(items).__name__}.")
        for i, item in enumerate(items):
            yield Row(item, f"{p}: item {i}")
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield Row(json.loads(line), f"{p}:{lineno}")
        except json.JSONDecodeError as e:
            yield Row(_Broken(f"not valid JSON ({e.msg} at column {e.colno})"), f"{p}:{lineno}")


# Magic bytes of files people pass by mistake, and what they are.
_BINARY = {b"\x1f\x8b": "gzip-compressed", b"PAR1": "a Parquet file", b"PK\x03\x04": "a zip archive",
           b"\x89HDF": "an HDF5 file", b"ARROW1": "an Arrow file"}


def _read_text(p: Path) -> str:
    """The file as UTF-8 text; a binary or non-UTF-8 file is a UserError that says what it looks like."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"{p}: cannot read the data file: {e.strerror}.") from None
    for magic, what in _BINARY.items():
        if raw.startswith(magic):
            raise UserError(f"{p}: this is {what}, not JSON lines. Convert it to .jsonl (one JSON object per line) "
                            "or .json (an array of objects).")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); data files are UTF-8 JSON. "
                        "Re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8).") from None


@dataclass(frozen=True)
class _Broken:
    """A line that did not parse; kept as a row so `skip_bad_rows` can count it instead of stopping."""

    reason: str
