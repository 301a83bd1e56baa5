"""What the time model knows of a card: peak FLOP/s, memory bandwidth, and its links (plan/cards.yaml, with sources)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from shardfit.plan.hardware import CARDS, NO_BF16, Hardware, card_key

GB = 1e9
# A100: a training step's utilization (0.52, Megatron-LM) over one large GEMM's (0.87, MAMF): what the rest of a
# step costs, applied to cards whose training utilization is not published.
HFU_OF_MAMF = 0.52 / 0.87
# Cards without TF32 tensor cores: those before Ampere (their `bf16` column is fp16's) and CDNA2.
NO_TF32 = (*NO_BF16, "mi250x")


@dataclass(frozen=True)
class Card:
    """One card's rates, in FLOP/s and bytes/s. `assumed` says which card an unnamed one was timed as."""

    key: str
    bf16_flops: float
    fp32_flops: float
    hbm: float
    matmul_eff: float
    hfu: float  # the fraction of the peak a whole training step reaches
    link: float  # intra-node collective bus bandwidth per GPU
    pcie: float  # host <-> device per GPU
    nic: float  # inter-node per GPU
    latency_s: float  # per collective call
    assumed: str | None = None
    fp8_flops: float | None = None  # dense FP8 tensor-core peak; None: no FP8 tensor cores (before sm_89)

    def dense_flops(self, precision: str) -> float:
        """The card's peak FLOP rate for matmuls in `precision`: fp32 without TF32, else the 16-bit tensor rate."""
        return self.fp32_flops if precision == "fp32" else self.bf16_flops

    def fp32_matmul_flops(self, tf32: bool) -> float:
        """The peak rate of an fp32 matmul, in a run that allows TF32 where `tf32` (the run's rule is
        `Workload.fp32_matmuls_tf32`): TF32 tensor cores at half the 16-bit rate on the cards that have them
        (NVIDIA since Ampere: A100 156 of 312 TFLOP/s, H100 SXM 495 of 989; MI300X's xf32 654 of 1307; the
        datasheets of plan/cards.yaml); the fp32 rate without TF32, on the others (NO_TF32) and on a CPU."""
        if not tf32 or self.key in NO_TF32 or self.key == "cpu":
            return self.fp32_flops
        return max(self.fp32_flops, self.bf16_flops / 2)

    def peak(self, precision: str) -> float:
        """The FLOP rate a training step in `precision` reaches (its achievable fraction of the peak)."""
        return self.dense_flops(precision) * self.hfu

    def compute_bound_rows(self, precision: str) -> int:
        """Rows a matmul against a weight needs before the card computes it faster than it reads the weight:
        [rows x k] @ [k x n] does 2 rows k n FLOPs on k n weight elements, `rows` FLOPs per byte of a 16-bit weight
        (half as many of an fp32 one), against the card's FLOPs per byte of memory bandwidth."""
        flops_per_byte = self.dense_flops(precision) / self.hbm
        return math.ceil(flops_per_byte * (2 if precision == "fp32" else 1))


@cache
def _table() -> dict[str, Any]:
    """The bundled cards, with libyaml's safe loader where PyYAML has it (as plan/shapes.py `catalog`)."""
    return yaml.load(Path(__file__).with_name("cards.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                                        yaml.SafeLoader))


def card_of(hw: Hardware) -> Card:
    """The card of `hw`: by its name, or for a size only (`8x24GB`) the usual card of that memory."""
    table = _table()
    key = card_key(hw.name) if hw.name else ""
    assumed = None
    if key not in table["cards"]:
        key = next(r["card"] for r in table["by_memory"] if hw.gpu_mem_gib <= r["max_gib"])
        assumed = (f"card not named: step times are those of a {key.upper()} ({CARDS.get(key, hw.gpu_mem_gib):.0f} "
                   f"GiB); name the card (e.g. --gpus {hw.gpus_per_node}xA6000) for its own")
    row = dict(table["cards"][key])
    if key == "cpu" and hw.cpu_fp32_gflops:
        # This machine's own rates, measured by the training process (parallel/env.py cpu_matmul_gflops), in
        # place of the table's generic core: one core's figure is far from a multi-threaded rank's.
        row["fp32"] = hw.cpu_fp32_gflops / 1e3
        row["bf16"] = (hw.cpu_bf16_gflops or hw.cpu_fp32_gflops) / 1e3
    nic = row["nic"] if "nic" in row else row["nic_node"] / hw.gpus_per_node
    hfu = row.get("hfu", row["matmul_eff"] * HFU_OF_MAMF)
    return Card(key, row["bf16"] * 1e12, row["fp32"] * 1e12, row["hbm"] * GB, row["matmul_eff"], hfu, row["link"] * GB,
                row["pcie"] * GB, nic * GB, row.get("latency_us", 10) * 1e-6, assumed,
                row["fp8"] * 1e12 if "fp8" in row else None)


# Why an AMD row has no `fp8` rate: the generic reason below speaks of NVIDIA's compute capabilities.
NO_FP8_AMD = {
    "mi300x": "shardfit's FP8 path is tried and planned on NVIDIA GPUs only (Ada, Hopper, Blackwell): MI300X's FP8 "
              "(torchao's e4m3fnuz formats on ROCm) is not supported yet",
    "mi250x": "the card has no FP8 matrix cores (AMD's start with MI300)",
}


def no_fp8_reason(key: str) -> str:
    """Why float8 cannot run on the card keyed `key` in plan/cards.yaml (a row without an `fp8` rate)."""
    return NO_FP8_AMD.get(key, "the card has no FP8 tensor cores (compute capability below 8.9; FP8 matmuls start "
                               "with Ada, sm_89, and Hopper, sm_90)")
