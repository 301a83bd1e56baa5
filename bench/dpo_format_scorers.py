"""The two formats bench/dpo_format.py counts in greedy answers (`shardfit eval --metric py:FILE:FUNC`)."""

from __future__ import annotations

import re

RECORD = re.compile(r"name=[^;\n]+; city=[^;\n]+; ext=\d+")
PROSE = re.compile(r"[^()\n]+ \([^()\n]+\), extension \d+")


def record_format(prediction: str, expected: str, row: object) -> bool:
    """The answer is the chosen format: `name=...; city=...; ext=...`."""
    return RECORD.fullmatch(prediction.strip()) is not None


def prose_format(prediction: str, expected: str, row: object) -> bool:
    """The answer is the rejected format: `Name (City), extension N`."""
    return PROSE.fullmatch(prediction.strip()) is not None
