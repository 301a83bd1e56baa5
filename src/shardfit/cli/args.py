"""Argument types for the command line: a bad number stops at parse time with exit 2 and the usage line."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (ranks, nodes, tokens, rows)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def token_count(text: str) -> int:
    """A length in tokens, as an integer or in the context-window shorthand users write ("8k", "32K", "128k"),
    where k is 1024 tokens: an "8k context" is 8,192 tokens in every model card and trainer config."""
    stripped = text.strip()
    per = 1024 if stripped[-1:] in ("k", "K") else 1
    digits = stripped[:-1] if per > 1 else stripped
    if not (digits.isascii() and digits.isdigit()):  # str.isdigit takes "²", which int() then refuses
        raise argparse.ArgumentTypeError(f"expected an integer or a length like 8k, got {text!r}")
    return positive_int(str(int(digits) * per))


def non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port (1-65535)."""
    value = int(_number(text, int))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(_number(text, float))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {value:g}")
    return value
