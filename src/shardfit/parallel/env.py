"""The distributed environment of this process, read from what torchrun sets (or a single process)."""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardfit.parallel.launch import under_launcher
from shardfit.parallel.netif import gloo_interface_fix
from shardfit.resolve.decide import precision_for
from shardfit.resolve.job import DeviceFacts

log = logging.getLogger("shardfit")
# Entries of torch's flight recorder: the last collectives of each rank, which the watchdog reads to tell the rank
# that is behind from the ranks that wait for it (a ring buffer of a few hundred bytes per entry).
FLIGHT_RECORDER_ENTRIES = "2000"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(timeout_s: int = 1800) -> DistEnv:
    """Join the process group torchrun prepared: nccl on GPUs, gloo on CPU; a plain process gets world 1."""
    if not under_launcher() or int(os.environ["WORLD_SIZE"]) == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return DistEnv(0, 1, 0, device, None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        use_reachable_interface(local_rank)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                **_restart_safe_store(rank, world, timeout))
    return DistEnv(rank, world, local_rank, device, backend)


def fast_fp32_matmuls(device: torch.device, precision: str) -> bool:
    """TF32 for the fp32 matmuls a 16-bit run still has on a GPU (the trained head's fp32 weight gradient in the
    loss, any op autocast leaves in fp32): their operands come from bf16/fp16 values, so TF32's 10-bit mantissa
    loses nothing they had, and the matmul runs on the tensor cores instead of at a fraction of their rate. An fp32
    run keeps full fp32 matmuls, as asked; a CPU is left as it is. The flag is the process's (one run per
    process). Returns whether it was set.

    Set with `torch.set_float32_matmul_precision`, which (torch 2.13, CUDA only) sets both the per-backend setting
    of torch 2.9 (`torch.backends.cuda.matmul.fp32_precision` reads "tf32") and the legacy flag
    (`torch.backends.cuda.matmul.allow_tf32`) that accelerate and transformers read; setting only the new one makes
    reading the legacy flag raise ("mix of the legacy and new APIs")."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return False
    torch.set_float32_matmul_precision("high")
    return True


def use_reachable_interface(local_rank: int) -> str | None:
    """Point gloo at the interface the other hosts can reach when this host's name resolves to loopback
    (parallel/netif.py); returns the interface it set, if any."""
    iface = gloo_interface_fix(os.environ)
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        if local_rank == 0:
            log.warning("this host's name (%s) resolves to loopback only, so gloo would advertise 127.0.0.1 to the "
                        "other hosts; using GLOO_SOCKET_IFNAME=%s, the interface on the route to MASTER_ADDR",
                        os.uname().nodename, iface)
    return iface


def _restart_safe_store(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun the ranks share the agent's TCPStore, and it outlives a restart (`--max-restarts`). The
    group's address keys of the killed attempt are still in it, and a new rank that reads one before its peer
    has overwritten it connects to a dead process and waits out the whole timeout (gloo's full-mesh connect).
    Giving every attempt its own key prefix makes a restarted group start from an empty namespace."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # rank 0 hosts a fresh store per attempt: nothing stale to read
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"shardfit/attempt-{attempt}", store), "rank": rank, "world_size": world}


def barrier(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.barrier()


def shutdown(env: DistEnv, ok: bool = True) -> None:
    """Leave the group: after success with a barrier first (FSDP2 otherwise sometimes aborts at exit); after a
    failure without one, so this rank exits and torchrun stops the others instead of all waiting forever."""
    if env.distributed and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


@functools.cache
def cpu_matmul_gflops(dtype: torch.dtype, threads: int | None = None) -> float:
    """This CPU's matmul speed in `dtype` (a probe of a few ms, measured once per process). CPUs without bf16
    units (no AVX512-BF16/AMX) run bf16 matmuls on a slow fallback: 1.6 against 119 GFLOP/s for fp32 on 2 EPYC
    cores. The best of five short trials: a trial that another process interrupted says nothing of the CPU, and
    the time model (plan/cards.py) takes this as the machine's rate."""
    before = torch.get_num_threads()
    if threads is not None:  # the rate of the ranks this process launches, at their thread count
        torch.set_num_threads(threads)
    try:
        return _matmul_gflops(dtype)
    finally:
        torch.set_num_threads(before)


def _matmul_gflops(dtype: torch.dtype) -> float:
    a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
    a @ b  # warm-up: the first call picks kernels
    reps, best = 4, float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return reps * 2 * 256**3 / max(best, 1e-9) / 1e9


def fast_cpu_bf16() -> bool:
    """bf16 matmuls on this CPU are at least as fast as fp32 ones. Compared in CPU time of one thread, not wall
    time: a short fp32 probe of a low-priority process on a loaded machine can wait longer for a core than it
    computes, which made wall time pick bf16 on a CPU that runs it 30x slower."""
    return _matmul_thread_seconds(torch.bfloat16) <= _matmul_thread_seconds(torch.float32)


@functools.cache
def _matmul_thread_seconds(dtype: torch.dtype) -> float:
    """CPU seconds one thread spends on four 256x256 matmuls in `dtype` (the best of five trials)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
        a @ b  # warm-up: the first call picks kernels
        best = float("inf")
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(4):
                a @ b
            best = min(best, time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return best


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_precision(precision: str, device_type: str) -> str:
    """The compute precision `auto` stands for on `device_type` (resolve/decide.py's rule, with this machine's
    facts); any other value is returned as it is."""
    return precision_for(precision, device_facts(device_type, precision))


def device_facts(device_type: str, precision: str = "auto") -> DeviceFacts:
    """This machine's `device_type` as the precision rule sees it. Whether bf16 is fast is measured on a CPU (a
    probe of up to seconds on one without bf16 units), so only when `precision` is `auto` and it matters."""
    if device_type == "cuda":
        return DeviceFacts("cuda", torch.cuda.is_bf16_supported())
    return DeviceFacts("cpu", precision == "auto" and fast_cpu_bf16())
