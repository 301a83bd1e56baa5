"""`shardfit check`: the preflight on a weightless model, with the findings `train` would apply."""

from __future__ import annotations

import argparse
import json

from shardfit.check.findings import is_ok
from shardfit.cli.args import positive_int
from shardfit.config import load_config
from shardfit.plan.hardware import parse_gpus

EXAMPLE = "example: shardfit check my.yaml --gpus 8x24GB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("check", help="preflight: find placement, sharding and precision problems before training",
                       epilog=EXAMPLE)
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks the run will use (default: from the strategy)")
    c.add_argument("--gpus", default=None, help="check for these GPUs, e.g. 8x24GB (default: this machine)")
    c.add_argument("--nodes", type=positive_int, default=1)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardfit.check.run import check_config, format_findings  # torch and transformers: only for this command

    cfg = load_config(args.config, args.overrides)
    hw = parse_gpus(args.gpus, args.nodes) if args.gpus else None
    strategy, findings = check_config(cfg, args.nproc, hw)
    ok = is_ok(findings)
    if args.json:
        print(json.dumps({"ok": ok, "findings": [f.to_json() for f in findings]}, indent=2))
    else:
        print(format_findings(strategy, findings))
    return 0 if ok else 1
