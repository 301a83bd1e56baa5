"""What every rank of a doctor launch does: join a gloo process group (bounded by the timeout), gather every rank's
facts, check the shared output_dir and concurrent lone groups, time the links, and agree on one report.

Doctor's own group is gloo even on GPUs: a bad rank-to-GPU mapping makes NCCL refuse or hang, and doctor must still
report it. The links are then timed on the backend `train` would use (NCCL on GPUs) when the mapping allows.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardfit.check.findings import Finding
from shardfit.doctor import bench, collect, peers
from shardfit.doctor.facts import RankFacts
from shardfit.doctor.report import Report
from shardfit.doctor.rules import mapping_rules, rank_rules
from shardfit.parallel.env import DistEnv
from shardfit.parallel.launch import under_launcher
from shardfit.parallel.netif import gloo_interface_fix
from shardfit.parallel.shared_dir import ranks_seeing


@dataclass
class ProbeOptions:
    output_dir: str | None = None
    sizes: list[int] | None = None  # bytes; None: the backend's defaults
    iters: int = 5
    timeout_s: float = 60.0
    peer_wait_s: float = 5.0
    data_files: list[str] = field(default_factory=list)  # the config's data and eval_data, checked on every rank


class ProbeError(Exception):
    """A stage of the probe failed on this rank; `stage` says which (connect: the process group never formed)."""

    def __init__(self, stage: str, key: str, rank: int, host: str, message: str):
        super().__init__(f"rank {rank} on {host} failed while {stage}: {message}")
        self.stage, self.key, self.rank, self.host, self.message = stage, key, rank, host, message

    def to_json(self) -> dict:
        return {"stage": self.stage, "key": self.key, "rank": self.rank, "host": self.host, "message": self.message}


@contextlib.contextmanager
def _stage(name: str, facts: RankFacts, key: str = "probe") -> Iterator[None]:
    try:
        yield
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a stage is reported with the stage's name
        raise ProbeError(name, key, facts.rank, facts.host, f"{type(e).__name__}: {str(e).strip()[:800]}") from e


def train_backend(facts: list[RankFacts]) -> str:
    """The backend `shardfit train` picks on these ranks (parallel/env.py: nccl where CUDA is available)."""
    kinds = {"nccl" if f.gpus_visible else "gloo" for f in facts}
    return kinds.pop() if len(kinds) == 1 else "mixed (nccl and gloo)"


def _gather(facts: RankFacts, env: DistEnv) -> list[RankFacts]:
    if not env.distributed:
        return [facts]
    out: list[RankFacts | None] = [None] * env.world
    dist.all_gather_object(out, facts)
    return [f for f in out if f is not None]


def run_probe(opts: ProbeOptions) -> Report:
    """The whole probe on this rank; every rank returns the same report (rank 0's)."""
    facts = collect.from_launcher_env() if under_launcher() else collect.collect()
    facts.extra["data_files"] = collect.file_sizes(opts.data_files)
    env = DistEnv(facts.rank, facts.world, facts.local_rank, torch.device("cpu"), "gloo" if facts.world > 1 else None)
    started = time.time()
    if env.distributed:
        iface = gloo_interface_fix(os.environ)
        if iface is not None:  # what train does too (parallel/env.py); the rules report it
            os.environ["GLOO_SOCKET_IFNAME"] = iface
            facts.extra["gloo_interface_set"] = iface
        with _stage("connecting to the other ranks", facts, key="connect"):
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=opts.timeout_s))
    ok = False
    try:
        report = _probe(opts, facts, env, started)
        ok = True
        return report
    finally:
        if env.distributed and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def _probe(opts: ProbeOptions, facts: RankFacts, env: DistEnv, started: float) -> Report:
    with _stage("gathering every rank's facts", facts):
        everyone = _gather(facts, env)
    if opts.output_dir is not None:
        with _stage(f"checking that every rank sees output_dir {opts.output_dir}", facts):
            for f, seen in zip(everyone, ranks_seeing(Path(opts.output_dir), env), strict=True):
                f.sees_output_dir = seen
    hosts = list(dict.fromkeys(f.host for f in everyone))
    record = peers.GroupRecord(socket.gethostname(), facts.pid, hosts, env.world, started)
    if env.is_main and opts.output_dir is not None:
        with _stage("writing the group record in output_dir", facts):
            peers.write(opts.output_dir, record)
    findings = rank_rules(everyone, opts.output_dir)
    backend, device = "gloo", torch.device("cpu")
    if train_backend(everyone) == "nccl":
        if any(f.severity == "error" for f in mapping_rules(everyone)):
            findings.append(Finding("links_timed_on_gloo", "info", "links",
                                    "the links were timed on gloo: NCCL refuses the rank-to-GPU mapping above",
                                    "fix the mapping, then run doctor again to time NCCL"))
        else:
            backend, device = "nccl", torch.device("cuda", facts.local_rank)
            torch.cuda.set_device(device)
    timings = []
    if env.distributed:
        with _stage(f"timing {backend} collectives", facts):
            sizes = opts.sizes or bench.DEFAULT_SIZES[backend]
            mine = bench.run(everyone, env.rank, sizes, opts.iters, backend, device)
            parts: list[list | None] = [None] * env.world
            dist.all_gather_object(parts, mine)
            timings = [t for part in parts for t in (part or [])]
    if env.is_main and opts.output_dir is not None:
        with _stage("looking for other nodes' groups in output_dir", facts):
            time.sleep(max(0.0, started + opts.peer_wait_s - time.time()))
            now = time.time()
            findings += peers.alone_findings(record, peers.others(opts.output_dir, record, now), opts.output_dir)
            record.end = now
            peers.write(opts.output_dir, record)
    if env.world == 1:
        findings.append(Finding("one_rank", "info", "launch", "one rank: nothing to rendezvous with or to time",
                                "shardfit doctor --nproc N (and --nnodes K ...) as you would launch train"))
    report = Report(findings, everyone, timings, backend if env.distributed else None, train_backend(everyone))
    if env.distributed:
        with _stage("sharing the report", facts):
            box = [report if env.is_main else None]
            dist.broadcast_object_list(box)
            report = box[0]
    return report
