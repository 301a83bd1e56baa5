"""The dev/test split of the real-case corpus (cases.yaml), fixed before any rule was tuned on it.

A case is in `test` when the SHA-256 of its thread URL is odd, `dev` otherwise: a deterministic per-thread coin flip
that needs no stored state and puts each thread on exactly one side. Rules and calibration were tuned on `dev` (and on
tests/diagnose_corpus + tests/diagnose_public) only; `test` is the held-out part reported in docs/diagnose.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

CASES = Path(__file__).with_name("cases.yaml")


def split_of(url: str) -> str:
    return "test" if int(hashlib.sha256(url.encode()).hexdigest(), 16) % 2 else "dev"


def load_cases(part: str | None = None) -> list[dict]:
    """All cases (part=None) or those of one part ('dev' / 'test'), each with its 'split' added."""
    cases = yaml.safe_load(CASES.read_text())
    for c in cases:
        c["split"] = split_of(c["url"])
    return [c for c in cases if part is None or c["split"] == part]
