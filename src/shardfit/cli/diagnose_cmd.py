"""`shardfit diagnose`: root cause and fix for a pasted error log."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardfit.diagnose.engine import diagnose
from shardfit.errors import UserError

EXAMPLE = "example: shardfit diagnose crash.log   (or paste: shardfit diagnose - < crash.log)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("diagnose", help="paste an error log from any framework: root cause and fix", epilog=EXAMPLE)
    d.add_argument("file", nargs="?", default=None, help="log file, or - (default) for stdin")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.file in (None, "-"):
        text = sys.stdin.read()
    else:
        p = Path(args.file)
        if not p.is_file():
            raise UserError(f"diagnose: no such file {p}; pass a log file, or - to read the pasted log from stdin.")
        text = p.read_text(errors="replace")
    findings = diagnose(text)
    if args.json:
        print(json.dumps({"findings": [f.to_json() for f in findings]}, indent=2, ensure_ascii=False))
        return 0
    if not findings:
        print("no known cause matched. Paste the whole log (the first error and the lines around it help most).")
        return 0
    for i, f in enumerate(findings, 1):
        print(f"{i}. {f.title}  [{f.category}, confidence {f.confidence:.2f}]")
        print(f"   cause: {f.root_cause}")
        print(f"   fix:   {f.fix}")
        print(f"   shardfit: {f.prevented_by}")
        print()
    return 0
