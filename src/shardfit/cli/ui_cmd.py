"""`shardfit ui`: the plan calculator, launching runs and their live reports in a local web page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardfit.errors import UserError
from shardfit.gc_policy import end_of_startup

EXAMPLE = ("example: shardfit ui --runs runs/    then open the http://127.0.0.1:7860/?token=... URL it prints")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="local web UI: plan calculator, launch a run, live reports", epilog=EXAMPLE)
    p.add_argument("--runs", default="runs", help="the folder whose run directories the UI lists, and whose "
                                                  "configs it may launch (default: runs)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="a config file outside --runs the page may launch too (repeat for several)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardfit.ui.guard import is_loopback
    from shardfit.ui.server import make_server  # matplotlib (plan plot, reports): only for this command

    for config in args.config:
        if not Path(config).is_file():
            raise UserError(f"--config {config}: no such file; name a config the page may launch.")
    server = make_server(Path(args.runs), args.host, args.port, configs=[Path(c) for c in args.config])
    if not is_loopback(args.host):
        print(f"shardfit ui: warning: --host {args.host} is reachable from other machines; anyone who has the "
              "URL's token can start training here. Use the default 127.0.0.1 and an SSH tunnel unless you mean it.",
              file=sys.stderr)
    print(f"shardfit ui on {server.url} (runs from {args.runs}; Ctrl-C stops it)", flush=True)
    end_of_startup()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
