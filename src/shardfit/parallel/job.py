"""The resolved job of this process: this machine's facts handed to `resolve_job`, or the job the launching
`shardfit train` resolved, read from the ranks' environment."""

from __future__ import annotations

import os

import torch

from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.parallel.agree import require_same
from shardfit.parallel.env import DistEnv, cpu_matmul_gflops, cuda_available, device_facts
from shardfit.plan.choose import plan_for_config
from shardfit.plan.hardware import Hardware, detect, host_mem_gib
from shardfit.plan.plan import Plan
from shardfit.resolve import Resolved, resolve_job
from shardfit.resolve.decide import settled
from shardfit.resolve.job import ENV
from shardfit.resolve.resume import resumed_job

# What to do where the nodes' ranks resolved the job differently (`agreed_job`).
DIFFERENT_JOBS = ("The nodes resolved the job differently: start every node with the same shardfit, config and flags, "
                  "on the same kind of GPUs, and with the same output_dir contents (a run that resumes may keep the "
                  "job its run directory recorded, or be refused where that job does not fit: share output_dir "
                  "between the nodes, or use resume: never).")


def node_hardware(threads: int | None = None) -> Hardware:
    """This node as a job sees it: its GPUs, or its CPU with the matmul rates of a process running `threads`
    threads (None: this process's own), which the time model takes as each rank's."""
    if cuda_available():
        return detect()
    mem = host_mem_gib() or 16.0
    return Hardware(1, 1, mem, mem, "cpu", cpu_matmul_gflops(torch.float32, threads),
                    cpu_matmul_gflops(torch.bfloat16, threads))


def resolve_here(cfg: Config, *, nproc: int | None, nnodes: int = 1, threads: int | None = None) -> tuple[
        Resolved, Plan | None]:
    """Resolve `cfg` for a launch from this machine (`train` before it relaunches, `check`, the demo)."""
    device = "cuda" if cuda_available() else "cpu"
    return resolve_job(cfg, node_hardware(threads), device_facts(device, cfg.precision), nproc=nproc, nnodes=nnodes)


def job_of_rank(cfg: Config, env: DistEnv, job: Resolved | None = None) -> tuple[Resolved, Plan | None]:
    """This rank's job: `job` as given, else the one the launching `shardfit train` put in the environment, else
    (a rank torchrun or srun started without it) resolved here for the launch it is part of, a run that resumes
    by the rule `shardfit train` follows (resolve/resume.py `resumed_job`), so that the same run directory gives
    the same job whatever started the ranks. The plan is the job's own, made again from the resolved settings (it
    is a pure function of them)."""
    raw = os.environ.get(ENV) if job is None and env.distributed else None
    if job is None and raw:
        job = Resolved.from_env(raw)
    if job is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world))
        nnodes = max(1, env.world // local)
        return resumed_job(cfg, lambda c: resolve_here(c, nproc=local, nnodes=nnodes))
    if job.world != env.world:
        raise UserError(f"the job was resolved for {job.world} ranks but {env.world} started: launch it with "
                        "`shardfit train` (which resolves and launches together), or give torchrun the same "
                        "--nproc-per-node and --nnodes.")
    return job, plan_for_config(settled(cfg, job), job.hardware)


def agreed_job(cfg: Config, env: DistEnv, job: Resolved | None = None) -> tuple[Resolved, Plan | None]:
    """`job_of_rank`, agreed between every rank (a collective): a UserError on every rank where the nodes resolved
    it differently. A rank whose job is refused as it resolves (with output_dirs per node, a resumed run's
    recorded job predicted not to fit on one node only) takes part with the refusal in place of its job, so that
    the ranks that resolved one hear that the nodes differ instead of waiting for it in a collective; where every
    rank is refused, each raises its refusal together."""
    refused: DoesNotFitError | UserError | None = None
    try:
        job, plan = job_of_rank(cfg, env, job)
        decisions = job.decisions()
    except (DoesNotFitError, UserError) as e:
        refused, decisions = e, {"refused": f"{type(e).__name__} (exit {e.exit_code})"}
    require_same(env, decisions, "the resolved job", DIFFERENT_JOBS)
    if refused is not None:
        raise refused
    return job, plan
