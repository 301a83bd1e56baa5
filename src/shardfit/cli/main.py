"""`shardfit train | plan | check | diagnose | export` (CONTRACTS.md section 1).

User errors print one message and exit 2; nothing-fits exits 3; a failed job exits 1. No traceback for the first two.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from shardfit import __version__
from shardfit.errors import ShardfitError, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too, but we want one style of message
        self.print_usage(sys.stderr)
        print(f"shardfit: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _train_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune (no CONFIG: the built-in demo)")
    p.add_argument("config", nargs="?", help="YAML config; omit for the built-in demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set lr=1e-4 --set lora.rank=16")
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: all GPUs; 1 on CPU)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of a c10d rendezvous (elastic multi-node)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank dies")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardfit", description="Fine-tune open LLMs on the GPUs you have.")
    parser.add_argument("--version", action="version", version=f"shardfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_args(sub)
    from shardfit.cli import commands

    commands.add_subcommands(sub)
    return parser


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from shardfit.parallel.env import under_launcher
    from shardfit.parallel.launch import default_nproc, relaunch, torchrun_command

    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}.")
    if (nproc > 1 or args.nnodes > 1) and not under_launcher():
        if args.config:
            from shardfit.config import load_config
            from shardfit.models.load import require_method_support
            from shardfit.train.loop import check_device_map

            cfg = load_config(args.config, args.overrides)  # fail fast, once, before starting ranks
            require_method_support(cfg)
            if cfg.strict:
                check_device_map(cfg, cfg.strategy)
        passthrough = ["train"] + ([args.config] if args.config else [])
        for item in args.overrides:
            passthrough += ["--set", item]
        cmd = torchrun_command(passthrough, nproc, args.nnodes, args.node_rank, args.master_addr,
                               args.master_port, args.rdzv_endpoint, args.max_restarts)
        print("shardfit: launching " + " ".join(cmd[1:]), file=sys.stderr)
        return relaunch(cmd)

    from shardfit.parallel.env import init_distributed, shutdown

    env = init_distributed()
    if not env.is_main:
        logging.getLogger("shardfit").setLevel(logging.ERROR)
    ok = False
    try:
        if args.config is None:
            from shardfit.demo.run import run_demo

            run_demo(env, args.overrides)
        else:
            from shardfit.config import load_config
            from shardfit.train.loop import train

            cfg = load_config(args.config, args.overrides)
            result = train(cfg, env)
            if env.is_main:
                s = result.summary
                print(f"done: {s['steps']} steps, train loss {s['train_loss']}, eval loss {s['eval_loss']}, "
                      f"{s['tokens_per_s']} tokens/s; outputs in {result.run_dir}")
        ok = True
    finally:
        shutdown(env, ok)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="shardfit: %(levelname)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, argv)
        return args.func(args)
    except ShardfitError as e:
        print(f"shardfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
