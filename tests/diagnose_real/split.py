"""The dev/test split of the real-case corpus (cases.yaml), fixed before any rule was tuned on it.

A case is in `test` when the SHA-256 of its thread URL is odd, `dev` otherwise: a deterministic per-thread coin flip
that needs no stored state and puts each thread on exactly one side. Rules and calibration were tuned on `dev` (and on
tests/diagnose_corpus + tests/diagnose_public) only; `test` is the held-out part reported in docs/diagnose.md.
"""

from __future__ import annotations

import copy
import hashlib
from functools import cache
from pathlib import Path

import yaml

CASES = Path(__file__).with_name("cases.yaml")


def split_of(url: str) -> str:
    return "test" if int(hashlib.sha256(url.encode()).hexdigest(), 16) % 2 else "dev"


@cache
def _parsed(text: str) -> list:
    """A corpus file's text as data, once per text: libyaml's safe loader, plain data as `yaml.safe_load` builds it
    (the pure-Python loader spends seconds on the larger corpora, which many tests read)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def read_corpus(path: Path) -> list:
    """The cases of a corpus file (a YAML list), as the file holds them now: a fresh copy on every call, so a
    caller may change it; parsed once per content in a test session."""
    return copy.deepcopy(_parsed(path.read_text()))


def load_cases(part: str | None = None) -> list[dict]:
    """All cases (part=None) or those of one part ('dev' / 'test'), each with its 'split' added."""
    cases = read_corpus(CASES)
    for c in cases:
        c["split"] = split_of(c["url"])
    return [c for c in cases if part is None or c["split"] == part]
