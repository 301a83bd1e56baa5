"""`shardfit diagnose`: root cause and fix for a pasted error log."""

from __future__ import annotations

import argparse
import json
import sys

from shardfit.diagnose.engine import analyze
from shardfit.diagnose.report import format_text, read_input, to_json

EXAMPLE = "example: shardfit diagnose crash.log   (or paste: shardfit diagnose - < crash.log)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diagnose", help="paste an error log from any framework: root cause and fix", epilog=EXAMPLE)
    d.add_argument("file", nargs="?", default=None, help="log file, or - (default) for stdin")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    note: list[str] = []
    analysis = analyze(read_input(args.file, note))
    for line in note:
        print(f"shardfit diagnose: note: {line}", file=sys.stderr)
    print(json.dumps(to_json(analysis), indent=2, ensure_ascii=False) if args.json else format_text(analysis),
          end="\n" if args.json else "")
    return 0
