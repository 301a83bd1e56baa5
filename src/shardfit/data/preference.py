"""Preference data: pairs (a prompt, a chosen and a rejected answer) for DPO, ORPO and SimPO, and unpaired rows (a
prompt, an answer and whether it is desirable) for KTO, in the layouts users bring, detected per file:

- TRL: {"prompt", "chosen", "rejected"}, each a string or a list of messages; without a prompt, chosen and rejected
  message lists that share their first turns (the shared turns are the prompt). KTO: {"prompt", "completion",
  "label": true|false}.
- LLaMA-Factory ranking rows: a `conversations` (ShareGPT) or `messages` (OpenAI) history, or alpaca's
  instruction/input, with `chosen` / `rejected` answers (a turn or a string), `images` for VL. KTO: the history's
  last turn is the answer and `kto_tag` says whether it is desirable.

Both answers are encoded after the same prompt by the model's chat template, so chosen and rejected share the
prompt's tokens and carry labels only on their answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.config import Config
from shardfit.data.dataset import Conversation, DataStats, _bad_row, encode_all, hold_out, refuse_lost_rows
from shardfit.data.formats import BadRow, detect_format, detect_preference, rename_columns, to_messages
from shardfit.data.media import extract_media
from shardfit.data.packing import PackedRow, no_pack, pack_where_padded
from shardfit.data.reader import _Broken, read_rows
from shardfit.data.tokenize import Encoded, SeqInfo
from shardfit.data.vision import VisionProcessor
from shardfit.errors import UserError

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class PrefRow:
    """One preference row as messages: the prompt's turns, then the answer turns of each side. `rejected` is None
    for an unpaired (KTO) row, whose `desirable` says which way it counts."""

    prompt: Messages
    chosen: Messages
    rejected: Messages | None
    desirable: bool | None = None


@dataclass
class Pair:
    """A tokenised preference example: `chosen` and `rejected` (None for KTO, whose `desirable` says how `chosen`
    counts), and the reference model's log-probabilities of each answer once computed (`ref`)."""

    chosen: Encoded
    rejected: Encoded | None
    desirable: bool | None = None
    ref: tuple[float, ...] | None = None
    where: str = ""

    @property
    def sides(self) -> list[Encoded]:
        return [self.chosen] if self.rejected is None else [self.chosen, self.rejected]

    @property
    def n_targets(self) -> int:
        return sum(s.n_targets for s in self.sides)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.sides)

    @property
    def units(self) -> int:
        """Terms of the loss this example adds: the loss is a mean over pairs (or KTO rows), not over tokens."""
        return 1


@dataclass
class PrefSplit:
    train: list[Conversation]
    eval: list[Conversation]
    stats: DataStats
    rows: dict[str, PrefRow] = field(default_factory=dict)  # by the conversation's `where`


def _turns(value: Any, what: str, role: str = "assistant") -> Messages:
    """An answer or prompt given as a string, one turn ({role|from, content|value}) or a list of turns."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{what}' must be a string, a turn or a list of turns, got {type(value).__name__}")
    if all(isinstance(t, dict) and "from" in t for t in value):
        return to_messages({"conversations": value + [{"from": "gpt", "value": ""}]}, "sharegpt")[:-1]
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or "role" not in t or "content" not in t:
            raise BadRow(f"'{what}'[{i}] needs 'role' and 'content' (or 'from' and 'value')")
        if t["role"] not in ("system", "user", "assistant"):
            raise BadRow(f"'{what}'[{i}]: unknown role {t['role']!r} (use system, user or assistant)")
        out.append({"role": t["role"], "content": text_of(t["content"], f"'{what}'[{i}].content")})
    return out


def _history(row: dict) -> Messages:
    """The prompt of a LLaMA-Factory ranking or KTO row: its conversation, messages or alpaca instruction."""
    fmt = detect_format({**row, "output": ""})  # a conversation or messages first; else alpaca's instruction
    if fmt is None:
        raise BadRow("the prompt needs a 'conversations' or 'messages' list, an 'instruction' or a 'prompt'")
    if fmt == "alpaca":
        return to_messages({**row, "output": ""}, "alpaca")[:-1]
    key = "conversations" if fmt == "sharegpt" else "messages"
    turns = row[key]
    if fmt == "sharegpt":
        return to_messages({**row, key: turns + [{"from": "gpt", "value": ""}]}, fmt)[:-1]
    return to_messages({**row, key: turns + [{"role": "assistant", "content": ""}]}, fmt)[:-1]


def text_of(value: Any, what: str) -> str:
    """A turn's content as a string (media were flattened into placeholders before this)."""
    if not isinstance(value, str):
        raise BadRow(f"{what} must be a string, got {type(value).__name__}")
    return value


