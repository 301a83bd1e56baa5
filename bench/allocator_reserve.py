"""The caching allocator's two fractions, refitted from public logs (bench/allocator_reserve.yaml).

The reserve that decides a fit, from OOM messages (`cases`). Each case is PyTorch's own report at a failed
allocation of a training run: the memory allocated, the memory reserved but unallocated (what the allocator kept
after freeing every cached segment it could; PyTorch frees them and retries before it raises), and the request that
failed. The reserve a full card cannot give back is compared with the tensor peak the step was reaching, allocated +
request. The planner's fraction (shardfit.plan.estimate.ALLOCATOR_RESERVE) is the median of that ratio over the
cases not `excluded` (a card other processes filled), rounded to 0.1 %: one case per thread, so each source counts
once, as each run's error does in the planner's own figures.

The cache a successful run reads, from logs of runs that did not fail (`successful_runs`): max_memory_reserved() /
max_memory_allocated() - 1. The planner's fraction (shardfit.plan.estimate.ALLOCATOR_CACHE) follows a rule fixed
before any planner error was looked at (`usable`, `fit_cache`):
- a run near its card is left out: it shows the cap (the allocator frees cache before it fails), not the cache.
  Near: max reserved over NEAR_CARD of the stated card, cudaMalloc retries, or, with the card unknown, max reserved
  over NEAR_CARD of an 80 GB card (the log cannot show that it had room);
- a run whose peak was not captured (`peak_captured: false`: allocated equals max allocated after one iteration) is
  left out;
- a whole-GiB-floored run is kept only when the flooring can move its ratio by FLOOR_SPREAD or less;
- a run FSDP sharded (`fsdp`) reads its gradient shards' and gathered weights' own streams' pools too, which the
  planner adds apart from the cache (shardfit.plan.estimate `stream_pool`): the fit plans the run's job (`job`)
  and takes that planned pool out of its max reserved; a run whose job cannot be planned says why
  (`job_unplanned`) and is fitted as printed;
- each source (a thread, pull request, commit or indexed file) counts once, as each OOM thread gives one case: the
  median of its usable runs, then the median over sources, to 0.1 %.
Prints both fits and the distributions they come from.

    python bench/allocator_reserve.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.plan.estimate import estimate  # noqa: E402
from shardfit.plan.hardware import parse_gpus  # noqa: E402
from shardfit.plan.shapes import resolve_shape  # noqa: E402
from shardfit.plan.workload import Workload  # noqa: E402

DATA = ROOT / "bench" / "allocator_reserve.yaml"
# A run's `job` keys that are not Workload fields: what it ran on and how it sharded, and its sequence length.
JOB_KEYS = ("model", "gpu", "strategy", "seq")
WORKLOAD_KEYS = {f.name for f in dataclasses.fields(Workload)} - {"seq_len"}
# A run whose max reserved passes this share of its card's stated capacity is near its card.
NEAR_CARD = 0.9
# An unknown card is taken to be an 80 GB one (79.2 GiB), the largest card most of these logs name.
UNKNOWN_CARD_GIB = 79.2
# A floored row is kept when (reserved + 1) / allocated - reserved / (allocated + 1), the widest its true ratio can
# range, is at most this: a few points, well under the spread between sources.
FLOOR_SPREAD = 0.05
# A failed request of this size or more is a large allocation (the fp32 logits of a long sequence, a batch of images).
LARGE_REQUEST_GIB = 1.0


def load(path: Path = DATA) -> dict:
    """The YAML's OOM cases and successful runs."""
    return yaml.safe_load(path.read_text())


def reserve_ratio(case: dict) -> float:
    """Reserved-but-unallocated memory per GiB of the tensor peak the failed step was reaching."""
    return case["unallocated_gib"] / (case["allocated_gib"] + case["request_gib"])


def fitted_cases(cases: list[dict]) -> list[dict]:
    """The cases the reserve is fitted to: all but those `excluded` (with the reason in the YAML)."""
    return [c for c in cases if not c.get("excluded")]


def fit(cases: list[dict]) -> float:
    """The planner's reserve fraction: the median ratio over the cases not excluded, to 0.1 %."""
    return round(statistics.median(reserve_ratio(c) for c in fitted_cases(cases)), 3)


