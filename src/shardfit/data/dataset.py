"""From data files to tokenised examples, in two steps so bad data stops a run before anything slow loads:
`read_split` (read, detect the format per file, convert to messages, split off eval; no tokenizer) and
`encode_split` (the chat template, assistant-only labels, truncation). Every row that is skipped, dropped or
truncated is counted with where it came from."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.config import Config
from shardfit.data.audio import AudioInput
from shardfit.data.formats import BadRow, detect_format, detect_preference, rename_columns, to_messages
from shardfit.data.media import extract_media
from shardfit.data.reader import _Broken, read_rows
from shardfit.data.tokenize import Encoded, encode_messages
from shardfit.data.video import VideoClip
from shardfit.data.vision import VisionProcessor, encode_with_images
from shardfit.errors import UserError

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Conversation:
    messages: Messages
    where: str  # file:line, for every later message about this row
    images: tuple[str, ...] = ()  # absolute paths, in the order of the `<image>` placeholders
    audios: tuple[AudioInput, ...] = ()  # absolute paths or WAV bytes, in the order of the `<audio>` placeholders
    videos: tuple[VideoClip, ...] = ()  # each video (frames or a file), in the order of the `<video>` placeholders
    label_from: int = 0  # the first message whose assistant turns train (a preference answer after its history)


@dataclass
class DataStats:
    rows: int = 0
    skipped: int = 0  # rows that do not fit their format (skip_bad_rows)
    dropped: int = 0  # rows whose assistant tokens all fall beyond max_seq_len
    truncated: int = 0  # rows cut at max_seq_len that still train on some assistant tokens
    formats: dict[str, str] = field(default_factory=dict)
    skipped_where: list[str] = field(default_factory=list)
    dropped_where: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The start line's account of rows that do not train as written (empty when every row does)."""
        parts = [f"{n} {what}" for n, what in ((self.skipped, "bad rows skipped"),
                                               (self.dropped, "rows dropped (no answer within max_seq_len)"),
                                               (self.truncated, "rows truncated")) if n]
        return "; ".join(parts)


# What the SFT reader says of a preference row, by its layout (formats.py `detect_preference`).
PREFERENCE_ROWS = {
    "pairs": "these are preference rows (chosen/rejected) but objective is sft: set objective: dpo (or orpo/simpo); "
             "kto for completion+label rows",
    "unpaired": "these are preference rows (completion + label, or kto_tag) but objective is sft: set objective: "
                "kto; dpo (or orpo/simpo) for chosen/rejected pairs",
}


def load_conversations(paths: str | list[str], skip_bad_rows: bool, stats: DataStats,
                       columns: dict[str, str] | None = None) -> list[Conversation]:
    """All conversations of the given files as messages, each format field read from its column in `columns`
    (data_columns). Bad rows raise `UserError` with file:line, or are counted."""
    out: list[Conversation] = []
    for path in [paths] if isinstance(paths, str) else paths:
        fmt = None
        for row in read_rows(path):
            stats.rows += 1
            try:
                if isinstance(row.data, _Broken):
                    raise BadRow(row.data.reason)
                fields = rename_columns(row.data, columns or {})
                if fmt is None:
                    # The file's, not the row's, problem (skipping rows would not help). LLaMA-Factory's ranking
                    # rows hold a conversation too: read as SFT they would train on no answer.
                    if (layout := detect_preference(fields)) is not None:
                        raise UserError(f"{row.where}: {PREFERENCE_ROWS[layout]}.")
                    fmt = detect_format(fields)
                    if fmt is None:
                        keys = ", ".join(row.data) if isinstance(row.data, dict) else type(row.data).__name__
                        raise BadRow(f"unknown format (keys: {keys}); expected alpaca (instruction/output), "
                                     f"ShareGPT (conversations) or OpenAI (messages); rows that name these fields "
                                     f"otherwise need data_columns, e.g. data_columns: {{input: your_prompt_column, "
                                     f"output: your_answer_column}}")
                    stats.formats[str(path)] = fmt
                data, media = extract_media(fields, Path(path).parent)
                out.append(Conversation(to_messages(data, fmt), row.where, media.images, media.audios, media.videos))
            except BadRow as e:
                _bad_row(row.where, str(e), skip_bad_rows, stats)
    if not out:
        raise UserError(f"no usable rows in {paths}.")
    return out


def _bad_row(where: str, why: str, skip: bool, stats: DataStats) -> None:
    if not skip:
        raise UserError(f"{where}: {why}. Fix the row, or set skip_bad_rows: true to skip and count such rows.")
    stats.skipped += 1
    stats.skipped_where.append(where)


@dataclass
class Split:
    """The conversations of a run: training and held-out."""

    train: list[Conversation]
    eval: list[Conversation]
    stats: DataStats


