"""The `--from TOOL FILE` options that plan, check and convert share, and reading the job they name."""

from __future__ import annotations

import argparse
import dataclasses
import re

from shardfit.cli.args import positive_int, token_count
from shardfit.errors import UserError
from shardfit.foreign.asplanned import ForeignPlan, plan_job
from shardfit.foreign.job import TOOLS
from shardfit.foreign.read import SCRIPT_SETTABLE, JobOptions, launch_on, read_job
from shardfit.method import NAMES as method_names
from shardfit.plan.hardware import detect, parse_gpus
from shardfit.plan.sdpa_classes import installed_transformers, runs_eager
from shardfit.plan.shapes import resolve_shape


def add_from(p: argparse.ArgumentParser, model_flags: bool) -> None:
    """--from and what a job file may leave to the command line."""
    p.add_argument("--from", dest="from_tool", choices=TOOLS, default=None,
                   help="read CONFIG as another tool's job: a LLaMA-Factory or axolotl YAML, an ms-swift command line "
                        "or script, a DeepSpeed JSON (with --model, --seq, --batch), HF TrainingArguments JSON or a "
                        "training command line")
    p.add_argument("--transformers", default=None, metavar="VERSION",
                   help="with --from: plan the loss of this transformers version (default: the installed one)")
    if model_flags:
        p.add_argument("--model", default=None, help="with --from: the model (needed for --from deepspeed)")
        p.add_argument("--seq", type=token_count, default=None, help="with --from: tokens per row")
        p.add_argument("--batch", type=positive_int, default=None, help="with --from: rows per rank")
        p.add_argument("--method", default=None, choices=method_names)
        p.add_argument("--grad-ckpt", default=None, choices=("none", "full", "selective"))


def foreign_plan(args: argparse.Namespace) -> ForeignPlan:
    """The job named by --from and its plan on --gpus (default: this machine)."""
    if args.transformers is not None and not re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", args.transformers):
        raise UserError(f"--transformers {args.transformers}: a transformers version such as 4.47 or 5.2.0, whose "
                        "loss the plan counts.")
    hw = parse_gpus(args.gpus, args.nodes, getattr(args, "cpu_mem", None)) if args.gpus else detect(args.nodes)
    opts = JobOptions(model=args.model, nproc=args.nproc, seq=args.seq, batch=args.batch, method=args.method,
                      grad_ckpt=args.grad_ckpt, transformers=args.transformers,
                      frozen_fp32=getattr(args, "frozen_fp32", None),
                      bnb_compute_fp32=getattr(args, "bnb_compute_fp32", None),
                      workload={k: getattr(args, k, None) for k in SCRIPT_SETTABLE},
                      # the GPUs a launch that takes every visible one starts ranks on, known before reading
                      gpus=hw if args.gpus or hw.gpus_per_node > 1 else None)
    job = read_job(args.from_tool, args.config, opts)
    if args.gpus and job.nproc and job.nproc > hw.gpus_per_node:  # a node's ranks would share its GPUs
        said = f"--nproc {args.nproc}" if args.nproc else f"{job.source} (its launch)"
        n = hw.gpus_per_node
        raise UserError(f"{said}: the job launches {job.nproc} ranks a node, more than the {n} GPU{'s' * (n > 1)} "
                        f"of --gpus {args.gpus}; ranks would share GPUs, each with its own CUDA context and model "
                        f"copy. Launch at most {n} rank{'s' * (n > 1)} a node, or name the node's GPUs (--gpus "
                        f"{job.nproc}x...).")
    launch_on(job, hw.gpus_per_node)
    named = getattr(args, "strategy", None)
    # the job's class has SDPA or not as its transformers release says, not as the installed one does
    shape = resolve_shape(job.model)
    shape = dataclasses.replace(shape, eager_only=runs_eager(shape.model_type, "sdpa",
                                                             args.transformers or installed_transformers(),
                                                             text_type=shape.text_model_type))
    return plan_job(job, shape, hw, None if named in (None, "all") else (named,))
