"""The process's stdout and stderr when they cannot be written (`shardfit plan ... >&-`, `> /dev/full`, `2>&-`, a
stderr pipe whose reader went away).

stdout carries what a command produces: output that cannot reach it is a failure the user must hear of, so a write
or flush that fails raises `OutputLost` and `main` exits 1 with one line on stderr, as `cat` and `echo` do. Python
leaves a stdout closed at start as None, which `print` writes nothing to without a word, and reports a failed flush
at exit as an ignored exception (exit 120): both become `OutputLost`. A reader that went away is not a failure of
the command (`shardfit plan | head`): the BrokenPipeError passes through, and `main` ends quietly with 141.

stderr only carries messages about the run: when it cannot be written they are dropped, and the process exits with
the code the run has (0, 1, 2, 3, ...), its only channel left; no traceback, no "Exception ignored", no hang. A
closed stderr would otherwise send `print(..., file=sys.stderr)` to stdout (print's target when file is None),
mixing error messages into the output.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class OutputLost(Exception):
    """The command's output could not be written to stdout; the message says why, in one line."""


class _Stream:
    """A text stream standing in for sys.stdout or sys.stderr: the real one (None when its descriptor was closed at
    start), everything but writing and flushing handed to it."""

    def __init__(self, stream: TextIO | None, fd: int) -> None:
        self._stream = stream
        self._fd = fd
        self.lost = False  # a write failed: later ones are dropped, so only the first is reported

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)  # as for None: the callers that probe (fileno, isatty) expect this
        return getattr(self._stream, name)

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def _drain(self) -> None:
        """Point the descriptor at the null device, so that what the stream still holds flushes somewhere (at
        exit too) and nothing written later fails again."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        if null != self._fd:
            os.dup2(null, self._fd)
            os.close(null)


class GuardedStdout(_Stream):
    """sys.stdout: a write or flush that fails raises OutputLost (a broken pipe stays a BrokenPipeError)."""

    def write(self, text: str) -> int:
        if self.lost:
            return len(text)
        if self._stream is None:
            self.lost = True
            raise OutputLost("stdout is closed, so the output had nowhere to go; run the command with stdout "
                             "open (> FILE to keep it, > /dev/null to discard it).")
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self._failed(e) from None

    def flush(self) -> None:
        if self.lost or self._stream is None:
            return  # nothing was written, or its loss is reported already
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self._failed(e) from None

    def _failed(self, e: OSError) -> OutputLost:
        self.lost = True
        self._drain()
        return OutputLost(f"cannot write the output to stdout ({e.strerror or e}); the output is incomplete. "
                          f"Write it where there is room and access (> FILE).")


class GuardedStderr(_Stream):
    """sys.stderr: a write it cannot take is dropped, never raised; a closed one takes nothing."""

    def write(self, text: str) -> int:
        if self._stream is not None and not self.lost:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed under us
                self.lost = True
                self._drain()
        return len(text)

    def flush(self) -> None:
        if self._stream is not None and not self.lost:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self.lost = True
                self._drain()


def guard() -> None:
    """Put the guarded streams in place of sys.stdout and sys.stderr (once, for the whole process)."""
    if not isinstance(sys.stdout, GuardedStdout):
        sys.stdout = GuardedStdout(sys.stdout, 1)  # type: ignore[assignment]
    if not isinstance(sys.stderr, GuardedStderr):
        sys.stderr = GuardedStderr(sys.stderr, 2)  # type: ignore[assignment]


def fill_closed() -> None:
    """Give a descriptor 1 or 2 that was closed at start the null device: otherwise the next file this process
    opens takes its number, and whatever writes to it as stdout or stderr (a library's C code, a child process)
    writes into that file. The guarded streams still know the stream was closed."""
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                continue
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