def read_split(cfg: Config) -> Split:
    """Train and eval conversations for a config: `eval_data` if given, else `eval_split` of `data` (seeded)."""
    stats = DataStats()
    train = load_conversations(cfg.data, cfg.skip_bad_rows, stats, cfg.data_columns)
    evals: list[Conversation] = []
    if cfg.eval_data:
        evals = load_conversations(cfg.eval_data, cfg.skip_bad_rows, stats, cfg.data_columns)
    elif cfg.eval_split > 0:
        train, evals = hold_out(train, cfg.eval_split, cfg.seed)
    return Split(train, evals, stats)


def hold_out(rows: list[Conversation], fraction: float, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """`rows` split into (train, held out): a seeded `fraction` of them (at least one) held out, order kept."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:max(1, int(len(order) * fraction))])
    return [c for i, c in enumerate(rows) if i not in held], [c for i, c in enumerate(rows) if i in held]


def encode_all(tokenizer: Any, conversations: list[Conversation], max_len: int, stats: DataStats,
               skip_bad_rows: bool = False, vision: VisionProcessor | None = None) -> list[Encoded]:
    """Tokenise every conversation; count those cut at `max_len`, and drop (and count) those whose assistant tokens
    were all cut away. A conversation the chat template refuses (a system turn it does not support, turns that do
    not alternate) is a bad row. With `vision` (a vision-language model) every example also gets its M-RoPE
    positions and its images' pixels (and, with its `audio`, its clips' features); without it, a row with images
    is refused, as is a row with audio for a model without an audio tower."""
    out = []
    for conv in conversations:
        if (conv.images or conv.videos) and vision is None:
            what = "images" if conv.images else "videos"
            raise UserError(f"{conv.where}: the row has {what} but the model has no vision tower; train a "
                            f"vision-language model (e.g. Qwen2-VL), or remove the {what}.")
        if conv.videos and vision.video is None:
            raise UserError(f"{conv.where}: the row has videos, which shardfit trains on Qwen2-VL, Qwen2.5-VL and "
                            "Qwen3-VL (dense and MoE) only; remove the videos, or give their frames as images.")
        if conv.audios and (vision is None or vision.audio is None):
            raise UserError(f"{conv.where}: the row has audio but the model has no audio tower (or its folder no "
                            "preprocessor_config.json); train Qwen2.5-Omni with its preprocessor_config.json, or "
                            "remove the audio.")
        try:
            if vision is not None:
                enc = encode_with_images(tokenizer, vision, conv.messages, conv.images, max_len, conv.audios,
                                         conv.videos, conv.label_from)
            else:
                enc = encode_messages(tokenizer, conv.messages, max_len, conv.label_from)
        except BadRow as e:
            _bad_row(conv.where, str(e), skip_bad_rows, stats)
            continue
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the template's own raise_exception
            _bad_row(conv.where, f"the model's chat template refuses this conversation ({type(e).__name__}: {e})",
                     skip_bad_rows, stats)
            continue
        if enc.n_targets == 0:
            stats.dropped += 1
            stats.dropped_where.append(conv.where)
            continue
        if enc.truncated:
            stats.truncated += 1
        out.append(enc)
    return out


def allowed_bad_rows(limit: float, rows: int) -> int:
    """`max_bad_rows` as a count: a fraction of the rows below 1, a number of rows from 1."""
    return int(limit * rows) if limit < 1 else int(limit)


def encode_split(cfg: Config, tokenizer: Any, split: Split,
                 vision: VisionProcessor | None = None) -> tuple[list[Encoded], list[Encoded]]:
    """Tokenised train and eval examples; refuses when more rows are lost than `max_bad_rows` allows."""
    stats = split.stats
    train = encode_all(tokenizer, split.train, cfg.max_seq_len, stats, cfg.skip_bad_rows, vision)
    evals = encode_all(tokenizer, split.eval, cfg.max_seq_len, stats, cfg.skip_bad_rows, vision)
    if not train:
        raise UserError(f"'data': no example keeps an assistant token within max_seq_len={cfg.max_seq_len} "
                        f"(first: {(stats.dropped_where or ['?'])[0]}); raise max_seq_len.")
    refuse_lost_rows(stats, cfg.max_bad_rows)
    return train, evals


def refuse_lost_rows(stats: DataStats, max_bad_rows: float, what: str = "rows") -> None:
    """Refuse when more `what` were skipped or dropped than `max_bad_rows` allows."""
    lost, allowed = stats.skipped + stats.dropped, allowed_bad_rows(max_bad_rows, stats.rows)
    if lost > allowed:
        first = (stats.dropped_where + stats.skipped_where)[0]
        raise UserError(f"'data': {lost} of {stats.rows} {what} would not train ({stats.describe()}; first: "
                        f"{first}), more than max_bad_rows allows ({allowed}). Raise max_seq_len, fix or remove those "
                        "rows, or raise max_bad_rows.")


def build_datasets(cfg: Config, tokenizer: Any) -> tuple[list[Encoded], list[Encoded], DataStats]:
    """Both steps at once: train and eval examples and the account of the rows."""
    split = read_split(cfg)
    train, evals = encode_split(cfg, tokenizer, split)
    return train, evals, split.stats
