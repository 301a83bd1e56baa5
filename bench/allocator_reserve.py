"""The caching allocator's two fractions, refitted from public logs (bench/allocator_reserve.yaml).

The reserve that decides a fit, from OOM messages (`cases`). Each case is PyTorch's own report at a failed
allocation of a training run: the memory allocated, the memory reserved but unallocated (what the allocator kept
after freeing every cached segment it could; PyTorch frees them and retries before it raises), and the request that
failed. The reserve a full card cannot give back is compared with the tensor peak the step was reaching, allocated +
request. The planner's fraction (shardfit.plan.estimate.ALLOCATOR_RESERVE) is the median of that ratio over the
cases, rounded to 0.1 %: each run counts once, as each run's error does in the planner's own figures.

The cache a successful run reads, from logs of runs that did not fail (`successful_runs`): max_memory_reserved() /
max_memory_allocated() - 1. The planner's fraction (shardfit.plan.estimate.ALLOCATOR_CACHE) is its median over the
runs not near their card, to 0.1 %; a run near its card shows the cap (the allocator frees cache before it fails),
not the cache. Prints both fits and the distributions they come from.

    python bench/allocator_reserve.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "allocator_reserve.yaml"
# A run whose max reserved passes this share of its card's stated capacity is near its card.
NEAR_CARD = 0.9
# A failed request of this size or more is a large allocation (the fp32 logits of a long sequence, a batch of images).
LARGE_REQUEST_GIB = 1.0


def load(path: Path = DATA) -> dict:
    """The YAML's OOM cases and successful runs."""
    return yaml.safe_load(path.read_text())


def reserve_ratio(case: dict) -> float:
    """Reserved-but-unallocated memory per GiB of the tensor peak the failed step was reaching."""
    return case["unallocated_gib"] / (case["allocated_gib"] + case["request_gib"])


def fit(cases: list[dict]) -> float:
    """The planner's reserve fraction: the median ratio, to 0.1 %."""
    return round(statistics.median(reserve_ratio(c) for c in cases), 3)


def cache_ratio(run: dict) -> float:
    """What a successful run's cache held at its peak, per GiB of its tensor peak."""
    return run["max_reserved_gib"] / run["max_allocated_gib"] - 1


def near_card(run: dict) -> bool:
    """Whether the run met its card: max reserved over NEAR_CARD of a stated capacity, or cudaMalloc retries."""
    full = run.get("gpu_gib") is not None and run["max_reserved_gib"] > NEAR_CARD * run["gpu_gib"]
    return full or bool(run.get("alloc_retries"))


def fit_cache(runs: list[dict]) -> float:
    """The planner's cache fraction: the median ratio over the runs not near their card, to 0.1 %."""
    return round(statistics.median(cache_ratio(r) for r in runs if not near_card(r)), 3)


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
    cases = data["cases"]
    ratios = [reserve_ratio(c) for c in cases]
    lines = [f"{len(cases)} OOM messages of training runs; reserve = unallocated / (allocated + request)",
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
    """The cache fit and the distribution behind it: by size, by source, and the runs near their card."""
    room = [r for r in runs if not near_card(r)]
    megatron = [r for r in room if r["printed"] == "MB" and "Megatron" in r["run"]]
    lines = ["",
             f"{len(runs)} successful training runs ({len(room)} not near their card); cache = max reserved / "
             "max allocated - 1",
             f"fit (median, planner's ALLOCATOR_CACHE): {100 * fit_cache(runs):.1f} % of the tensor peak",
             "not near their card:      " + _spread([cache_ratio(r) for r in room]),
             "Megatron logs:            " + _spread([cache_ratio(r) for r in megatron]),
             "other logs:               " + _spread([cache_ratio(r) for r in room if r not in megatron])]
    for lo, hi in ((0, 10), (10, 30), (30, 60), (60, 1000)):
        sel = [cache_ratio(r) for r in room if lo <= r["max_allocated_gib"] < hi]
        lines.append(f"max allocated {lo:3d}-{hi:<4d} GiB: " + (_spread(sel) if sel else "n=  0"))
    lines += [f"near its card: reserved {100 * cache_ratio(r):.1f} % over allocated ({r['run']})"
              for r in runs if near_card(r)]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="the cases (default: bench/allocator_reserve.yaml)")
    args = p.parse_args(argv)
    print("\n".join(report(load(args.data))))


if __name__ == "__main__":
    main()