def planned_pool(run: dict) -> float:
    """The stream pool (GiB) the planner plans for the run's `job` (FSDP's gradient shards and gathered weights in
    their own streams' pools); 0 for a run without a job (not FSDP, or `job_unplanned`)."""
    job = run.get("job")
    if not job:
        return 0.0
    unknown = set(job) - set(JOB_KEYS) - WORKLOAD_KEYS
    if unknown:
        raise ValueError(f"{DATA.name}: run {run['run']!r}: job key(s) {', '.join(sorted(unknown))} are neither "
                         f"{', '.join(JOB_KEYS)} nor Workload fields; fix the key or drop it")
    keys = {k: tuple(v) if isinstance(v, list) else v for k, v in job.items() if k in WORKLOAD_KEYS}
    w = Workload(seq_len=job["seq"], **keys)
    plan = estimate(resolve_shape(job["model"]), w, parse_gpus(str(job["gpu"])), job["strategy"])
    return plan.per_gpu_gib.stream_pool


def cache_ratio(run: dict) -> float:
    """What a successful run's cache held at its peak, per GiB of its tensor peak: its max reserved less the
    stream pool planned for its job (the planner adds that pool on its own), over its max allocated."""
    return (run["max_reserved_gib"] - planned_pool(run)) / run["max_allocated_gib"] - 1


def near_card(run: dict) -> bool:
    """Whether the run met (or may have met) its card: max reserved over NEAR_CARD of its stated capacity, or of an
    80 GB card when the log does not state one, or cudaMalloc retries."""
    card = run["gpu_gib"] if run.get("gpu_gib") is not None else UNKNOWN_CARD_GIB
    return run["max_reserved_gib"] > NEAR_CARD * card or bool(run.get("alloc_retries"))


def floor_spread(run: dict) -> float:
    """How far whole-GiB flooring can move a run's ratio (0 for a run printed in MB or to the hundredth)."""
    if "floored" not in run["printed"]:
        return 0.0
    a, r = run["max_allocated_gib"], run["max_reserved_gib"]
    return (r + 1) / a - r / (a + 1)


def usable(run: dict) -> bool:
    """Whether a run's ratio shows the cache: not near its card, its peak captured, its flooring a few points."""
    return not near_card(run) and run.get("peak_captured", True) and floor_spread(run) <= FLOOR_SPREAD


def source(run: dict) -> str:
    """Where a run came from; a run printed in two indexed files names the first (`source`)."""
    return str(run.get("source") or run.get("url") or run["index_file"])


def per_source(runs: list[dict]) -> dict[str, float]:
    """Each source's median cache ratio over its usable runs."""
    groups: dict[str, list[float]] = {}
    for r in runs:
        if usable(r):
            groups.setdefault(source(r), []).append(cache_ratio(r))
    return {k: statistics.median(v) for k, v in groups.items()}


def fit_cache(runs: list[dict]) -> float:
    """The planner's cache fraction: the median over sources of each source's median usable ratio, to 0.1 %."""
    return round(statistics.median(per_source(runs).values()), 3)


