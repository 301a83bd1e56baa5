"""`shardfit diagnose`: root cause and fix for a pasted error log."""

from __future__ import annotations

import argparse
import json

from shardfit.diagnose.engine import analyze
from shardfit.diagnose.report import format_text, read_input, to_json

EXAMPLE = "example: shardfit diagnose crash.log   (or paste: shardfit diagnose - < crash.log)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diagnose", help="paste an error log from any framework: root cause and fix", epilog=EXAMPLE)
    d.add_argument("file", nargs="?", default=None, help="log file, or - (default) for stdin")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    analysis = analyze(read_input(args.file))
    print(json.dumps(to_json(analysis), indent=2, ensure_ascii=False) if args.json else format_text(analysis),
          end="\n" if args.json else "")
    return 0