def _shared_prefix(a: Messages, b: Messages) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def to_pref_row(row: dict) -> PrefRow:
    """Convert one row of either kind; raise `BadRow` when it fits neither."""
    if "chosen" in row and "rejected" in row:
        if "prompt" in row:
            prompt = _turns(row["prompt"], "prompt", role="user")
            return PrefRow(prompt, _turns(row["chosen"], "chosen"), _turns(row["rejected"], "rejected"))
        if any(k in row for k in ("conversations", "messages", "instruction", "input")):
            return PrefRow(_history(row), _turns(row["chosen"], "chosen"), _turns(row["rejected"], "rejected"))
        chosen, rejected = _turns(row["chosen"], "chosen"), _turns(row["rejected"], "rejected")
        n = _shared_prefix(chosen, rejected)
        if n == 0:
            raise BadRow("'chosen' and 'rejected' without a 'prompt' must be message lists that start with the same "
                         "prompt turns")
        return PrefRow(chosen[:n], chosen[n:], rejected[n:])
    if "completion" in row and "label" in row:
        if not isinstance(row["label"], bool):
            raise BadRow(f"'label' must be true or false, got {row['label']!r}")
        return PrefRow(_turns(row.get("prompt", ""), "prompt", role="user"), _turns(row["completion"], "completion"),
                       None, row["label"])
    if "kto_tag" in row:
        if not isinstance(row["kto_tag"], bool):
            raise BadRow(f"'kto_tag' must be true or false, got {row['kto_tag']!r}")
        turns = _history(row) if "output" not in row else to_messages(row, "alpaca")
        if not turns or turns[-1]["role"] != "assistant":
            raise BadRow("a kto_tag row's last turn must be the answer (gpt / assistant)")
        return PrefRow(turns[:-1], turns[-1:], None, row["kto_tag"])
    raise BadRow("not a preference row")


def _check_sides(p: PrefRow, paired: bool) -> None:
    if paired and p.rejected is None:
        raise BadRow("an unpaired row (completion + label, or kto_tag) in a file of pairs; objective kto reads "
                     "unpaired rows, dpo/orpo/simpo read chosen + rejected")
    if not paired and p.rejected is not None:
        raise BadRow("a chosen/rejected pair, but objective kto reads unpaired rows (prompt, completion, label); "
                     "use objective dpo, orpo or simpo for pairs")
    for side in [p.chosen] + ([p.rejected] if p.rejected is not None else []):
        if not side or side[-1]["role"] != "assistant":
            raise BadRow("each answer must end with an assistant turn")
    if not p.prompt or p.prompt[-1]["role"] != "user":
        raise BadRow("the prompt must end with a user turn")


def load_preferences(paths: str | list[str], objective: str, skip_bad_rows: bool, stats: DataStats,
                     columns: dict[str, str] | None, rows: dict[str, PrefRow]) -> list[Conversation]:
    """Every preference row of the files as a `Conversation` of its prompt (media resolved), its `PrefRow` kept in
    `rows` by file:line. Bad rows raise `UserError` with file:line, or are counted."""
    paired = objective != "kto"
    out: list[Conversation] = []
    for path in [paths] if isinstance(paths, str) else paths:
        for row in read_rows(path):
            stats.rows += 1
            try:
                if isinstance(row.data, _Broken):
                    raise BadRow(row.data.reason)
                fields = rename_columns(row.data, columns or {})
                if detect_preference(fields) is None:
                    keys = ", ".join(fields) if isinstance(fields, dict) else type(fields).__name__
                    want = "prompt/chosen/rejected (or a conversation with chosen and rejected)" if paired else \
                        "prompt/completion/label (or a conversation with kto_tag)"
                    raise BadRow(f"not a preference row (keys: {keys}); objective {objective} reads {want}")
                stats.formats[str(path)] = "preference"
                media_keys = {k: fields[k] for k in ("images", "audios", "videos") if k in fields}
                probe, media = extract_media({"messages": _as_text_turns(fields), **media_keys}, Path(path).parent)
                pref = to_pref_row(dict(fields, **_flattened(fields, probe)))
                _check_sides(pref, paired)
                rows[row.where] = pref
                out.append(Conversation(pref.prompt, row.where, media.images, media.audios, media.videos))
            except BadRow as e:
                _bad_row(row.where, str(e), skip_bad_rows, stats)
    if not out:
        raise UserError(f"no usable rows in {paths}.")
    return out


