"""The `shardfit` command line: one module per command, listed in COMMANDS (docs/reference.md).

User errors print one message and exit 2; nothing-fits exits 3; a failed job exits 1. No traceback for any of
them; an unexpected exception prints a short message (its traceback with --debug or SHARDFIT_DEBUG=1). Output that
cannot be written to stdout exits 1 with one line on stderr; a reader of stdout that went away, 141 quietly; a
stderr that cannot be written changes nothing but the messages lost (streams.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
import traceback
from collections.abc import Sequence

from shardfit import __version__
from shardfit.cli.streams import OutputLost, fill_closed, guard
from shardfit.errors import Interrupted, ShardfitError, ran_out
from shardfit.gc_policy import process_entry
from shardfit.parallel import threads
from shardfit.parallel.allocator import reexec_with_allocator

# Each command's module under shardfit.cli, in the order `shardfit --help` lists them. A module is imported only
# when its command runs (or for the full list: --help, shell completion, a mistyped command): the parsers of plan,
# check and convert need the planner's and the foreign readers' tables, a second of imports that `diagnose`,
# `doctor` and `report` never use.
COMMANDS = {"train": "train_cmd", "plan": "plan_cmd", "check": "check_cmd", "convert": "convert_cmd",
            "diagnose": "diagnose_cmd", "export": "export_cmd", "chat": "chat_cmd", "eval": "eval_cmd",
            "report": "report_cmd", "ui": "ui_cmd", "doctor": "doctor_cmd"}
# Commands that compute with torch get their threads from the cores they may use (parallel/threads.py); the ones
# that run long say so when the machine is oversubscribed.
THREADED = ("train", "eval", "chat", "export", "plan", "check")
BUSY_WARNING = ("train", "eval", "chat")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # examples keep their lines
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # argparse exits 2 too, but we want one style of message
        self.print_usage(sys.stderr)
        print(f"shardfit: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, given the command line `argv` that names a command, one whose other
    commands are bare names: what `argv` parses to and every message it can print are the same either way (a
    command's errors and help are its own parser's; the top-level usage lists only names)."""
    parser = _Parser(prog="shardfit", description="Fine-tune open LLMs on the GPUs you have.")
    parser.add_argument("--version", action="version", version=f"shardfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    named = command_named(argv) if argv is not None else None
    for name, module in COMMANDS.items():
        if named is None or name == named:
            importlib.import_module(f"shardfit.cli.{module}").add_parser(sub)
        else:
            sub.add_parser(name)
    return parser


def command_named(argv: Sequence[str]) -> str | None:
    """The command `argv` runs: its first word, or the one after `--debug`, when that is a command's name and the
    shell is not asking for completions. Any other option before it may print the top-level help (`-h plan`: argparse
    acts on -h where it meets it) or name an abbreviation, which the full parser answers."""
    words = list(argv[1:]) if argv[:1] == ["--debug"] else list(argv)
    first = words[0] if words else None
    return first if first in COMMANDS and "_ARGCOMPLETE" not in os.environ else None


def configure_logging() -> None:
    """shardfit's own messages from INFO on stderr; other libraries' only from WARNING (matplotlib's font cache and
    the like are not the user's business)."""
    logging.basicConfig(level=logging.INFO, format="shardfit: %(levelname)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_own_info_only)
    # peft imports torchao whenever it is installed; on a CPU build its optional CUDA kernels fail to load and torch
    # warns about its enums. Neither concerns a user who does not train in 4 bits (real errors still show).
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _own_info_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.split(".")[0] == "shardfit"


def complete(parser: argparse.ArgumentParser) -> None:
    """Shell completion (`pip install shardfit[completion]`, then `eval "$(register-python-argcomplete shardfit)"`):
    when the shell asks for completions, argcomplete answers and exits; otherwise nothing happens."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete  # optional extra, imported only while the shell completes a command line
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone away (`shardfit plan ... | head`). Then stdout is pointed at
    the null device, so that the interpreter's last flush at exit does not report the broken pipe again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no real stdout, or no poll() on this system
        return False
    poller.register(fd, select.POLLOUT)
    if not any(ev & select.POLLERR for _, ev in poller.poll(0)):  # a pipe without readers polls as an error
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def unexpected(e: Exception, args: argparse.Namespace) -> int:
    """The last guard: a short message, not a traceback (the traceback with --debug), exit 1."""
    if args.debug or os.environ.get("SHARDFIT_DEBUG") == "1":
        traceback.print_exc()
    what = ran_out(e)
    if what is not None:  # an expected failure (chat, eval, export on too small a machine), not a bug
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"shardfit: error: out of memory: {what} ran out in `shardfit {args.command}` ({first}). Use a "
              "smaller batch (--batch-size, --batch), shorter inputs, or a device with more memory.",
              file=sys.stderr)
        return 1
    print(f"shardfit: error: unexpected {type(e).__name__}: {e}\nThis is a bug in shardfit or a case it does "
          "not handle yet; please report it with the command you ran (rerun with --debug for the traceback).",
          file=sys.stderr)
    return 1


def output_lost(e: OutputLost) -> int:
    """The command's output could not be written: say so on stderr, exit 1 (the output is not what it should be,
    whatever the command would have returned)."""
    print(f"shardfit: error: {e}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    parser = build_parser(argv)
    complete(parser)
    try:
        args = parser.parse_args(argv)
    except OutputLost as e:  # --help or --version with stdout closed (argparse drops only OSErrors itself)
        return output_lost(e)
    if args.command in THREADED:  # before the command imports torch: OpenMP reads its settings when torch loads
        threads.configure(quiet=args.command not in BUSY_WARNING)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit, where a failure is only "Exception ignored" and exit 120
        return code
    except OutputLost as e:
        return output_lost(e)
    except Interrupted as e:  # Ctrl-C in a command that knows what survives it
        print(f"shardfit: interrupted{f'. {e}' if str(e) else ''}", file=sys.stderr)
        return e.exit_code
    except ShardfitError as e:
        print(f"shardfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        # The reader of stdout went away: like cat or grep, stop without an error message.
        return 141 if stdout_closed() else unexpected(e, args)  # 141: 128 + SIGPIPE, as a shell reports it
    except Exception as e:  # noqa: BLE001 - the last guard: a message, not a traceback
        return unexpected(e, args)


def entry() -> int:
    """The process entry point (`shardfit`, `python -m shardfit`): `main` under the process's collector policy,
    `train` first re-executed with a faster malloc where the system has one (parallel/allocator.py). stdout and
    stderr are guarded first (streams.py); a descriptor closed at start is given the null device only after the
    re-execution, which then meets it closed as this process did."""
    guard()
    try:
        reexec_with_allocator(sys.argv[1:], os.environ)
    except ShardfitError as e:
        print(f"shardfit: error: {e}", file=sys.stderr)
        return e.exit_code
    fill_closed()
    return process_entry(main)


if __name__ == "__main__":
    raise SystemExit(entry())
