"""A cache of tokenised examples, so a second run of the same data with the same tokenizer skips the chat template
and the tokenizer (minutes on a large data set).

The key is a hash of the data files' contents, the tokenizer (its vocabulary, merges, normalizer and
post-processor, chat template and special tokens) and every config key that changes what tokenisation produces;
anything else (the model's weights, the learning rate, packing, which happens per step) leaves it valid. Entries
are plain arrays in an `.npz` file under `$XDG_CACHE_HOME/shardfit/data` (default `~/.cache`), written atomically;
an entry that cannot be read is rebuilt, never an error. `data_cache: false` or `SHARDFIT_DATA_CACHE=0` turns it
off. Vision-language examples carry decoded images and are not cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from shardfit.config import Config
from shardfit.data.dataset import DataStats, Split, encode_split
from shardfit.data.tokenize import Encoded

log = logging.getLogger("shardfit")

VERSION = 1  # bump when Encoded or the tokenisation changes meaning
KEEP = 16  # newest entries kept; older ones are deleted when a new one is written
ENV = "SHARDFIT_DATA_CACHE"


def cache_dir() -> Path:
    """Where entries live: `$XDG_CACHE_HOME/shardfit/data`, or `~/.cache/shardfit/data`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardfit" / "data"


def enabled(cfg: Config) -> bool:
    """The config's `data_cache`, unless the environment turns the cache off."""
    return cfg.data_cache and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """A hash of everything about a tokenizer that decides token ids and labels."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary stands for it
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.chat_template, tokenizer.pad_token_id, tokenizer.eos_token_id,
                         tokenizer.bos_token_id, getattr(tokenizer, "padding_side", None)], default=str).encode())
    return h.hexdigest()


def cache_key(cfg: Config, tokenizer: Any) -> str:
    """The entry's name: data contents, tokenizer and the tokenisation keys of `cfg`."""
    def files(paths: str | list[str] | None) -> list[str]:
        return [] if paths is None else [_file_digest(p) for p in ([paths] if isinstance(paths, str) else paths)]

    parts = {"version": VERSION, "data": files(cfg.data), "eval_data": files(cfg.eval_data),
             "eval_split": cfg.eval_split, "seed": cfg.seed, "max_seq_len": cfg.max_seq_len,
             "skip_bad_rows": cfg.skip_bad_rows, "max_bad_rows": cfg.max_bad_rows,
             "tokenizer": tokenizer_digest(tokenizer)}
    if cfg.data_columns:  # only when set: the entries written before the key keep their names
        parts["data_columns"] = cfg.data_columns
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _arrays(prefix: str, examples: list[Encoded]) -> dict[str, np.ndarray]:
    ids = [t for ex in examples for t in ex.input_ids]
    targets = [t for ex in examples for t in ex.targets]
    return {f"{prefix}_ids": np.asarray(ids, dtype=np.int64), f"{prefix}_targets": np.asarray(targets, dtype=np.int64),
            f"{prefix}_lens": np.asarray([len(ex.input_ids) for ex in examples], dtype=np.int64),
            f"{prefix}_truncated": np.asarray([ex.truncated for ex in examples], dtype=np.bool_)}


def _examples(prefix: str, z: Any) -> list[Encoded]:
    ids, targets = z[f"{prefix}_ids"].tolist(), z[f"{prefix}_targets"].tolist()
    lens, truncated = z[f"{prefix}_lens"].tolist(), z[f"{prefix}_truncated"].tolist()
    if sum(lens) != len(ids) or len(ids) != len(targets) or len(lens) != len(truncated):
        raise ValueError("inconsistent lengths")
    out, at = [], 0
    for n, cut in zip(lens, truncated, strict=True):
        out.append(Encoded(ids[at:at + n], targets[at:at + n], bool(cut)))
        at += n
    return out


def load(path: Path) -> tuple[list[Encoded], list[Encoded], DataStats] | None:
    """An entry's examples and row account, or None when it is missing or unreadable (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            stats = DataStats(**json.loads(str(z["stats"])))
            return _examples("train", z), _examples("eval", z), stats
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file of any kind is only a cache miss
        log.info("data cache entry %s unreadable (%s: %s); tokenising again", path, type(e).__name__, e)
        return None


def save(path: Path, train: list[Encoded], evals: list[Encoded], stats: DataStats) -> None:
    """Write an entry atomically (a reader never sees half a file), then drop all but the newest entries. A cache
    that cannot be written (read-only home, full disk) only costs the next run the tokenisation."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, stats=np.asarray(json.dumps(dataclasses.asdict(stats))), **_arrays("train", train),
                     **_arrays("eval", evals))
        os.replace(tmp, path)
        entries = sorted(path.parent.glob("*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.info("data cache not written (%s); the next run tokenises again", e)


@dataclasses.dataclass
class Encoding:
    """Tokenised train and eval examples, and whether they came from the cache."""

    train: list[Encoded]
    eval: list[Encoded]
    hit: bool
    path: Path | None


def cached_encode_split(cfg: Config, tokenizer: Any, split: Split, vision: Any = None,
                        write: bool = True) -> Encoding:
    """`encode_split`, through the cache when it is on and the examples are text. On a hit `split.stats` takes the
    counts the tokenisation made (truncated, dropped rows), so the start line says the same as on a miss. `write`
    is false on all ranks but one, so a multi-rank run writes the entry once."""
    if vision is not None or not enabled(cfg):
        train, evals = encode_split(cfg, tokenizer, split, vision)
        return Encoding(train, evals, False, None)
    path = cache_dir() / f"{cache_key(cfg, tokenizer)}.npz"
    found = load(path)
    if found is not None:
        train, evals, stats = found
        split.stats.__dict__.update(stats.__dict__)
        return Encoding(train, evals, True, path)
    train, evals = encode_split(cfg, tokenizer, split, vision)
    if write:
        save(path, train, evals, split.stats)
    return Encoding(train, evals, False, path)
