"""Score a pasted log against the known causes in causes.yaml and rank the matches."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import yaml

from shardfit.errors import UserError


@dataclass(frozen=True)
class Pattern:
    regex: re.Pattern
    weight: float


@dataclass(frozen=True)
class Cause:
    id: str
    title: str
    signatures: tuple[Pattern, ...]
    context: tuple[Pattern, ...]
    root_cause: str
    fix: str
    prevented_by: str


@dataclass
class Finding:
    category: str
    confidence: float
    title: str
    root_cause: str
    fix: str
    prevented_by: str

    def to_json(self) -> dict:
        return asdict(self)


def _patterns(items: list[dict], where: str) -> tuple[Pattern, ...]:
    out = []
    for item in items or []:
        try:
            out.append(Pattern(re.compile(item["re"], re.IGNORECASE | re.DOTALL), float(item["w"])))
        except (re.error, KeyError, TypeError) as e:
            raise UserError(f"{where}: bad pattern {item!r}: {e}") from None
    return tuple(out)


def load_causes(path: Path | None = None) -> list[Cause]:
    """Parse a causes file (the bundled one by default); errors name the cause."""
    path = path or Path(__file__).with_name("causes.yaml")
    return _load(str(path))


@cache
def _load(path: str) -> list[Cause]:
    raw = yaml.safe_load(Path(path).read_text())
    causes = []
    for i, entry in enumerate(raw):
        where = f"{path}: cause {entry.get('id', i)}"
        for key in ("id", "title", "signatures", "root_cause", "fix", "prevented_by"):
            if key not in entry:
                raise UserError(f"{where}: missing '{key}'")
        causes.append(Cause(entry["id"], entry["title"], _patterns(entry["signatures"], where),
                            _patterns(entry.get("context", []), where), " ".join(entry["root_cause"].split()),
                            " ".join(entry["fix"].split()), entry["prevented_by"]))
    return causes


def _normalise(text: str) -> str:
    # Logs arrive with ANSI colours, \r progress bars and wrapped lines; the regexes want plain text.
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    return text.replace("\r", "\n")


def score(cause: Cause, text: str) -> float:
    """Sum of matched signature weights (0 when none matches) plus matched context weights, floored at 0."""
    sig = sum(p.weight for p in cause.signatures if p.regex.search(text))
    if sig == 0:
        return 0.0
    ctx = sum(p.weight for p in cause.context if p.regex.search(text))
    return max(sig + ctx, 0.0)


def diagnose(text: str, causes: list[Cause] | None = None, limit: int = 3) -> list[Finding]:
    """Ranked findings for a pasted log, best first; an empty list when no known cause matches."""
    causes = causes if causes is not None else load_causes()
    text = _normalise(text)
    scored = sorted(((score(c, text), i, c) for i, c in enumerate(causes)), key=lambda t: (-t[0], t[1]))
    out = []
    for s, _, c in scored[:limit]:
        if s <= 0:
            break
        out.append(Finding(c.id, round(1 - math.exp(-s / 2.0), 3), c.title, c.root_cause, c.fix, c.prevented_by))
    return out
