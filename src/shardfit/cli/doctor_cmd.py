"""`shardfit doctor`: launch the rendezvous `train` would, and report whether the ranks can talk, how fast, and
which environment traps are set. Exit 0 when healthy, 1 when a finding is an error, 2 on bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardfit.check.findings import Finding
from shardfit.cli.launch_flags import add_launch_flags, check_launch_flags
from shardfit.config import load_config
from shardfit.doctor.launch import Launch, failure_findings, launch_rules
from shardfit.doctor.report import Report, format_text
from shardfit.errors import UserError

EXAMPLE = """examples:
  shardfit doctor --nproc 4
  shardfit doctor my.yaml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1   # on node 0
  shardfit doctor my.yaml --nnodes 2 --node-rank 1 --master-addr 10.0.0.1   # on node 1, at the same time"""
OUT_ENV = "SHARDFIT_DOCTOR_OUT"  # where the ranks of our own torchrun leave the report for the launching process
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="prove the ranks of a launch can talk: rank map, link bandwidth, traps",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="the run's YAML config: its output_dir must be shared and its data "
                                             "files the same on every node")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, as for train")
    add_launch_flags(p)
    p.add_argument("--output-dir", default=None, help="check this directory instead of the config's output_dir")
    p.add_argument("--sizes", default=None, help="message sizes to time, e.g. 1MiB,64MiB (K/M/G are powers of 2; "
                                                 "default 64KiB,1MiB,16MiB on gloo, 1MiB,64MiB,256MiB on NCCL)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size (median reported)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the other nodes, and for each collective (default 60)")
    p.add_argument("--peer-wait", type=float, default=5.0,
                   help="with an output_dir: seconds to watch it for other nodes' lone groups (default 5)")
    p.add_argument("--json", action="store_true", help="findings in the check format, plus ranks and links")
    p.set_defaults(func=run)


def parse_sizes(text: str | None) -> list[int] | None:
    """`64KiB,1MiB` -> [65536, 1048576]; a UserError naming the bad item."""
    if text is None:
        return None
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", item)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 4:
            raise UserError(f"--sizes '{item.strip()}': expected sizes such as 64KiB,1MiB,256MiB (at least 4 bytes).")
        out.append(int(float(m.group(1)) * _UNITS[unit]))
    return out


def _options(args: argparse.Namespace) -> dict:
    """The probe's options from the flags and the config (torch-free: ProbeOptions takes them on the ranks)."""
    if args.iters < 1:
        raise UserError(f"--iters must be at least 1, got {args.iters}.")
    if not 0 < args.timeout < float("inf") or not 0 <= args.peer_wait < float("inf"):  # nan fails both
        raise UserError("--timeout must be positive and --peer-wait at least 0.")
    output_dir, data = args.output_dir, []
    if args.config is not None:
        # Files are not required here: doctor reports which node misses them.
        cfg = load_config(args.config, args.overrides, check_files=False)
        output_dir = output_dir or cfg.output_dir
        for value in (cfg.data, cfg.eval_data):
            data += [_as_train_finds(p, args.config) for p in ([value] if isinstance(value, str) else value or [])]
    return dict(output_dir=output_dir, sizes=parse_sizes(args.sizes), iters=args.iters, timeout_s=args.timeout,
                peer_wait_s=args.peer_wait, data_files=data)


