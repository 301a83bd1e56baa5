"""`shardfit train`: the demo (no config) or a fine-tune, in this process or relaunched under torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shardfit.cli.launch_flags import add_launch_flags, check_launch_flags
from shardfit.config import load_config
from shardfit.doctor.launch import Launch, launch_rules
from shardfit.strategy import get as get_strategy

log = logging.getLogger("shardfit")
EXAMPLE = "example: shardfit train my.yaml --set lr=1e-4 --nproc 2"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune (no CONFIG: the built-in demo)", epilog=EXAMPLE)
    p.add_argument("config", nargs="?", help="YAML config; omit for the built-in demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set lr=1e-4 --set lora.rank=16")
    add_launch_flags(p)
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank dies")
    p.set_defaults(func=run)


def _validate_before_launch(args: argparse.Namespace, world: int) -> None:
    """Fail once, in seconds, before starting ranks that would each fail the same way."""
    from shardfit.check.rules import device_map_rules  # torch and transformers: only to train
    from shardfit.models.build import require_method_support
    from shardfit.train.recipe import refuse_unfixable

    cfg = load_config(args.config, args.overrides)
    require_method_support(cfg)
    refuse_unfixable(device_map_rules(cfg, get_strategy("single" if cfg.strategy == "auto" else cfg.strategy), world))


def _warn_launch_traps(args: argparse.Namespace, nproc: int) -> None:
    """The launch mistakes `doctor` finds before any rank starts (a loopback master address on several nodes, a
    job system with more nodes than this launch), as warnings: `shardfit doctor` says more."""
    launch = Launch(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)
    for f in launch_rules(launch, os.environ):
        log.warning("%s: %s. Fix: %s (check the launch with `shardfit doctor`, same flags)", f.rule, f.message, f.fix)


def run(args: argparse.Namespace) -> int:
    from shardfit.parallel.env import init_distributed, shutdown, under_launcher  # torch: only to train
    from shardfit.parallel.launch import default_nproc, relaunch, torchrun_command
    from shardfit.parallel.sidechannel import SideChannel
    from shardfit.parallel.watchdog import Watchdog

    nproc = args.nproc if args.nproc is not None else default_nproc()
    check_launch_flags(args, nproc)
    if not under_launcher():
        _warn_launch_traps(args, nproc)
    if (nproc > 1 or args.nnodes > 1) and not under_launcher():
        if args.config:
            _validate_before_launch(args, nproc * args.nnodes)
        passthrough = ["train"] + ([args.config] if args.config else [])
        for item in args.overrides:
            passthrough += ["--set", item]
        cmd = torchrun_command(passthrough, nproc, args.nnodes, args.node_rank, args.master_addr,
                               args.master_port, args.rdzv_endpoint, args.max_restarts)
        print("shardfit: launching " + " ".join(cmd[1:]), file=sys.stderr)
        return relaunch(cmd)

    env = init_distributed()
    if not env.is_main:
        logging.getLogger("shardfit").setLevel(logging.ERROR)
    # Started before anything can fail: a rank that fails in setup must not leave the others in a collective.
    watchdog = Watchdog(env, SideChannel.connect(env.rank, env.world)).start()
    ok = False
    try:
        if args.config is None:
            from shardfit.demo.run import run_demo

            run_demo(env, args.overrides, watchdog=watchdog)
        else:
            from shardfit.train.recipe import train

            result = train(load_config(args.config, args.overrides), env, watchdog=watchdog)
            if env.is_main:
                s = result.summary
                print(f"done: {s['steps']} steps, train loss {s['train_loss']}, eval loss {s['eval_loss']}, "
                      f"{s['tokens_per_s']} tokens/s; outputs in {result.run_dir}")
        ok = True
    except BaseException as e:
        instead = watchdog.failed(e)  # tells the other ranks; names the rank that failed first, if another did
        if instead is e:
            raise
        raise instead from e
    finally:
        watchdog.stop()
        shutdown(env, ok)
    return 0
