"""A cache of GGUF models converted to Hugging Face folders, so only the first run pays for the conversion.

transformers reads a GGUF file by parsing all of its metadata (the tokenizer's vocabulary and merges included) and
de-quantizing every tensor, on every load: for SmolLM2-135M about 25 s on a 2-core CPU, against well under a
second for the same model saved as safetensors. An entry holds what `save_pretrained` writes, in two parts:
`meta/` (config.json and the tokenizer files; what `check` and the tokenizer need) and `weights-<dtype>/`
(config.json and model.safetensors in the dtype a run loads; one per dtype, so a bf16 run's entry is half the size
of an fp32 one and each loads bitwise what a direct GGUF load in that dtype gives).

The key is the GGUF file's identity (resolved path, size, modification time in nanoseconds) and the versions of
transformers and of this layout; hashing the file instead would cost a read of the whole file on every run (a
second for a 1 GB file, minutes for a 30 GB one) to guard only against a file rewritten in place with the same
size and the same mtime. Each part is built in a temporary folder and renamed into place, with a manifest of its
files' sizes written last, so a reader never takes half a part; a part whose manifest does not match its files is
rebuilt. A lock file lets one process (one rank of a torchrun job, or one of two runs) convert while the others
wait and then read its result; where locks do not work, each converts and the first rename wins.

`SHARDFIT_MODEL_CACHE=0` turns the cache off; a path there moves it (default
`$XDG_CACHE_HOME/shardfit/gguf`, else `~/.cache/shardfit/gguf`). A cache that cannot be written only means the
model is converted again, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from shardfit.models.source import ModelSource

log = logging.getLogger("shardfit")

ENV = "SHARDFIT_MODEL_CACHE"
VERSION = 1  # bump when what a part holds changes meaning
KEEP = 4  # entries (GGUF files) kept, the most recently used; older ones go when a new one is written
MANIFEST = "shardfit-manifest.json"
OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether the environment leaves the cache on."""
    return os.environ.get(ENV, "1").strip().lower() not in OFF


def cache_dir() -> Path:
    """Where entries live: `$SHARDFIT_MODEL_CACHE` when it is a path, else `$XDG_CACHE_HOME/shardfit/gguf`, else
    `~/.cache/shardfit/gguf`."""
    value = os.environ.get(ENV, "").strip()
    if value and value.lower() not in OFF + ("1", "true", "yes", "on"):
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardfit" / "gguf"


def weights_part(dtype: object) -> str:
    """The part that holds the weights in `dtype` (a torch dtype): `weights-float32`, `weights-bfloat16`."""
    return "weights-" + str(dtype).removeprefix("torch.")


def _transformers_version() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "unknown"


def entry_key(gguf_path: Path) -> str:
    """The entry's name: the GGUF file's identity and the versions that decide what the conversion writes."""
    p = gguf_path.resolve()
    st = p.stat()
    parts = {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "transformers": _transformers_version(),
             "layout": VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def gguf_path(source: ModelSource) -> Path | None:
    """The GGUF file a source names, or None when its weights are not GGUF."""
    return Path(source.folder) / source.gguf_file if source.gguf_file else None


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def is_complete(part: Path) -> bool:
    """A part is complete when its manifest exists and every file it lists has the size it lists."""
    try:
        listed = json.loads((part / MANIFEST).read_text())["files"]
        return bool(listed) and all((part / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _discard(folder: Path) -> None:
    """Remove a folder without a reader ever seeing it half removed: rename it aside first."""
    aside = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    try:
        folder.rename(aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` for this process; none where the platform has no flock (then each process
    converts on its own and the atomic rename keeps the folder whole)."""
    try:
        import fcntl  # POSIX only: a function-local import so the module still loads elsewhere
    except ImportError:
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    (tmp / MANIFEST).write_text(json.dumps({"files": _files(tmp)}, indent=1))
    try:
        tmp.rename(final)
    except OSError:  # another process renamed its copy first: keep that one when it is whole
        if is_complete(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        _discard(final)
        tmp.rename(final)


def _prune(root: Path, keep: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP - 1:]:
        _discard(old)


def lookup(source: ModelSource, part: str) -> Path | None:
    """The complete folder of `part` when the cache is on and holds it, else None; converts nothing."""
    gguf = gguf_path(source)
    if gguf is None or not enabled() or not gguf.is_file():
        return None
    final = cache_dir() / entry_key(gguf) / part
    return final if is_complete(final) else None


def cached_part(source: ModelSource, part: str, convert: Callable[[Path], None]) -> Path | None:
    """The folder of `part` of the source's entry, converted by `convert(folder)` (which writes the HF files into
    it) when it is missing or incomplete. None when the source is not GGUF, the cache is off, or it cannot be
    written; the caller then loads the GGUF directly. `convert`'s own errors (a bad GGUF file) propagate."""
    gguf = gguf_path(source)
    if gguf is None or not enabled() or not gguf.is_file():
        return None
    entry = cache_dir() / entry_key(gguf)
    final = entry / part
    if is_complete(final):
        with contextlib.suppress(OSError):
            os.utime(entry)  # pruning keeps the entries used most recently, not the ones converted last
        return final
    try:
        entry.mkdir(parents=True, exist_ok=True)
        with _locked(entry / f".{part}.lock"):
            if is_complete(final):  # another process converted it while this one waited
                return final
            if final.exists():
                log.info("model cache: %s is incomplete; converting %s again", final, source.name)
                _discard(final)
            log.info("model cache: converting %s (%s) to %s, once", source.name, part, final)
            tmp = Path(tempfile.mkdtemp(dir=entry, prefix=f".{part}-"))
            try:
                convert(tmp)
                _publish(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            (entry / "source.json").write_text(json.dumps({"gguf": str(gguf.resolve()), "name": source.name}))
        _prune(entry.parent, entry)
    except OSError as e:
        log.info("model cache not used (%s); converting %s from GGUF", e, source.name)
        return None
    return final if is_complete(final) else None
