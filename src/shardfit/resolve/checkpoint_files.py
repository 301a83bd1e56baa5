"""What a checkpoint directory holds, read as files only (torch-free): whether it is whole (its manifest's sizes
and checksums) and whether the path `resume:` names is one to continue from. `train` loads from the path this
accepts, and `check` applies the same rule, so both refuse a missing or damaged checkpoint with the same words."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shardfit.errors import UserError

MANIFEST = "manifest.json"
# Written last into a checkpoint (step, tokens, scheduler): a directory without it is no checkpoint.
TRAINER_FILE = "trainer.pt"


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


def named_checkpoint(resume: str) -> Path | None:
    """The checkpoint a `resume:` path names (None for auto and never, which pick from the run directory): a
    UserError naming the key where it is not a shardfit checkpoint or is damaged."""
    if resume in ("auto", "never"):
        return None
    p = Path(resume)
    if not (p / TRAINER_FILE).is_file():
        raise UserError(f"'resume': {resume} is not a shardfit checkpoint (no {TRAINER_FILE}). Use auto, never, "
                        f"or a path like runs/demo/checkpoints/step-200.")
    problem = intact(p)
    if problem is not None:
        raise UserError(f"'resume': {resume} is damaged ({problem}); resume from an earlier checkpoint.")
    return p
