"""`shardfit train`: the demo (no config) or a fine-tune, in this process or relaunched under torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardfit.check.config_rules import device_map_rules, float8_rules, qlora_rules, refuse_missing_inputs
from shardfit.check.findings import refuse_unfixable
from shardfit.cli.args import non_negative_int
from shardfit.cli.launch_flags import add_launch_flags, check_launch_flags
from shardfit.config import Config, load_config
from shardfit.doctor.launch import Launch, launch_rules
from shardfit.errors import Interrupted, UserError
from shardfit.resolve.job import ENV as RESOLVED_ENV
from shardfit.resolve.job import Resolved
from shardfit.strategy import get as get_strategy

if TYPE_CHECKING:  # torch: imported only by the process that trains
    from shardfit.parallel.env import DistEnv
    from shardfit.parallel.watchdog import Watchdog

log = logging.getLogger("shardfit")
EXAMPLE = "example: shardfit train my.yaml --set lr=1e-4 --nproc 2"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune (no CONFIG: the built-in demo)", epilog=EXAMPLE)
    p.add_argument("config", nargs="?", help="YAML config; omit for the built-in demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set lr=1e-4 --set lora.rank=16")
    add_launch_flags(p)
    p.add_argument("--max-restarts", type=non_negative_int, default=0, help="torchrun restarts after a rank dies")
    p.set_defaults(func=run)


def _refuse_before_launch(cfg: Config, job: Resolved) -> None:
    """What would stop every rank the same way, said once before ranks start (after `refuse_missing_inputs`)."""
    s = get_strategy(job.strategy)
    refuse_unfixable(device_map_rules(cfg, s, job.world) + qlora_rules(cfg, s) + float8_rules(cfg, job))


def _base_line(base: dict) -> list[str]:
    """The base an adapter names (summary.json's base_model) and, for a GGUF run, where that name came from."""
    if not base.get("name"):
        return []
    source = base.get("source", "config")
    why = "" if source == "config" else \
        " (the GGUF's weights as a Hugging Face folder: the GGUF names no repository)" if source == "exported" else \
        f" (from the GGUF's {source.removeprefix('gguf metadata ')}; the run trained on its de-quantized weights)"
    return [f"base model it names: {base['name']}{why}"]


def finished_lines(s: dict, run_dir: Path, cfg: Config) -> str:
    """The last lines of a run: what it reached, where the result is, and what to do with it."""
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = [f"done: {s['steps']} steps; train loss {num(s['train_loss'], '.4f')}, eval loss "
           f"{num(s['eval_loss'], '.4f')}; {num(s.get('tokens_per_s'), ',.0f')} tokens/s training "
           f"({num(s.get('process_tokens_per_s'), ',.0f')} over the whole run, loading included)"]
    phases = s.get("startup_s") or {}
    if phases:
        out.append(f"start-up: {sum(phases.values()):.1f} s to the end of the first step ("
                   + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + ")")
    if (run_dir / "adapter").is_dir():
        out += [f"adapter: {run_dir / 'adapter'}  (peft: AutoPeftModelForCausalLM.from_pretrained(that folder))",
                *_base_line(s.get("base_model") or {}),
                f"merge it into a plain model folder: shardfit export {run_dir} --merge"]
    elif (run_dir / "model").is_dir():
        vl = (run_dir / "model" / "preprocessor_config.json").is_file()  # a vision-language model's folder
        loader = "AutoModelForImageTextToText" if vl else "AutoModelForCausalLM"
        out.append(f"model: {run_dir / 'model'}  ({loader}.from_pretrained(that folder))")
    out.append(f"metrics: {run_dir / 'metrics.jsonl'}, summary: {run_dir / 'summary.json'}")
    if cfg.profile_steps and (run_dir / "profile").is_dir():
        out.append(f"profile: {run_dir / 'profile'}  (ops-rank0.txt: the ops by time; trace-rank0.json: "
                   "chrome://tracing or ui.perfetto.dev)")
    return "\n".join(out)


def _warn_launch_traps(args: argparse.Namespace, nproc: int) -> None:
    """The launch mistakes `doctor` finds before any rank starts (a loopback master address on several nodes, a
    job system with more nodes than this launch), as warnings: `shardfit doctor` says more."""
    launch = Launch(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)
    for f in launch_rules(launch, os.environ):
        log.warning("%s: %s. Fix: %s (check the launch with `shardfit doctor`, same flags)", f.rule, f.message, f.fix)


def decide_launch(args: argparse.Namespace, cfg: Config | None) -> tuple[Resolved | None, int]:
    """The job and the processes per node this command starts. Every decision of the job is made here once, the
    number of processes included (strategy auto can pick model_parallel: one process over every GPU); the ranks
    read the job from their environment. A rank (under torchrun) decides nothing; the demo (no config) resolves in
    its process, on every GPU unless --nproc says otherwise."""
    from shardfit.parallel.launch import default_nproc, launch_threads, under_launcher

    if args.nproc is not None:
        check_launch_flags(args, args.nproc)
    job = None
    if under_launcher():
        nproc = args.nproc or 1
    elif cfg is not None:
        from shardfit.parallel.job import resolve_here
        from shardfit.resolve.resume import resumed_job

        threads = launch_threads(args.nproc, args.nnodes)
        # A resumed run keeps the job it started with where resolving anew would change its global batch.
        job, _ = resumed_job(cfg, lambda c: resolve_here(c, nproc=args.nproc, nnodes=args.nnodes, threads=threads))
        nproc = job.nproc_per_node
        log.info("%s", job.describe())  # the line `check` prints for the same flags
        for line in job.why:
            log.info("%s", line)
    else:
        nproc = args.nproc if args.nproc is not None else default_nproc()
    check_launch_flags(args, nproc)
    return job, nproc


def run(args: argparse.Namespace) -> int:
    if args.node_rank >= args.nnodes:
        raise UserError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: node ranks run from 0 to "
                        f"{args.nnodes - 1}; give each node its own rank in that range.")
    # The config first, without torch: a mistake in it is reported in a fraction of a second.
    cfg = load_config(args.config, args.overrides) if args.config else None
    from shardfit.parallel.launch import launch_env, relaunch, torchrun_command, under_launcher

    if cfg is not None and not under_launcher():
        refuse_missing_inputs(cfg)  # before the job is resolved: the planner reads a local model's config.json
    job, nproc = decide_launch(args, cfg)
    if not under_launcher():
        _warn_launch_traps(args, nproc)
        if cfg is not None and job is not None:
            _refuse_before_launch(cfg, job)
    if (nproc > 1 or args.nnodes > 1) and not under_launcher():
        extra = {}
        if cfg is not None and job is not None:
            extra[RESOLVED_ENV] = job.to_env()
        passthrough = ["train"] + ([args.config] if args.config else [])
        for item in args.overrides:
            passthrough += ["--set", item]
        cmd = torchrun_command(passthrough, nproc, args.nnodes, args.node_rank, args.master_addr,
                               args.master_port, args.rdzv_endpoint, args.max_restarts)
        print("shardfit: launching " + " ".join(cmd[1:]), file=sys.stderr)
        return relaunch(cmd, launch_env(extra, nproc=nproc))

    from shardfit.parallel.env import init_distributed  # torch: only to train
    from shardfit.parallel.sidechannel import SideChannel
    from shardfit.parallel.watchdog import Watchdog

    env = init_distributed()
    if not env.is_main:
        logging.getLogger("shardfit").setLevel(logging.ERROR)
    # Started before anything can fail: a rank that fails in setup must not leave the others in a collective.
    watchdog = Watchdog(env, SideChannel.connect(env.rank, env.world)).start()
    try:
        _train_here(args, cfg, job, env, watchdog)
    except KeyboardInterrupt:
        # One account of what survives, from rank 0 (the other ranks' would repeat it).
        raise Interrupted(_interrupted(args, cfg, env.world) if env.is_main else "") from None
    return 0


