"""`shardfit report`: one HTML page (and PNGs) with a run's curves, memory per rank against the plan, config, plan,
summary and preflight findings; several runs side by side."""

from __future__ import annotations

import argparse

from shardfit.errors import UserError

EXAMPLE = """examples:
  shardfit report runs/demo                      writes runs/demo/report/report.html
  shardfit report runs/a runs/b --out compare/   two runs side by side
  shardfit report runs/big --watch 30            live while it trains (open the page; it reloads itself)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="HTML report: curves, memory per rank vs the plan, config, findings",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report, or ./report for several)")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="rebuild every SECONDS while the runs train (the page reloads itself) until all finish")
    p.add_argument("--x", choices=("auto", "step", "examples", "tokens"), default="auto",
                   help="the curves' x axis: auto (steps; examples seen when the runs' global batches differ), "
                        "step, examples or tokens")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardfit.report.build import make_report, watch  # matplotlib: only for this command, not every CLI start

    if args.watch is not None:
        if args.watch <= 0:
            raise UserError(f"--watch takes seconds between rebuilds, got {args.watch}.")
        page = watch(args.run_dirs, args.out, args.watch, x=args.x)
    else:
        page = make_report(args.run_dirs, args.out, x=args.x)
    print(f"report written to {page} (open it in a browser; the PNGs are beside it)")
    return 0
