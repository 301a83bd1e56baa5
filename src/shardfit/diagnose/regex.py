"""The knowledge file's regexes as the engine holds them: compiled when first searched, each with its required words.

`shardfit diagnose` is often run once on one paste. Compiling the knowledge file's few hundred regexes and reading
the words each match must contain (literals.py) took about half a second of a one-off run, most of it for patterns
whose words the paste does not hold and that therefore never run. So a `Regex` compiles on its first search, and
the words come from literals.json, written beforehand from the bundled causes.yaml (`python -m
shardfit.diagnose.regex --write`; tests/test_diagnose_literals.py holds the table to a fresh reading, so it cannot
drift). A pattern the table lacks (a causes file of the user's own, an edited one) is compiled and read at load, as
before: its errors are reported there, naming the cause.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import yaml

from shardfit.diagnose.literals import Needles, required_literals

HERE = Path(__file__).parent
TABLE = HERE / "literals.json"
# The flags the engine compiles with: `re` items and named facts search the text line-wise (multi-line); `exc` and
# frame items a message that may span lines (dot-all).
RE_FLAGS = re.I | re.M
EXC_FLAGS = re.I | re.S
REGEX_KINDS = ("re", "exc", "any_exc", "frame", "cut_frame")


class Regex:
    """A regex compiled on its first use, with `needles`: words one of which any match holds (None: no shortcut)."""

    __slots__ = ("pattern", "flags", "needles", "_compiled")

    def __init__(self, pattern: str, flags: int, needles: Needles | None,
                 compiled: re.Pattern | None = None) -> None:
        self.pattern, self.flags, self.needles, self._compiled = pattern, flags, needles, compiled

    def compiled(self) -> re.Pattern:
        if self._compiled is None:
            self._compiled = re.compile(self.pattern, self.flags)
        return self._compiled

    def search(self, text: str) -> re.Match | None:
        return self.compiled().search(text)

    def findall(self, text: str) -> list:
        return self.compiled().findall(text)

    def __eq__(self, other: object) -> bool:  # as re.Pattern objects compare: two loads of one file are equal
        return isinstance(other, Regex) and (self.pattern, self.flags) == (other.pattern, other.flags)

    def __hash__(self) -> int:
        return hash((self.pattern, self.flags))

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r}, {self.flags})"


def key(pattern: str, flags: int) -> str:
    """The table's key of a pattern under its flags."""
    return f"{int(flags)}:{pattern}"


@cache
def _table(path: Path = TABLE) -> dict[str, list[str] | None]:
    """The bundled table, or an empty one where it is missing or damaged (that only costs the time it saves): a
    value that is not a list of words would skip a regex it must not."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(table, dict) and all(
        v is None or (isinstance(v, list) and v and all(isinstance(w, str) and w for w in v)) for v in table.values())
    return table if ok else {}


def regex(pattern: str, flags: int) -> Regex:
    """The lazy Regex of `pattern`; one the table does not hold is compiled now (re.error propagates to the
    caller, which names where the pattern came from)."""
    table = _table()
    k = key(pattern, flags)
    if k in table:
        words = table[k]
        return Regex(pattern, flags, tuple(words) if words is not None else None)
    compiled = re.compile(pattern, flags)
    return Regex(pattern, flags, required_literals(compiled), compiled)


def fresh_table(raw: dict) -> dict[str, list[str] | None]:
    """The table of a parsed causes file: every pattern the engine compiles (named facts, items of every regex
    kind, quotes, generic steps) under its flags, mapped to its required words."""
    patterns = [(p, RE_FLAGS) for p in (raw.get("facts") or {}).values()]
    for cause in raw.get("causes") or []:
        for part in ("signatures", "context", "veto", "hints"):
            for item in cause.get(part) or []:
                patterns += [(item[k], RE_FLAGS if k == "re" else EXC_FLAGS) for k in REGEX_KINDS if k in item]
        patterns += [(cause["quote"], RE_FLAGS)] if cause.get("quote") else []
    patterns += [(g["exc"], EXC_FLAGS) for g in raw.get("generic") or []]
    out: dict[str, list[str] | None] = {}
    for pattern, flags in patterns:
        words = required_literals(re.compile(pattern, flags))
        out[key(pattern, flags)] = list(words) if words is not None else None
    return dict(sorted(out.items()))


def write_table() -> int:
    """Write literals.json from the bundled causes.yaml; returns its number of patterns."""
    table = fresh_table(yaml.safe_load((HERE / "causes.yaml").read_text()))
    TABLE.write_text(json.dumps(table, indent=0, ensure_ascii=False, sort_keys=True) + "\n")
    return len(table)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m shardfit.diagnose.regex --write")
    print(f"{TABLE}: {write_table()} patterns")
