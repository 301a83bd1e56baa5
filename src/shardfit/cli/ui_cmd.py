"""`shardfit ui`: the plan calculator, launching runs and their live reports in a local web page."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardfit.gc_policy import end_of_startup

EXAMPLE = "example: shardfit ui --runs runs/    then open http://127.0.0.1:7860"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="local web UI: plan calculator, launch a run, live reports", epilog=EXAMPLE)
    p.add_argument("--runs", default="runs", help="the folder whose run directories the UI lists (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardfit.ui.server import make_server  # matplotlib (plan plot, reports): only for this command

    server = make_server(Path(args.runs), args.host, args.port)
    host, port = server.server_address[:2]
    print(f"shardfit ui on http://{host}:{port} (runs from {args.runs}; Ctrl-C stops it)", flush=True)
    end_of_startup()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
