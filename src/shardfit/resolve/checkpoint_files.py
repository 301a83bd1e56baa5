"""What a checkpoint directory holds, read as files only (torch-free): whether it is whole (its manifest's sizes
and checksums) and whether the path `resume:` names is one to continue from. `train` loads from the path this
accepts, and `check` applies the same rule, so both refuse a missing or damaged checkpoint with the same words."""

from __future__ import annotations

import hashlib
import json
import re
import socket
from pathlib import Path

from shardfit.errors import UserError

MANIFEST = "manifest.json"
# Written last into a checkpoint (step, tokens, scheduler): a directory without it is no checkpoint.
TRAINER_FILE = "trainer.pt"
# A checkpoint's folder under the run directory's checkpoints/ (temporary ones are named .tmp-step-N).
STEP_DIR = re.compile(r"^step-(\d+)$")


def file_digest(path: str | Path) -> str:
    """The sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def intact(ckpt: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest, else what is wrong. Checkpoints written before
    manifests existed are taken as they are."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return None if (ckpt / TRAINER_FILE).is_file() else f"no {TRAINER_FILE}"
    try:
        entries = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return "unreadable manifest"
    if not isinstance(entries, dict):
        return "unreadable manifest"
    for name, want in entries.items():
        p = ckpt / name
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or "sha256" not in want:
            return "unreadable manifest"
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, not {want['bytes']}"
        if file_digest(p) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / TRAINER_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


# Values other tools take for "the newest checkpoint": never a path, so never resolvable on any machine.
_NOT_A_PATH = re.compile(r"(?i)(latest|last|newest|recent|best|final|true|yes|on|resume|continue)")


def _path(resume: str) -> Path:
    """The path `resume:` names, `~` expanded as data: and model: expand it; a word that only other tools take for
    the newest checkpoint is refused (there is nothing it could name on any machine)."""
    if _NOT_A_PATH.fullmatch(resume.strip()) and not Path(resume).exists():
        raise UserError(f"'resume': {resume!r} is no checkpoint path. Use resume: auto (the newest whole checkpoint "
                        "of output_dir), never, or a checkpoint's folder (a run's checkpoints/step-N).")
    return _expanded(resume, "resume", "the checkpoint's full path (a run's checkpoints/step-N folder)")


def _expanded(value: str, key: str, what: str) -> Path:
    """`value` of config key `key` as a path, `~` expanded; a UserError naming the key (and `what` to give
    instead) where it names the home of a user this machine does not know (`~user/...`)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise UserError(f"'{key}': {value!r} names the home of a user {socket.gethostname()} does not know. Give "
                        f"{what}.") from None


def _unreadable(resume: str, e: OSError) -> UserError:
    return UserError(f"'resume': {resume} cannot be read on {socket.gethostname()} ({e.strerror or e}). Correct the "
                     "path (a run's checkpoints/step-N folder), or give this user read access to it.")


def absent_here(resume: str) -> bool:
    """Whether `resume:` names a path with nothing at it on this machine (auto and never name none). A value that
    can be no path, or one the OS refuses to look at (a name too long, a folder this user may not enter), is a
    UserError naming the key."""
    if resume in ("auto", "never"):
        return False
    p = _path(resume)
    try:
        return not p.exists()
    except OSError as e:
        raise _unreadable(resume, e) from None


def _instead(p: Path, output_dir: str | None) -> str:
    """A checkpoint to name in place of the refused path `p`: the newest whole one (the one train's auto mode
    would take) of the run the path points into (its checkpoints/ folder, or the run directory itself), else of
    `output_dir`; where none has any, what a checkpoint's path looks like, never a made-up path (which could be the
    very one refused)."""
    runs = [p.parent.parent] if p.parent.name == "checkpoints" else []
    runs += [p.parent if p.name == "checkpoints" else p]
    runs += [_expanded(output_dir, "output_dir", "the run directory's full path")] if output_dir else []
    for run in runs:
        try:
            saved = [path for _, path in list_checkpoints(run) if path != p and intact(path) is None]
        except OSError:
            continue
        if saved:
            return f"e.g. {saved[-1]} (the newest whole one of {len(saved)} in {saved[-1].parent})"
    where = f"; {Path(output_dir) / 'checkpoints'} holds none" if output_dir else ""
    return f"a step-N folder under a run's checkpoints/, holding {TRAINER_FILE}{where}"


def named_checkpoint(resume: str, output_dir: str | None = None) -> Path | None:
    """The checkpoint a `resume:` path names (None for auto and never, which pick from the run directory): a
    UserError naming the key where it is not a shardfit checkpoint, is damaged or cannot be read, and a checkpoint
    to name instead (of the run the path points into, or of `output_dir`)."""
    if resume in ("auto", "never"):
        return None
    p = _path(resume)
    try:
        if not (p / TRAINER_FILE).is_file():
            why = f"nothing is at that path on {socket.gethostname()}" if absent_here(resume) else \
                f"no {TRAINER_FILE} in it"
            raise UserError(f"'resume': {resume} is not a shardfit checkpoint ({why}). Use auto (the newest "
                            f"checkpoint of output_dir), never, or a checkpoint's path: {_instead(p, output_dir)}.")
        problem = intact(p)
    except OSError as e:
        raise _unreadable(resume, e) from None
    if problem is not None:
        raise UserError(f"'resume': {resume} is damaged ({problem}); resume from an earlier checkpoint.")
    return p
