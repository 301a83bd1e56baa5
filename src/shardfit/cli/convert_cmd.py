"""`shardfit convert --from TOOL FILE`: the shardfit config of another tool's job, on stdout (or --out)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from shardfit.check.findings import Finding
from shardfit.check.precision_rules import precision_rules
from shardfit.cli.args import positive_int
from shardfit.cli.foreign_args import add_from
from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.foreign.convert import to_yaml
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.read import JobOptions, read_job
from shardfit.parallel.allocator import gpu_host
from shardfit.plan.hardware import Hardware

EXAMPLE = "example: shardfit convert --from llamafactory my_lf.yaml > shardfit.yaml && shardfit train shardfit.yaml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("convert", help="write the shardfit config of another tool's job", epilog=EXAMPLE)
    c.add_argument("config", metavar="FILE")
    c.add_argument("--nproc", type=positive_int, default=None, help="ranks the job launches per node")
    c.add_argument("--out", default=None, metavar="FILE.yaml", help="write here instead of stdout")
    add_from(c, model_flags=True)
    c.set_defaults(func=run)


def _precision_on_this_machine(job: ForeignJob) -> list[Finding]:
    """The job's precision on this machine's CPU, when it has no GPU (torch-free: the CPU's flags)."""
    if gpu_host():
        return []
    return precision_rules(job.workload.precision, Hardware(1, 1, 0.0, name="cpu"), "precision",
                           lambda p: f"precision: {p} (auto picks the precision this machine computes fast)")


def run(args: argparse.Namespace) -> int:
    if not args.from_tool:
        raise UserError("convert needs --from TOOL (llamafactory, swift, axolotl, deepspeed, hf), e.g. "
                        "shardfit convert --from llamafactory my_lf.yaml > shardfit.yaml.")
    opts = JobOptions(model=args.model, nproc=args.nproc, seq=args.seq, batch=args.batch, method=args.method,
                      grad_ckpt=args.grad_ckpt, transformers=args.transformers)
    job = read_job(args.from_tool, args.config, opts)
    text = to_yaml(job)
    for f in _precision_on_this_machine(job):  # said on stderr and kept in the file's header
        print(f"shardfit: warning: {f.message}. Fix: {f.fix}", file=sys.stderr)
        text = f"# warning: {f.message}\n#   fix: {f.fix}\n" + text
    with tempfile.TemporaryDirectory() as tmp:  # what is written must load as a shardfit config
        check = Path(tmp) / "converted.yaml"
        check.write_text(text)
        try:
            load_config(check, check_files=False)
        except UserError as e:  # the temporary file means nothing to the user: name their job and the output
            raise UserError(f"{args.config}: its converted config would not load: "
                            f"{str(e).replace(str(check), 'converted config line')}") from None
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write it ({e.strerror or e}); name a YAML file in an existing "
                            "folder, e.g. --out shardfit.yaml.") from None
        print(f"shardfit config written to {args.out}")
    else:
        print(text, end="")
    return 0
