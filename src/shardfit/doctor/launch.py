"""The launch as one node sees it before any rank starts, and what a failed rendezvous means.

Torch-free: these rules run in the process that starts torchrun, on the flags and the environment the job system
left (SLURM, Kubeflow, MPI), and on torchrun's output when no rank ever reported.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from shardfit.check.findings import Finding
from shardfit.doctor.rules import is_loopback

# Variables a job system sets with the number of nodes (or of one-per-node processes) of the job.
SCHEDULER_NODES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES", "OMPI_COMM_WORLD_SIZE")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Launch:
    """The launch flags `doctor` shares with `train`."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """host, port of the rendezvous every node must reach; None on one node with nothing given."""
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            return (host or self.rdzv_endpoint).strip("[]"), int(port) if port.isdigit() else DEFAULT_PORT
        if self.nnodes == 1 and self.master_addr is None:
            return None
        return self.master_addr or "127.0.0.1", self.master_port or DEFAULT_PORT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _resolve(host: str) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})


def launch_rules(launch: Launch, environ: Mapping[str, str],
                 resolve: Callable[[str], list[str]] = _resolve) -> list[Finding]:
    """Traps visible before the rendezvous: a loopback or unresolvable master address on several nodes, and a job
    system that says there are several nodes while this launch is one (the nodes would each train alone)."""
    out = []
    ep = launch.endpoint
    if ep is not None and launch.nnodes > 1:
        host, port = ep
        flag = "--rdzv-endpoint" if launch.rdzv_endpoint else "--master-addr"
        if is_loopback(host):
            out.append(Finding(
                "master_addr_loopback", "warning", flag,
                f"{launch.nnodes} nodes rendezvous at {host}:{port}, a loopback address: each node reaches only "
                "itself there, so this works only if every node is this machine" + (
                    "" if launch.master_addr or launch.rdzv_endpoint else " (no --master-addr given: 127.0.0.1 "
                                                                          "was assumed)"),
                f"{flag} <node 0's address on the network the nodes share> on every node"))
        else:
            try:
                addrs = resolve(host)
            except OSError as e:
                addrs = []
                out.append(Finding(
                    "master_addr_unresolvable", "error", flag,
                    f"{host} does not resolve on this node ({e}): the rendezvous cannot start",
                    f"{flag} <node 0's IP address>, or add {host} to DNS / /etc/hosts on every node"))
            loop = [a for a in addrs if _is_loopback_ip(a)]
            if loop and launch.node_rank != 0:
                out.append(Finding(
                    "master_addr_loopback", "error", flag,
                    f"{host} resolves to {', '.join(loop)} (loopback) on this node, node {launch.node_rank}: it would "
                    "wait for a rendezvous with itself (a hostname mapped to 127.0.1.1 in /etc/hosts is the usual "
                    "cause)", f"{flag} <node 0's IP address> instead of its name"))
    if launch.nnodes == 1:
        for name in SCHEDULER_NODES:
            value = environ.get(name, "")
            if value.isdigit() and int(value) > 1:
                out.append(Finding(
                    "nodes_train_alone", "error", f"--nnodes (the job system set {name}={value})",
                    f"the job has {value} nodes ({name}={value}) but this launch is a single node: every node would "
                    "rendezvous with itself and train alone, on world size " + str(launch.nproc),
                    f"--nnodes {value} --node-rank <this node's index> --master-addr <node 0's address> on every "
                    "node (or --rdzv-endpoint <node 0>:29500)"))
                break
        pre_world = environ.get("WORLD_SIZE", "")
        if pre_world.isdigit() and int(pre_world) > launch.nproc and "LOCAL_WORLD_SIZE" not in environ:
            out.append(Finding(
                "nodes_train_alone", "error", "--nnodes (the job system set WORLD_SIZE)",
                f"WORLD_SIZE={pre_world} is set for this job but this launch starts {launch.nproc} rank(s) on one "
                "node: torchrun replaces WORLD_SIZE, so the other nodes are left out",
                "--nnodes <nodes> --node-rank <this node> --master-addr <node 0> (as the job system's MASTER_ADDR)"))
    return out


def _is_loopback_ip(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


TIMEOUT_PATTERNS = (r"RendezvousTimeoutError", r"Timed out after \d+ seconds", r"timed out", r"DistStoreError",
                    r"RendezvousConnectionError", r"clients joined", r"Connection refused", r"Socket Timeout")


def failure_findings(launch: Launch, log: str, rank_errors: list[dict[str, Any]], timeout_s: float,
                     launch_found: list[Finding]) -> list[Finding]:
    """Why no report came back: a rank failed at a known stage, or the rendezvous never completed."""
    if rank_errors:
        out = []
        for err in sorted(rank_errors, key=lambda e: e.get("rank", 0))[:4]:
            where = f"rank {err.get('rank')} on {err.get('host')}"
            if err.get("key") == "connect":
                message = str(err.get("message"))
                loop = re.search(r"remote=\[?(127\.[\d.]+|::1)", message)
                cause = (f"a rank advertised the loopback address {loop.group(1)} (its host name resolves to "
                         "loopback there) and the other hosts cannot reach it" if loop else
                         "the ranks advertise addresses the other hosts cannot reach, or a firewall blocks them")
                out.append(Finding(
                    "ranks_cannot_connect", "error", where,
                    f"the rendezvous completed but {where} could not open the process group's connections to the "
                    f"other ranks within {timeout_s:.0f} s: {cause} ({message})",
                    "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface of the network the nodes share "
                    "(`ip -br addr`), map each host name to its address on that network (DNS or /etc/hosts), and "
                    "open the ports between nodes in the firewall"))
            else:
                out.append(Finding("doctor_rank_failed", "error", where,
                                   f"{where} failed while {err.get('stage')}: {err.get('message')}",
                                   "see the message; `shardfit diagnose` explains most of them"))
        return out
    hits = [line.strip() for line in log.splitlines() if any(re.search(p, line) for p in TIMEOUT_PATTERNS)]
    seen = hits[-1][:300] if hits else None
    ep = launch.endpoint
    addr = f"{ep[0]}:{ep[1]}" if ep else "the local rendezvous"
    loop = any(f.rule == "master_addr_loopback" for f in launch_found)
    if seen is None:
        tail = " | ".join(line.strip() for line in log.strip().splitlines()[-3:])
        return [Finding("doctor_launch_failed", "error", "launch",
                        f"the launch ended without a report from any rank: {tail or 'no output'}",
                        "run `shardfit doctor` again with the same flags; paste its output into `shardfit diagnose`")]
    if loop:
        return [Finding(
            "master_addr_loopback", "error", "--master-addr",
            f"node {launch.node_rank} could not complete the rendezvous at {addr} within {timeout_s:.0f} s "
            f"({seen}): {ep[0] if ep else 'it'} is a loopback address, so every node waits at its own machine",
            "--master-addr <node 0's address on the network the nodes share> (the same on every node)")]
    return [Finding(
        "rendezvous_failed", "error", "rendezvous",
        f"node {launch.node_rank}: the rendezvous at {addr} did not complete within {timeout_s:.0f} s ({seen}): "
        f"not all {launch.nnodes} node(s) joined",
        f"run the same command on all {launch.nnodes} nodes (each with its own --node-rank), with a --master-addr "
        "every node can reach and a --master-port open in the firewall; check with `nc -zv <addr> <port>`")]
