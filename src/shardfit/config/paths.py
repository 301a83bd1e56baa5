"""A path a config names with nothing at it: a typo beside the real file, or a file that is elsewhere.

A login node may not mount the storage the run trains from, so `check` warns about a path with nothing at it. But
when the folder it names is here and holds a name a keystroke away (`trian.jsonl` beside `train.jsonl`, `dat/`
beside `data/`), the storage is mounted and the path is a typo: check and train both refuse it, naming the match.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from pathlib import Path

from shardfit.errors import UserError

# difflib's ratio at or above which a sibling's name is taken for the one meant: a swapped pair of letters in a
# four-letter name (tiyn, tiny) scores 0.75, a dropped letter in a folder (dat, data) 0.86.
CUTOFF = 0.75


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


def _numbered_alike(a: str, b: str) -> bool:
    """Names that differ only in their digits (shard1/shard2, run_03/run_04) are a series, not a typo: a job still
    queued may write the next one."""
    return re.sub(r"\d+", "#", a) == re.sub(r"\d+", "#", b)


def _close(name: str, folder: Path) -> str | None:
    """The name in `folder` closest to `name`, among those with its suffix, matched on the stems: a shared
    `.jsonl` would make any two short names look alike (held.jsonl, d.jsonl)."""
    suffix = Path(name).suffix
    stems = {Path(n).stem: n for n in _names(folder) if Path(n).suffix == suffix}
    for match in difflib.get_close_matches(Path(name).stem, list(stems), n=3, cutoff=CUTOFF):
        if stems[match] != name and not _numbered_alike(match, Path(name).stem):
            return stems[match]
    return None


def close_sibling(p: Path) -> Path | None:
    """The existing path `p` most likely meant, where `p`'s own folder (or, for a typo in that folder's name, the
    folder above it) is here and holds a close name; None where nothing is near (the storage is not mounted, or
    the name is new, or a folder on the way this user may not look in: the caller's own message stands)."""
    try:
        return _close_sibling(p)
    except OSError:
        return None


def _close_sibling(p: Path) -> Path | None:
    if p.parent.is_dir():
        match = _close(p.name, p.parent)
        return None if match is None else p.parent / match
    folder = p.parent
    if folder.parent.is_dir() and folder.name:
        match = _close(folder.name, folder.parent)
        if match is not None and (folder.parent / match / p.name).exists():
            return folder.parent / match / p.name
    return None