def _as_train_finds(path: str, config: str) -> str:
    """A data path as `train` resolves it: from the working directory, else from the config's folder."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return str(p)
    beside = Path(config).parent / p
    return str(beside) if beside.exists() else str(p)


def _print(report: Report, as_json: bool) -> None:
    print(json.dumps(report.to_json(), indent=2) if as_json else format_text(report))


def run(args: argparse.Namespace) -> int:
    options = _options(args)
    if args.nproc is not None:
        check_launch_flags(args, args.nproc)  # bad flags fail in a blink, before torch loads
    # torch (and the probe that uses it) only from here: every other command starts without it
    from shardfit.doctor.probe import ProbeOptions, run_probe
    from shardfit.parallel.launch import default_nproc, launch_env, torchrun_command, under_launcher

    opts = ProbeOptions(**options)
    if under_launcher():
        return _as_rank(opts, args.json, run_probe)
    nproc = args.nproc if args.nproc is not None else default_nproc()
    check_launch_flags(args, nproc)
    launch = Launch(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_endpoint)
    found = launch_rules(launch, os.environ)
    if launch.world == 1:
        report = run_probe(opts)
    else:
        cmd = torchrun_command(_passthrough(args, opts), launch.nproc, launch.nnodes, launch.node_rank,
                               launch.master_addr, launch.master_port, launch.rdzv_endpoint, 0,
                               rdzv_timeout_s=max(1, round(opts.timeout_s)))
        report = _launch(cmd, launch_env, launch, opts, found)
    rank_rules = {f.rule for f in report.findings}
    report.findings = [f for f in found if not (f.rule in rank_rules and f.severity != "error")] + report.findings
    report.launch = launch.to_json()
    _print(report, args.json)
    return 0 if report.ok else 1


def _as_rank(opts: Any, as_json: bool, run_probe: Callable[[Any], Report]) -> int:
    """One rank of a doctor launch: ours (the report goes to the launching process) or the user's own torchrun
    (rank 0 prints it)."""
    from shardfit.doctor.probe import ProbeError  # torch: see run()

    out = os.environ.get(OUT_ENV)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        report = run_probe(opts)
    except ProbeError as e:
        if out:
            Path(out, f"error-rank{rank}.json").write_text(json.dumps(e.to_json()))
        print(f"shardfit: doctor: {e}", file=sys.stderr)
        return 1
    if out:
        if local_rank == 0:
            tmp = Path(out, f".report-{rank}.json")
            tmp.write_text(json.dumps(report.to_json()))
            os.replace(tmp, Path(out, "report.json"))
        return 0  # the launching process decides the exit code; a non-zero rank would make torchrun stop the others
    if rank == 0:
        _print(report, as_json)
    return 0 if report.ok else 1


def _stop(proc: subprocess.Popen) -> None:
    """Stop the torchrun we started and its ranks (its own session), politely first."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _passthrough(args: argparse.Namespace, opts: Any) -> list[str]:
    """`doctor` and its options as the ranks receive them (the launch flags stay with torchrun)."""
    out = ["doctor"] + ([args.config] if args.config else [])
    for item in args.overrides:
        out += ["--set", item]
    if opts.output_dir is not None:
        out += ["--output-dir", str(opts.output_dir)]
    if args.sizes:
        out += ["--sizes", args.sizes]
    return out + ["--iters", str(opts.iters), "--timeout", str(opts.timeout_s), "--peer-wait", str(opts.peer_wait_s)]


def _launch(cmd: list[str], launch_env: Callable[[dict[str, str], int], dict[str, str]], launch: Launch, opts: Any,
            found: list[Finding]) -> Report:
    """Run torchrun (bounded), and return the ranks' report, or findings that say why none came back."""
    # Rendezvous, connecting, timing and watching for peers are each bounded; past this, something else is stuck.
    deadline = 4 * opts.timeout_s + opts.peer_wait_s + 120
    with tempfile.TemporaryDirectory(prefix="shardfit-doctor-") as tmp:
        log_path = Path(tmp, "launcher.log")
        print(f"shardfit: doctor: launching {launch.nproc} rank(s) on node {launch.node_rank} of {launch.nnodes} "
              f"(waiting up to {opts.timeout_s:.0f} s for the others)", file=sys.stderr)
        t0 = time.monotonic()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=launch_env({OUT_ENV: tmp}, launch.nproc),
                                    start_new_session=True)  # its own group, so a stuck launch can be stopped whole
            try:
                proc.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                _stop(proc)
            except KeyboardInterrupt:
                _stop(proc)
                raise
        text = log_path.read_text(errors="replace")
        result = Path(tmp, "report.json")
        if result.is_file():
            return Report.from_json(json.loads(result.read_text()))
        errors = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("error-rank*.json"))]
        findings = failure_findings(launch, text, errors, opts.timeout_s, found)
        if proc.returncode is None or time.monotonic() - t0 >= deadline:
            findings.append(Finding("doctor_deadline", "error", "launch",
                                    f"the launch did not finish within {deadline:.0f} s and was stopped",
                                    "a rank is stuck outside every bounded wait: rerun with --timeout 30 and see the "
                                    "launcher output"))
        tail = "\n".join(text.strip().splitlines()[-15:])
        if tail and any(f.rule in ("doctor_launch_failed", "doctor_deadline") for f in findings):
            print("shardfit: doctor: launcher output (last lines):\n" + tail, file=sys.stderr)
        return Report(findings)