def _as_text_turns(row: dict) -> Messages:
    """The row's prompt turns as written (content parts kept), for media extraction only."""
    for key in ("messages", "prompt"):
        if isinstance(row.get(key), list) and all(isinstance(t, dict) and "content" in t for t in row[key]):
            return row[key]
    text = [row.get(k) for k in ("prompt", "instruction", "input") if isinstance(row.get(k), str)]
    turns = row.get("conversations")
    text += [t.get("value") for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []
    return [{"role": "user", "content": t} for t in text if isinstance(t, str)]


def _flattened(row: dict, probe: dict) -> dict:
    """The row's OpenAI content parts flattened to strings with placeholders, where media extraction did so."""
    for key in ("messages", "prompt"):
        turns = row.get(key)
        parts = isinstance(turns, list) and any(isinstance(t, dict) and isinstance(t.get("content"), list)
                                                for t in turns)
        if parts and isinstance(probe.get("messages"), list):
            return {key: probe["messages"]}
    return {}


def read_preference_split(cfg: Config) -> PrefSplit:
    """Train and held-out preference rows for a config, as `read_split` splits SFT data (eval_data or eval_split)."""
    stats, rows = DataStats(), {}
    train = load_preferences(cfg.data, cfg.objective, cfg.skip_bad_rows, stats, cfg.data_columns, rows)
    evals: list[Conversation] = []
    if cfg.eval_data:
        evals = load_preferences(cfg.eval_data, cfg.objective, cfg.skip_bad_rows, stats, cfg.data_columns, rows)
    elif cfg.eval_split > 0:
        train, evals = hold_out(train, cfg.eval_split, cfg.seed)
    return PrefSplit(train, evals, stats, rows)


def encode_pairs(tokenizer: Any, split: PrefSplit, conversations: list[Conversation], max_len: int,
                 skip_bad_rows: bool, vision: VisionProcessor | None) -> list[Pair]:
    """Each row's answers encoded after its prompt. A row one of whose answers keeps no token within `max_len` is
    dropped and counted (the answer, not the prompt, is what a pair is trained on)."""
    out = []
    for conv in conversations:
        pref = split.rows[conv.where]
        sides = [pref.chosen] + ([pref.rejected] if pref.rejected is not None else [])
        convs = [dataclasses.replace(conv, messages=pref.prompt + side, label_from=len(pref.prompt)) for side in sides]
        scratch = DataStats()
        encoded = encode_all(tokenizer, convs, max_len, scratch, skip_bad_rows, vision)
        if scratch.skipped:
            split.stats.skipped += 1
            split.stats.skipped_where.append(conv.where)
            continue
        if len(encoded) < len(sides):
            split.stats.dropped += 1
            split.stats.dropped_where.append(conv.where)
            continue
        if scratch.truncated:
            split.stats.truncated += 1
        rejected = encoded[1] if len(encoded) > 1 else None
        out.append(Pair(encoded[0], rejected, pref.desirable, where=conv.where))
    return out


def encode_preference_split(cfg: Config, tokenizer: Any, split: PrefSplit,
                            vision: VisionProcessor | None = None) -> tuple[list[Pair], list[Pair]]:
    """Tokenised train and held-out pairs; refuses when more rows are lost than `max_bad_rows` allows."""
    train = encode_pairs(tokenizer, split, split.train, cfg.max_seq_len, cfg.skip_bad_rows, vision)
    evals = encode_pairs(tokenizer, split, split.eval, cfg.max_seq_len, cfg.skip_bad_rows, vision)
    stats = split.stats
    if not train:
        raise UserError(f"'data': no preference row keeps an answer token within max_seq_len={cfg.max_seq_len} "
                        f"(first: {(stats.dropped_where or stats.skipped_where or ['?'])[0]}); raise max_seq_len.")
    refuse_lost_rows(stats, cfg.max_bad_rows, "preference rows")
    if cfg.objective == "kto" and len({p.desirable for p in train}) < 2:
        only = "desirable" if train[0].desirable else "undesirable"
        raise UserError(f"'data': every KTO row is {only}; KTO needs both desirable (label/kto_tag true) and "
                        "undesirable rows.")
    return train, evals


def tagged(pairs: list[Pair]) -> list[Encoded]:
    """The sides of a micro-batch's pairs as examples tagged with their sequence (pair i: 2i chosen, 2i+1
    rejected; KTO row i: i), each carrying what the loss needs of it."""
    out = []
    for pair in pairs:
        for side, enc in enumerate(pair.sides):
            tag = len(out)
            ref = pair.ref[side] if pair.ref is not None else None
            out.append(dataclasses.replace(enc, seq=SeqInfo(tag, ref, pair.desirable)))
    return out


def pair_former(max_len: int, packing: bool):
    """How a micro-batch's pairs become rows: their sides tagged, then packed where padding would fill a quarter
    (as SFT micro-batches are) or one side per row."""
    def form(pairs: list[Pair]) -> list[PackedRow]:
        sides = tagged(pairs)
        return pack_where_padded(sides, max_len) if packing else no_pack(sides)
    return form
