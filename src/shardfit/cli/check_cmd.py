"""`shardfit check`: the preflight on a weightless model, with the findings `train` would apply."""

from __future__ import annotations

import argparse
import json

from shardfit.check.findings import is_ok
from shardfit.cli.args import positive_int
from shardfit.cli.foreign_args import add_from, foreign_plan
from shardfit.config import load_config
from shardfit.config.load import NotHere
from shardfit.errors import UserError
from shardfit.foreign.asplanned import ForeignPlan
from shardfit.foreign.rules import foreign_rules
from shardfit.plan.hardware import parse_gpus

EXAMPLE = ("example: shardfit check my.yaml --gpus 8x24GB\n"
           "         shardfit check --from swift train.sh --gpus 4xH100")


class _OneNodeCount(argparse.Action):
    """--nodes and train's --nnodes are one setting: given twice with different counts, neither is what the user
    meant (argparse would silently keep the last), so the command stops (exit 2) naming both."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        seen = getattr(namespace, "_nodes_from", None)
        if seen is not None and seen[1] != values:
            parser.error(f"{seen[0]} {seen[1]} and {option_string} {values} disagree: they are one setting (the "
                         "nodes the run will use); give one of them")
        namespace._nodes_from = (option_string, values)
        setattr(namespace, self.dest, values)


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("check", help="preflight: find placement, sharding and precision problems before training",
                       epilog=EXAMPLE)
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks a node, as train --nproc and torchrun --nproc-per-node (default: from the strategy)")
    c.add_argument("--gpus", default=None, help="check for these GPUs, e.g. 8x24GB (default: this machine)")
    c.add_argument("--nodes", "--nnodes", dest="nodes", type=positive_int, default=1, action=_OneNodeCount,
                   help="nodes the run will use, each like --gpus (default: like this machine); train's --nnodes")
    c.add_argument("--json", action="store_true")
    add_from(c, model_flags=True)
    c.set_defaults(func=run)


def run_from(args: argparse.Namespace) -> int:
    """`check --from TOOL FILE`: the rules on another tool's job, in its keys (nothing is fixed: the job is the
    tool's). Exit 1 when an error is found."""
    from shardfit.check.run import validate_data  # torch and the tokenizer: only for this command
    from shardfit.foreign.data_rules import data_rules, job_precision_rules

    if args.overrides:
        raise UserError(f"--set {args.overrides[0]} changes shardfit's own config; with --from the job is the tool's "
                        f"file: change it there (or `shardfit convert` it and check the converted config with --set).")
    fp = foreign_plan(args)
    findings = foreign_rules(fp) + job_precision_rules(fp.job, fp.hardware) + data_rules(fp.job, validate_data)
    ok = not any(f.severity == "error" for f in findings)
    if args.json:
        print(json.dumps({"ok": ok, "from": {"tool": fp.job.tool, "file": fp.job.source, "engine":
                                             fp.job.describe_engine(), "ranks": fp.hardware.world},
                          "assumptions": fp.job.notes, "findings": [f.to_json() for f in findings]}, indent=2))
    else:
        print(format_foreign_findings(fp, findings))
    return 0 if ok else 1


def format_foreign_findings(fp: ForeignPlan, findings: list) -> str:
    """The findings as the terminal shows them, headed by the job they are about."""
    job = fp.job
    unit = "GPU" if job.engine == "device_map" else "rank"
    lines = [f"from {job.tool}: {job.source} ({job.describe_engine()}, {fp.hardware.world} {unit}(s) of "
             f"{fp.hardware.gpu_mem_gib:.0f} GiB): {len(findings)} finding(s)"]
    w = job.workload
    lines.append(f"  checked as: {w.method}, {w.precision}, {w.seq_len} tokens x micro-batch {w.micro_batch}, "
                 f"gradient checkpointing {w.grad_ckpt}")
    lines += [f"  note: {n}" for n in job.notes]  # what was assumed where the job does not say, as plan shows it
    for f in findings:
        lines.append(f"  [{f.severity:>7}] {f.rule} at {f.where}\n            {f.message}\n            fix: {f.fix}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.from_tool:
        return run_from(args)
    # The config first, without torch: a mistake in it is reported in a fraction of a second, not after ~5 s of
    # imports.
    absent: list[NotHere] = []  # data files with nothing at them here: warnings, the run may train elsewhere
    cfg = load_config(args.config, args.overrides, absent=absent)
    hw = parse_gpus(args.gpus, args.nodes) if args.gpus else None
    # torch and transformers: only for this command
    from shardfit.check.run import check_config, format_findings, skipped_checks

    # A resumed run's job, as train resolves it; --nodes without --gpus: nodes like this machine.
    job, findings = check_config(cfg, args.nproc, hw, args.nodes, absent)
    ok = is_ok(findings)
    if args.json:
        print(json.dumps({"ok": ok, "skipped": skipped_checks(findings, cfg, absent), "resolved": job.to_json(),
                          "findings": [f.to_json() for f in findings]}, indent=2))
    else:
        print(format_findings(job, findings, cfg, absent))
    return 0 if ok else 1