def _train_here(args: argparse.Namespace, cfg: Config | None, job: Resolved | None, env: DistEnv,
                watchdog: Watchdog) -> None:
    """This process's share of the training (the demo without a config), with the watchdog told of a failure."""
    from shardfit.parallel.env import shutdown

    ok = False
    try:
        if cfg is None:
            from shardfit.demo.run import run_demo

            run_demo(env, args.overrides, watchdog=watchdog)
        else:
            from shardfit.train.recipe import train

            result = train(cfg, env, job=job, watchdog=watchdog)
            if env.is_main:
                print(finished_lines(result.summary, result.run_dir, cfg))
        ok = True
    except BaseException as e:
        instead = watchdog.failed(e)  # tells the other ranks; names the rank that failed first, if another did
        if instead is e:
            raise
        raise instead from e
    finally:
        watchdog.stop()
        shutdown(env, ok)


def _interrupted(args: argparse.Namespace, cfg: Config | None, world: int) -> str:
    """Which checkpoint survives Ctrl-C and the command that continues from it (the user's own command line)."""
    from shardfit.demo.run import demo_config_path
    from shardfit.train.interrupt import interrupted_message

    if cfg is None:  # the demo: its bundled config with the user's overrides
        cfg = load_config(demo_config_path(), args.overrides)
    command = ["shardfit", "train"] + ([args.config] if args.config else [])
    for item in args.overrides:
        command += ["--set", item]
    nproc = args.nproc or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nproc > 1 or args.nnodes > 1:
        command += ["--nproc", str(nproc)]
    if args.nnodes > 1:  # each node reruns its own line: the same flags, its own --node-rank
        command += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank)]
        command += ["--master-addr", args.master_addr] if args.master_addr else []
        command += ["--rdzv-endpoint", args.rdzv_endpoint] if args.rdzv_endpoint else []
    return interrupted_message(Path(cfg.output_dir), cfg.resume, command)
