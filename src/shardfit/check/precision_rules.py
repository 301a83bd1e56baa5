"""Whether the hardware a job is checked for computes its precision at speed (no torch: `convert` runs these too).

A CPU without bf16 units (AVX512-BF16 or AMX) runs bf16 matmuls on a fallback 30-400x slower than fp32 (0.2
against 92 GFLOP/s on the 2-core EPYC of docs/benchmarks.md: a run made no step in 3.5 minutes); fp16 without
AVX512-FP16 or AMX-FP16 the same. GPUs before Ampere have no bf16 arithmetic (plan/hardware.py's NO_BF16).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardfit.check.findings import Finding
from shardfit.plan.hardware import NO_BF16, Hardware, card_key

CPUINFO = Path("/proc/cpuinfo")
# The CPU flags (as /proc/cpuinfo lists them) that compute each 16-bit type in hardware.
UNITS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """The first CPU's feature flags, or None where /proc/cpuinfo does not say (not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def precision_rules(precision: str, hw: Hardware, where: str, fix: Callable[[str], str],
                    flags: set[str] | None = None) -> list[Finding]:
    """A warning when `precision` is slow or unsupported on `hw` (a CPU: this machine's flags, or `flags`);
    `fix(precision)` says how to train in that precision instead, in the job's own words."""
    if hw.name == "cpu":
        have = cpu_flags() if flags is None else flags
        units = UNITS.get(precision)
        if have is None or units is None or any(u in have for u in units):
            return []
        return [Finding(
            "precision_slow", "warning", where,
            f"precision {precision} on this CPU: it has no {precision} units (none of {', '.join(units)} among its "
            f"flags), so {precision} matmuls run on a slow fallback, tens to hundreds of times slower than fp32 "
            "(0.2 against 92 GFLOP/s on a 2-core EPYC: a run made no step in minutes)", fix("fp32"))]
    key = card_key(hw.name)
    if precision == "bf16" and key in NO_BF16:
        return [Finding(
            "precision_unsupported", "warning", where,
            f"precision bf16 on {hw.name}: the card has no bf16 arithmetic (PyTorch refuses or emulates it)",
            fix("fp16"))]
    return []
