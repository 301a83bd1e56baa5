"""One parse of a GGUF file for all of a caller's loads from it.

transformers builds a config, a tokenizer and the weights from a GGUF file with three loaders, and each parses the
whole file again (`gguf.GGUFReader`: every metadata field, the tokenizer's vocabulary and merges among them): for
SmolLM2-135M about 3 s a parse on a 2-core CPU, three times in the demo's first run (then the model cache,
models/gguf_cache.py, saves the parsed result as a folder). A `GGUFReads` object, owned by the code that loads,
keeps the parsed readers; while its `shared()` scope is open, transformers' loaders get them instead of parsing
again. A reader is read-only (the file is memory-mapped and only read), so one serves every loader.

The key is the file's identity: resolved path, size and modification time in nanoseconds, as the model cache keys
its entries; a file rewritten in place is parsed again. Nothing is kept outside the object: its owner drops it (or
calls `clear`) and the memory maps go with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def file_key(path: str | Path) -> tuple[str, int, int]:
    """A GGUF file's identity: (resolved path, size, mtime in nanoseconds)."""
    p = Path(path).resolve()
    st = p.stat()
    return str(p), st.st_size, st.st_mtime_ns


class GGUFReads:
    """Parsed GGUF files (`gguf.GGUFReader`), one per file identity, for the loads of the object's owner."""

    def __init__(self) -> None:
        self._readers: dict[tuple[str, int, int], Any] = {}

    def __len__(self) -> int:
        """The files parsed and kept."""
        return len(self._readers)

    def reader(self, parse: Any, path: str | Path) -> Any:
        """The kept reader of `path`, else `parse(path)` kept for the next call. A path that cannot be looked at is
        left to `parse`, which raises the loader's own error."""
        try:
            key = file_key(path)
        except OSError:
            return parse(path)
        if key not in self._readers:
            self._readers[key] = parse(path)
        return self._readers[key]

    def clear(self) -> None:
        """Drop the kept readers (and their memory maps)."""
        self._readers.clear()

    @contextlib.contextmanager
    def shared(self) -> Iterator[GGUFReads]:
        """While open, every `gguf.GGUFReader(path)` made for reading (transformers' GGUF loaders make one each,
        importing the name when they run) is this object's reader of that file. The module's own class is given
        back when the scope closes, also when a load fails; the patch is the process's while open, as loads are."""
        import gguf  # only where a GGUF file is loaded: transformers' GGUF loading needs it too

        parse = gguf.GGUFReader

        def read(path: str | Path, mode: str = "r") -> Any:
            return self.reader(parse, path) if mode == "r" else parse(path, mode)

        gguf.GGUFReader = read
        try:
            yield self
        finally:
            gguf.GGUFReader = parse
