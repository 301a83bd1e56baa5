"""LLaMA-Factory's dataset_info.json `columns` (where a dataset's rows keep each part) as shardfit's data_columns."""

from __future__ import annotations

from typing import Any

# dataset_info.json's `columns` (LLaMA-Factory's names of a row's parts) as shardfit's data_columns fields.
COLUMNS = {"alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                      "history": "history"},
           "sharegpt": {"messages": "conversations", "system": "system"}}


def data_columns(entry: dict[str, Any], name: str, notes: list[str]) -> dict[str, str]:
    """shardfit's data_columns ({field: column}) for one dataset_info.json entry; what cannot be carried is noted.
    ShareGPT rows tagged role/content are OpenAI messages to shardfit."""
    formatting = str(entry.get("formatting", "alpaca"))
    columns = entry.get("columns") or {}
    if formatting not in COLUMNS or not isinstance(columns, dict):
        notes.append(f"dataset {name}: formatting {formatting!r} is not carried (shardfit reads alpaca, ShareGPT "
                     "and OpenAI messages)")
        return {}
    fields = dict(COLUMNS[formatting])
    if (entry.get("tags") or {}).get("role_tag") == "role":
        fields["messages"] = "messages"
    out = {fields[k]: str(v) for k, v in columns.items() if k in fields and fields[k] != v}
    skipped = sorted(k for k in columns if k not in fields and k not in ("images", "videos", "audios"))
    if skipped:
        notes.append(f"dataset {name}: columns {', '.join(skipped)} are not carried")
    return out