def _spread(values: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"n={len(values):3d}  median {100 * q2:5.1f} %  quartiles {100 * q1:5.1f} % .. {100 * q3:5.1f} %"


def lad_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = slope * x + intercept (both >= 0) with the least absolute error: the best line through two points."""
    best = (float("inf"), 0.0, 0.0)
    for i, (x1, y1) in enumerate(zip(xs, ys, strict=True)):
        for x2, y2 in zip(xs[i + 1:], ys[i + 1:], strict=True):
            if x1 == x2:
                continue
            slope = (y2 - y1) / (x2 - x1)
            intercept = y1 - slope * x1
            if slope >= 0 and intercept >= 0:
                err = sum(abs(y - slope * x - intercept) for x, y in zip(xs, ys, strict=True))
                best = min(best, (err, slope, intercept))
    return best[1], best[2]


def report(data: dict) -> list[str]:
    """The fit and the distribution behind it, one line each."""
    cases = fitted_cases(data["cases"])
    ratios = [reserve_ratio(c) for c in cases]
    lines = [f"{len(cases)} OOM messages of training runs ({len(data['cases']) - len(cases)} excluded); "
             "reserve = unallocated / (allocated + request)",
             f"fit (median, planner's ALLOCATOR_RESERVE): {100 * fit(cases):.1f} % of the tensor peak",
             f"all:                      {_spread(ratios)}",
             f"  90th percentile {100 * statistics.quantiles(ratios, n=10)[-1]:.1f} %, "
             f"largest {100 * max(ratios):.0f} %",
             "unallocated / allocated:  " + _spread([c["unallocated_gib"] / c["allocated_gib"] for c in cases])]
    groups = {
        f"request >= {LARGE_REQUEST_GIB:g} GiB:        ": [c for c in cases if c["request_gib"] >= LARGE_REQUEST_GIB],
        f"request <  {LARGE_REQUEST_GIB:g} GiB:        ": [c for c in cases if c["request_gib"] < LARGE_REQUEST_GIB],
        "card < 16 GiB:            ": [c for c in cases if c["gpu_gib"] < 16],
        "card 16-40 GiB:           ": [c for c in cases if 16 <= c["gpu_gib"] < 40],
        "card >= 40 GiB:           ": [c for c in cases if c["gpu_gib"] >= 40],
        "torch < 2.1 message:      ": [c for c in cases if c["torch_message"] == "old"],
        "torch >= 2.1 message:     ": [c for c in cases if c["torch_message"] == "new"],
        "expandable_segments set:  ": [c for c in cases if c["expandable"]],
    }
    lines += [name + (_spread([reserve_ratio(c) for c in g]) if g else "n=  0") for name, g in groups.items()]
    unalloc = [c["unallocated_gib"] for c in cases]
    lines.append(f"in GiB: median {statistics.median(unalloc):.2f}, quartiles "
                 + " .. ".join(f"{q:.2f}" for q in statistics.quantiles(unalloc, n=4)[::2]))
    slope, intercept = lad_line([c["allocated_gib"] + c["request_gib"] for c in cases], unalloc)
    lines.append(f"least-absolute-GiB line (not used): {100 * slope:.1f} % of the peak + {intercept:.3f} GiB")
    return lines + cache_report(data["successful_runs"])


def cache_report(runs: list[dict]) -> list[str]:
    """The cache fit and the distribution behind it: by source kind and size, and the runs left out and why."""
    kept = [r for r in runs if usable(r)]
    sources = per_source(runs)
    megatron = {source(r) for r in kept if r["printed"] == "MB" and "Megatron" in r["run"]}
    lines = ["",
             f"{len(runs)} successful training runs, {len(kept)} usable from {len(sources)} sources; cache = max "
             "reserved / max allocated - 1",
             f"fit (median over sources, planner's ALLOCATOR_CACHE): {100 * fit_cache(runs):.1f} % of the tensor peak",
             "per source:               " + _spread(list(sources.values())),
             "usable runs, each counted:" + _spread([cache_ratio(r) for r in kept]),
             "Megatron sources:         " + _spread([v for k, v in sources.items() if k in megatron]),
             "other sources:            " + _spread([v for k, v in sources.items() if k not in megatron])]
    for lo, hi in ((0, 10), (10, 30), (30, 60), (60, 1000)):
        sel = [cache_ratio(r) for r in kept if lo <= r["max_allocated_gib"] < hi]
        lines.append(f"max allocated {lo:3d}-{hi:<4d} GiB: " + (_spread(sel) if sel else "n=  0"))
    for r in runs:
        if r.get("fsdp"):
            printed = r["max_reserved_gib"] / r["max_allocated_gib"] - 1
            lines.append(f"{r['fsdp']}, planned stream pool {planned_pool(r):.3f} GiB: {100 * printed:.1f} % -> "
                         f"{100 * cache_ratio(r):.1f} % ({r['run']})" if "job" in r else
                         f"{r['fsdp']}, not planned, fitted as printed: {100 * printed:.1f} % ({r['run']}: "
                         f"{r['job_unplanned']})")
    for r in runs:
        why = ("near its card" if near_card(r) else "peak not captured" if not r.get("peak_captured", True)
               else f"flooring moves it {100 * floor_spread(r):.0f} points" if not usable(r) else "")
        if why:
            lines.append(f"left out, {why}: {100 * cache_ratio(r):.1f} % ({r['run']})")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="the cases (default: bench/allocator_reserve.yaml)")
    args = p.parse_args(argv)
    try:
        lines = report(load(args.data))
    except ValueError as e:  # a job key the planner does not know: the message names the run, the key and the fix
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(lines))


if __name__ == "__main__":
    main()
