"""A path a config names with nothing at it: a typo beside the real file, or a file that is elsewhere.

A login node may not mount the storage the run trains from, so `check` warns about a path with nothing at it. But
when the folder it names is here and holds a name that is surely the one meant (`trian.jsonl` beside `train.jsonl`,
`dat/` beside `data/`: `likeness`), the storage is mounted and the path is a typo: check and train both refuse it,
naming the match. A value that can be no file at all (a wildcard, a looping link, a hub dataset id) is refused too.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import UserError

# The file suffixes a data file is written with: one given for the other beside a file of the same stem is a typo.
DATA_SUFFIXES = (".json", ".jsonl")
# Names are compared token by token, split at these: a differing token of at most this many letters is a variant
# (train_en/train_de, shard_a/shard_b, Q4_K_S/Q4_K_M), not a slip of the finger.
_SEPARATORS = re.compile(r"[-_.\s]+")
_SHORT_TOKEN = 2


@dataclass(frozen=True)
class Sibling:
    """A path that is here, a single edit away from one a config names with nothing at it: `sure` when the edit
    is one a typist makes (two letters swapped, a letter dropped or doubled inside a word, .json for .jsonl), so
    check and train refuse the path; otherwise only a hint in check's warning (mixtral-7b beside mistral-7b is
    another model, eval.jsonl beside val.jsonl another file)."""

    path: Path
    sure: bool


# A value shaped as a Hugging Face dataset id: owner/name, with no file suffix.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w-]+")


def looked_in(folders: tuple[str, ...]) -> str:
    """Where a relative path was tried, for a message: ' (looked in A and B)', or nothing for an absolute one."""
    return f" (looked in {' and '.join(folders)})" if folders else ""


def refuse_no_path(value: str, tries: list[Path], named: str, key: str) -> None:
    """A data value with nothing at it that can be no file on any machine is a UserError from check and train
    alike, beginning with `named`: a wildcard pattern (never expanded), a link that leads back to itself, or a
    Hugging Face dataset id (owner/name) whose owner is no folder here."""
    for t in tries:
        try:
            os.stat(t)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{named} {value} is a symbolic link that loops (it leads back to itself); give "
                                "the path of the file itself.") from None
    if glob.has_magic(value):
        found = sorted({os.path.basename(m) for t in tries for m in glob.glob(str(t))})
        held = f" (here it matches {', '.join(found[:5])})" if found else ""
        raise UserError(f"{named} {value} is a wildcard pattern, which shardfit does not expand{held}; list the "
                        f"files: {key}: [a.jsonl, b.jsonl].")
    if _HUB_ID.fullmatch(value) and not any(os.path.isdir(t.parent) for t in tries):
        raise UserError(f"{named} {value} is no file, and looks like a Hugging Face dataset id; shardfit reads "
                        f"local files: download the dataset (e.g. `huggingface-cli download --repo-type dataset "
                        f"{value} --local-dir data/`) and give the path of its .json or .jsonl file.")


def unreadable(named: str, e: OSError) -> UserError:
    """The refusal of a path the OS will not let this user look at or read, beginning with `named` (the file, line
    and key): check and train give it alike."""
    return UserError(f"{named} cannot be read on {socket.gethostname()} ({e.strerror or e}). Correct the path, or "
                     "give this user read access to it.")


def exists_here(p: Path, named: str, read: bool = False) -> bool:
    """Whether anything is at `p` on this machine; a path the OS refuses to look at (a name too long, a folder this
    user may not enter) is a UserError on any machine, beginning with `named` (the file, line and key). With
    `read`, a file that is here must also open for reading and a folder list its names, as the run will read them
    (without it, train refused such a file with a PermissionError traceback as it hashed the data)."""
    try:
        if not p.exists():
            return False
        if read and p.is_dir():
            os.listdir(p)
        elif read:  # non-blocking: a FIFO given as a file opens at once instead of waiting for a writer
            os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError as e:
        raise unreadable(named, e) from None


def _names(folder: Path) -> list[str]:
    try:
        return [p.name for p in folder.iterdir()]
    except OSError:  # a folder this user may not list: no suggestion, the caller's own message stands
        return []


def _edit(want: str, have: str) -> tuple[str, int] | None:
    """The single edit that turns `have` into `want` (the name given), as (kind, position in `have`): swap,
    drop (`want` lacks have[i]), add (`want` has want[i] more), change; None when more than one edit apart."""
    if len(want) == len(have):
        diff = [i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b]
        if len(diff) == 1:
            return "change", diff[0]
        i = diff[0] if len(diff) == 2 else -1
        if len(diff) == 2 and diff[1] == i + 1 and want[i] == have[i + 1] and want[i + 1] == have[i]:
            return "swap", i
        return None
    longer, shorter, kind = (have, want, "drop") if len(have) > len(want) else (want, have, "add")
    if len(longer) - len(shorter) != 1:
        return None
    i = next((k for k, (a, b) in enumerate(zip(longer, shorter, strict=False)) if a != b), len(shorter))
    return (kind, i) if longer[:i] + longer[i + 1:] == shorter else None


def ends_a_word_apart(want: str, have: str) -> bool:
    """Whether `want` and `have` differ by one letter at the end of a word (bloom beside bloomz): how a family
    names its variants, so between model names no sure typo even where `likeness` would call it one."""
    edit = _edit(want, have)
    if edit is None or edit[0] not in ("add", "drop"):
        return False
    longer = want if edit[0] == "add" else have
    token, at = _token(longer, edit[1])
    return at == len(token) - 1


def _token(name: str, i: int) -> tuple[str, int]:
    """The separator-delimited token of `name` that holds position `i` (a letter, not a separator), and `i`'s place
    in it."""
    start = max((m.end() for m in _SEPARATORS.finditer(name, 0, i)), default=0)
    end = next((m.start() for m in _SEPARATORS.finditer(name, i)), len(name))
    return name[start:end], i - start


def likeness(want: str, have: str) -> bool | None:
    """Whether the name given (`want`) is a typo of the name here (`have`): True for an edit a typist makes (a
    swapped pair of letters; a letter dropped from a word of 4 or more, 5 for its first, but for a plural's final s;
    a letter doubled; .json for .jsonl), False for another single edit (a close name, worth naming), None for a
    name of another file: names that differ only in digits (a series: train2, shard_03), in a whole short token
    (train_en/train_de, shard_a/shard_b), or by more than one edit."""
    if want == have or re.sub(r"\d+", "#", want) == re.sub(r"\d+", "#", have):
        return None  # a series: shard1/shard2, data-0001/data-0002
    stem, suffix = os.path.splitext(want)
    if suffix in DATA_SUFFIXES and os.path.splitext(have) in [(stem, s) for s in DATA_SUFFIXES]:
        return True
    edit = _edit(want, have)
    if edit is None:
        return None
    kind, i = edit
    longer = want if kind == "add" else have  # the name that holds the edited letter at i
    if kind in ("add", "drop") and longer[i].isdigit():
        return None  # a number added or dropped: train2 beside train, the next of a series
    if _SEPARATORS.fullmatch(longer[i]) or (kind == "change" and _SEPARATORS.fullmatch(want[i])):
        return False  # a separator added, dropped or changed (train-x, train_x): worth naming, not sure
    token, at = _token(longer, i)
    shorter = have if kind == "add" else want
    other = _token(shorter, min(i, len(shorter) - 1))[0] if shorter else ""
    if min(len(token), len(other)) <= _SHORT_TOKEN:
        return None  # a whole short token differs (en/de, a/b, v1/v1b): another file of a set
    if kind == "swap":
        return True
    if kind == "drop" and at == len(token) - 1 and token[at] == "s":
        return False  # a plural's s: sample beside samples is another file of a set, as evals beside eval is
    if kind == "drop":  # a first letter dropped is sure only in a long word: val.jsonl beside eval.jsonl is a file
        return len(token) >= (4 if at > 0 else 5)
    if kind == "add":
        return at > 0 and token[at] == token[at - 1]
    return False


def _closest(name: str, folder: Path, named: frozenset[Path]) -> Sibling | None:
    """The sibling in `folder` that `name` most likely meant (a sure typo first), not one the config names
    itself: shard_b.jsonl beside shard_a.jsonl in the same `data:` list is another file, not a typo of it."""
    found = [(sure, n) for n in sorted(_names(folder)) if (sure := likeness(name, n)) is not None
             and (folder / n).absolute() not in named]
    if not found:
        return None
    sure, match = max(found, key=lambda f: f[0])
    return Sibling(folder / match, sure)


def close_sibling(p: Path, named: tuple[str | Path, ...] = ()) -> Sibling | None:
    """The path that is here which `p` most likely meant, where the nearest of `p`'s folders that is here holds a
    name a single edit away from the next part of `p` (`likeness`), with the rest of `p` under it for a folder's
    typo; None where nothing is near (the storage is not mounted, the name is new, a folder on the way this user
    may not look in: the caller's own message stands). `named`: the paths the config names, never suggested."""
    others = frozenset(Path(n).absolute() for n in named)
    try:
        return _close_sibling(p, others)
    except OSError:
        return None


def _close_sibling(p: Path, named: frozenset[Path]) -> Sibling | None:
    parts = p.parts
    for depth in range(len(parts) - 1, -1, -1):
        folder = Path(*parts[:depth]) if depth else Path(".")  # a bare name is in the working directory
        if not folder.is_dir():
            continue
        near = _closest(parts[depth], folder, named)
        if near is None:
            return None
        meant = near.path.joinpath(*parts[depth + 1:])
        return Sibling(meant, near.sure) if meant == near.path or meant.exists() else None
    return None
