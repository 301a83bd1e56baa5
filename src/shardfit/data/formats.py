"""The three formats users bring, each turned into OpenAI-style messages: [{"role": ..., "content": ...}].

- alpaca: {"instruction", "input"?, "output", "system"?, "history"?}
- ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}], "system"?}
- OpenAI messages: {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}
"""

from __future__ import annotations

from typing import Any

ALPACA, SHAREGPT, OPENAI = "alpaca", "sharegpt", "openai"

_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
}


class BadRow(ValueError):
    """A row that does not fit its file's format; the message says what is wrong, the caller adds file:line."""


def rename_columns(row: Any, columns: dict[str, str]) -> Any:
    """`row` with each format field read from the column `columns` names for it ({field: column}, the config's
    data_columns); a column the row lacks is left to the format's own checks."""
    if not columns or not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns.values()}
    for field, column in columns.items():
        if column in row:
            out[field] = row[column]
    return out


def detect_format(row: Any) -> str | None:
    """The format of one row, or None when it matches none. An alpaca row may leave out the instruction when its
    input holds the whole prompt (as LLaMA-Factory reads it)."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        return OPENAI
    if isinstance(row.get("conversations"), list):
        return SHAREGPT
    if ("instruction" in row or "input" in row) and "output" in row:
        return ALPACA
    return None


def detect_preference(row: Any) -> str | None:
    """"pairs" (chosen and rejected), "unpaired" (completion + label, or kto_tag) or None for one row: the layouts
    data/preference.py reads, which the SFT reader names when it meets them."""
    if not isinstance(row, dict):
        return None
    if "chosen" in row and "rejected" in row:
        return "pairs"
    if ("completion" in row and "label" in row) or "kto_tag" in row:
        return "unpaired"
    return None


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise BadRow(f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800" from a JSON escape: no tokenizer takes it
        raise BadRow(f"{what} holds an unpaired surrogate {value[e.start]!r} at character {e.start}; a JSON escape "
                     "like \\ud800 must come in a pair") from None
    return value


def to_messages(row: Any, fmt: str) -> list[dict[str, str]]:
    """Convert one row of format `fmt` to messages; raise `BadRow` when it does not fit."""
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}")
    messages: list[dict[str, str]] = []
    if fmt == ALPACA:
        for key in ("instruction", "output"):
            if key not in row and not (key == "instruction" and row.get("input")):
                raise BadRow(f"alpaca row without '{key}' (keys: {', '.join(row) or 'none'})")
        if row.get("system"):
            messages.append({"role": "system", "content": _text(row["system"], "'system'")})
        for pair in row.get("history") or []:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise BadRow("'history' must be a list of [user, assistant] pairs")
            messages.append({"role": "user", "content": _text(pair[0], "history user turn")})
            messages.append({"role": "assistant", "content": _text(pair[1], "history assistant turn")})
        prompt = _text(row["instruction"], "'instruction'") if "instruction" in row else ""
        extra = row.get("input") or ""
        if extra:
            # No instruction at all (a column map that gives only the input): the input is the whole prompt.
            prompt = f"{prompt}\n\n{_text(extra, 'input')}" if "instruction" in row else _text(extra, "input")
        messages.append({"role": "user", "content": prompt})
        messages.append({"role": "assistant", "content": _text(row["output"], "'output'")})
    elif fmt == SHAREGPT:
        turns = row.get("conversations")
        if not isinstance(turns, list):
            raise BadRow("ShareGPT row without a 'conversations' list")
        if row.get("system"):
            messages.append({"role": "system", "content": _text(row["system"], "'system'")})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise BadRow(f"conversations[{i}] needs 'from' and 'value'")
            role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise BadRow(f"conversations[{i}]: unknown speaker '{turn['from']}' (use human, gpt or system)")
            messages.append({"role": role, "content": _text(turn["value"], f"conversations[{i}].value")})
    elif fmt == OPENAI:
        turns = row.get("messages")
        if not isinstance(turns, list):
            raise BadRow("row without a 'messages' list")
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
                raise BadRow(f"messages[{i}] needs 'role' and 'content'")
            role = turn["role"]
            if role not in ("system", "user", "assistant"):
                raise BadRow(f"messages[{i}]: unknown role '{role}' (use system, user or assistant)")
            messages.append({"role": role, "content": _text(turn["content"], f"messages[{i}].content")})
    else:
        raise BadRow(f"unknown format {fmt}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn: nothing to train on")
    return messages
