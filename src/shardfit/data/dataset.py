"""From data files to tokenised examples: read, detect the format per file, convert, encode, split."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from shardfit.data.formats import BadRow, detect_format, to_messages
from shardfit.data.reader import _Broken, read_rows
from shardfit.data.tokenize import Encoded, encode_messages
from shardfit.errors import UserError


@dataclass
class DataStats:
    rows: int = 0
    skipped: int = 0
    truncated: int = 0
    formats: dict[str, str] = field(default_factory=dict)
    skipped_where: list[str] = field(default_factory=list)


def load_conversations(paths: str | list[str], skip_bad_rows: bool, stats: DataStats) -> list[list[dict[str, str]]]:
    """All conversations of the given files as messages. Bad rows raise `UserError` with file:line, or are counted."""
    out: list[list[dict[str, str]]] = []
    for path in [paths] if isinstance(paths, str) else paths:
        fmt = None
        for row in read_rows(path):
            stats.rows += 1
            try:
                if isinstance(row.data, _Broken):
                    raise BadRow(row.data.reason)
                if fmt is None:
                    fmt = detect_format(row.data)
                    if fmt is None:
                        keys = ", ".join(row.data) if isinstance(row.data, dict) else type(row.data).__name__
                        raise BadRow(f"unknown format (keys: {keys}); expected alpaca (instruction/output), "
                                     f"ShareGPT (conversations) or OpenAI (messages)")
                    stats.formats[str(path)] = fmt
                out.append(to_messages(row.data, fmt))
            except BadRow as e:
                if not skip_bad_rows:
                    raise UserError(f"{row.where}: {e}. Fix the row, or set skip_bad_rows: true to skip "
                                    f"and count such rows.") from None
                stats.skipped += 1
                stats.skipped_where.append(row.where)
    if not out:
        raise UserError(f"no usable rows in {paths}.")
    return out


def encode_all(tokenizer: Any, conversations: list[list[dict[str, str]]], max_len: int,
               stats: DataStats) -> list[Encoded]:
    """Tokenise every conversation; drop those whose assistant tokens were all truncated away."""
    out = []
    for messages in conversations:
        enc = encode_messages(tokenizer, messages, max_len)
        if len(enc.input_ids) >= max_len:
            stats.truncated += 1
        if enc.n_targets > 0:
            out.append(enc)
    return out


def split_conversations(cfg: Any, stats: DataStats) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """Train and eval conversations: `eval_data` if given, else `eval_split` of `data` (seeded)."""
    train_conv = load_conversations(cfg.data, cfg.skip_bad_rows, stats)
    eval_conv: list[list[dict[str, str]]] = []
    if cfg.eval_data:
        eval_conv = load_conversations(cfg.eval_data, cfg.skip_bad_rows, stats)
    elif cfg.eval_split > 0:
        order = list(range(len(train_conv)))
        random.Random(cfg.seed).shuffle(order)
        n_eval = max(1, int(len(order) * cfg.eval_split))
        eval_idx = set(order[:n_eval])
        eval_conv = [c for i, c in enumerate(train_conv) if i in eval_idx]
        train_conv = [c for i, c in enumerate(train_conv) if i not in eval_idx]
    return train_conv, eval_conv


def build_datasets(cfg: Any, tokenizer: Any, split: tuple[list, list] | None = None,
                   stats: DataStats | None = None) -> tuple[list[Encoded], list[Encoded], DataStats]:
    """Train and eval examples for a config (of `split`, the conversations `split_conversations` returned, when
    given with its `stats`)."""
    stats = stats if stats is not None else DataStats()
    train_conv, eval_conv = split if split is not None else split_conversations(cfg, stats)
    train = encode_all(tokenizer, train_conv, cfg.max_seq_len, stats)
    evals = encode_all(tokenizer, eval_conv, cfg.max_seq_len, stats)
    if not train:
        raise UserError(f"'data': no example keeps an assistant token within max_seq_len={cfg.max_seq_len}; "
                        f"raise max_seq_len.")
    return train, evals, stats
