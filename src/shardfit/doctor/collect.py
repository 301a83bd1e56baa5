"""Fill in `RankFacts` for this process: torch, the driver, /dev/shm, rlimits, network interfaces."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import shutil
import socket
from pathlib import Path

import torch

from shardfit import __version__
from shardfit.doctor.facts import GpuFacts, RankFacts, relevant_env
from shardfit.parallel.netif import hostname_addresses, route_address


def _package(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The kernel driver's version (the same driver must serve every node's CUDA runtime)."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip()


def versions() -> dict[str, str | None]:
    """Versions that must agree between ranks (a mismatch hangs or corrupts collectives)."""
    nccl = None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "driver": _nvidia_driver(), "shardfit": __version__,
            "transformers": _package("transformers"), "peft": _package("peft")}


def _gpu(local_rank: int) -> tuple[int, GpuFacts | None]:
    if not torch.cuda.is_available():
        return 0, None
    n = torch.cuda.device_count()
    if local_rank >= n:
        return n, None
    p = torch.cuda.get_device_properties(local_rank)
    pci = f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:{getattr(p, 'pci_device_id', 0):02x}"
    return n, GpuFacts(local_rank, p.name, str(getattr(p, "uuid", "")), pci, round(p.total_memory / 2**30, 2))


def _shm() -> tuple[int | None, int | None]:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None, None
    return usage.total, usage.free


def _memlock() -> int | None:
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ValueError, OSError):
        return None
    return -1 if soft == resource.RLIM_INFINITY else soft


def _interfaces() -> list[str]:
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return []


def _infiniband() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def collect(rank: int = 0, world: int = 1, local_rank: int = 0, local_world: int = 1, node: int = 0) -> RankFacts:
    """This process's facts, as the rank `rank` of `world`."""
    n_gpus, gpu = _gpu(local_rank)
    shm_total, shm_free = _shm()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    master = os.environ.get("MASTER_ADDR")
    return RankFacts(rank=rank, world=world, local_rank=local_rank, local_world=local_world, node=node,
                     host=socket.gethostname(), pid=os.getpid(),
                     address=route_address(master, int(os.environ.get("MASTER_PORT", "29500") or 29500)),
                     gpus_visible=n_gpus, gpu=gpu, versions=versions(), shm_total=shm_total, shm_free=shm_free,
                     memlock=_memlock(), cpus=cpus, threads=torch.get_num_threads(), env=relevant_env(os.environ),
                     interfaces=_interfaces(), infiniband=_infiniband(),
                     extra={"hostname_resolves_to": hostname_addresses()})


def from_launcher_env() -> RankFacts:
    """Facts of a rank started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)."""
    e = os.environ
    return collect(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)),
                   int(e.get("LOCAL_WORLD_SIZE", 1)), int(e.get("GROUP_RANK", 0)))


def file_sizes(paths: list[str]) -> dict[str, int | None]:
    """Size in bytes of each path as this rank sees it; None where it is missing."""
    out: dict[str, int | None] = {}
    for p in paths:
        try:
            out[p] = os.path.getsize(p)
        except OSError:
            out[p] = None
    return out
