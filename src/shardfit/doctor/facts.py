"""What one rank knows about itself: host, device, versions, shared memory, the NCCL/Gloo environment (the
data; `doctor.collect` fills it in).

Collected on every rank and gathered on all of them, so the rules in `doctor.rules` compare ranks with each other
(two ranks on one GPU, a node with another torch, an NCCL variable set on one node only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Variables that change how ranks find and reach each other, or how fast they talk.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "CUDA_", "NVIDIA_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "TORCH_FR_BUFFER_SIZE")


@dataclass
class GpuFacts:
    index: int
    name: str
    uuid: str
    pci: str
    mem_gib: float


@dataclass
class RankFacts:
    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int  # torchrun's node (group) rank
    host: str
    pid: int
    address: str | None  # this rank's address on the route to MASTER_ADDR
    gpus_visible: int
    gpu: GpuFacts | None  # the GPU `train` gives this rank (cuda:local_rank), if it exists
    versions: dict[str, str | None]
    shm_total: int | None  # bytes of /dev/shm
    shm_free: int | None
    memlock: int | None  # RLIMIT_MEMLOCK in bytes, -1 when unlimited
    cpus: int
    threads: int
    env: dict[str, str]
    interfaces: list[str]
    infiniband: list[str]
    sees_output_dir: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return f"cuda:{self.gpu.index}" if self.gpu is not None else ("cuda:?" if self.gpus_visible else "cpu")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["device"] = self.device
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankFacts:
        data = {k: v for k, v in data.items() if k != "device"}
        gpu = data.pop("gpu")
        return cls(gpu=GpuFacts(**gpu) if gpu else None, **data)


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that matter to a distributed launch."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
