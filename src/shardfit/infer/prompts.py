"""Prompts from files: every row format training reads (alpaca, ShareGPT, OpenAI messages) plus plain
{"prompt": ..., "expected": ...}. A row that ends with an answer gives the prompt before it and that answer as
what is expected (a held-out set); a row without one is a prompt only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfit.data.formats import ALPACA, OPENAI, BadRow, detect_format, to_messages
from shardfit.data.reader import _Broken, read_rows
from shardfit.errors import UserError

Messages = list[dict[str, str]]


@dataclass
class Request:
    """A conversation to answer (ending with a user turn), the answer expected (None when the row has none), the
    raw row (a py: scorer sees it) and where it came from."""

    messages: Messages
    expected: str | None
    row: Any
    where: str


def _with_placeholder(row: dict[str, Any], fmt: str) -> tuple[dict[str, Any], bool]:
    """The row with an empty final answer added when it has none, and whether it had one."""
    if fmt == ALPACA:
        return ({**row, "output": row.get("output", "")}, "output" in row)
    if fmt == OPENAI:
        turns = row["messages"]
        if turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
            return row, True
        return {**row, "messages": [*turns, {"role": "assistant", "content": ""}]}, False
    turns = row["conversations"]
    last = turns[-1] if turns and isinstance(turns[-1], dict) else {}
    if str(last.get("from", "")).lower() in ("gpt", "assistant", "model", "chatgpt", "bing", "bard"):
        return row, True
    return {**row, "conversations": [*turns, {"from": "gpt", "value": ""}]}, False


def request_of(row: Any, where: str, system: str | None = None) -> Request:
    """One row as a request; `system` is prepended when the row has no system turn of its own."""
    if isinstance(row, _Broken):
        raise UserError(f"{where}: {row.reason}.")
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        messages: Messages = [{"role": "user", "content": row["prompt"]}]
        expected = row.get("expected")
        if expected is not None and not isinstance(expected, str):
            raise UserError(f"{where}: 'expected' must be a string, got {type(expected).__name__}.")
    else:
        fmt = detect_format(row) or (ALPACA if isinstance(row, dict) and "instruction" in row else None)
        if fmt is None:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(f"{where}: unknown row (keys: {keys}); give {{\"prompt\": ...}}, alpaca (instruction), "
                            f"ShareGPT (conversations) or OpenAI (messages).")
        full, answered = _with_placeholder(row, fmt)
        try:
            converted = to_messages(full, fmt)
        except BadRow as e:
            raise UserError(f"{where}: {e}.") from None
        messages, expected = converted[:-1], converted[-1]["content"] if answered else None
    if system and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    if not messages or messages[-1]["role"] != "user":
        raise UserError(f"{where}: the conversation must end with a user turn to answer.")
    return Request(messages, expected, row, where)


def read_requests(path: str | Path, system: str | None = None, limit: int | None = None) -> list[Request]:
    """The requests of a .jsonl/.json file, in order (the first `limit` when given)."""
    out: list[Request] = []
    for r in read_rows(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(request_of(r.data, r.where, system))
    if not out:
        raise UserError(f"{path}: no rows.")
    return out





def requests_from_conversations(conversations: list[Messages], limit: int | None = None) -> list[Request]:
    """Held-out conversations as requests: the turns before the last assistant turn, and that turn as expected."""
    out: list[Request] = []
    for i, conv in enumerate(conversations):
        if limit is not None and len(out) >= limit:
            break
        last = max((k for k, m in enumerate(conv) if m["role"] == "assistant"), default=None)
        if last is None or last == 0:
            continue
        out.append(Request(conv[:last], conv[last]["content"], {"messages": conv}, f"eval example {i + 1}"))
    return out
