"""What the C memory allocator does to a CPU fine-tune: shardfit under glibc's malloc, tcmalloc and jemalloc.

Each bench workload runs once per allocator and round (interleaved, each in its own process, as compare.py runs
it), with `SHARDFIT_ALLOCATOR` set; `--peer-workloads` also runs the workload's first peer (same config) under
glibc and under tcmalloc preloaded by hand, which tells the allocator's share of a peer ratio from the engine's.
Writes bench/results/allocator.json (medians per allocator, every run kept).

    python bench/allocator.py --runs 1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import compare  # noqa: E402
from workloads import WORKLOADS, prepare, tokenized, user_config  # noqa: E402

from shardfit.parallel.allocator import CHOICE_ENV, find, library_dirs  # noqa: E402

ALLOCATORS = ("system", "tcmalloc", "jemalloc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="interleaved rounds")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="NAME")
    p.add_argument("--peer-workloads", nargs="*", default=["smollm2-135m-lora", "qwen2-small-full-zero3"],
                   choices=list(WORKLOADS), metavar="NAME", help="workloads whose first peer also runs under tcmalloc")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of a one-process run")
    p.add_argument("--out", default=str(BENCH / "results" / "allocator.json"))
    p.add_argument("--work-dir", default=None, help="where runs write, kept (default: a temporary folder, removed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    compare.THREADS["n"] = args.threads
    with compare.work_folder(args.work_dir, "shardfit-alloc-") as work:
        run(args, work, argv)


def run(args: argparse.Namespace, work: Path, argv: list[str] | None) -> None:
    """Every asked workload under each installed allocator, in `work`; the JSON written and the medians printed."""
    tcmalloc = find("tcmalloc", library_dirs())
    available = [a for a in ALLOCATORS if a == "system" or find(a, library_dirs()) is not None]
    t0 = time.perf_counter()
    report: dict = {"machine": f"{os.cpu_count()}-core CPU ({platform.machine()})", "date": time.strftime("%Y-%m-%d"),
                    "command": "python bench/allocator.py " + " ".join(argv or sys.argv[1:]),
                    "omp_threads": args.threads, "allocators": available, "workloads": []}
    for name in args.workloads:
        w = WORKLOADS[name]
        paths = prepare(w, work)
        n = len(tokenized(dict(user_config(w, paths, str(work / "unused")), eval_data=None))[0])
        runs: list[dict] = []
        for i in range(args.runs):
            for alloc in available:
                out = work / f"{name}-r{i}-{alloc}"
                rec = compare.run_shardfit(w, user_config(w, paths, str(out)), work / f"{out.name}-cfg", n,
                                           env={CHOICE_ENV: alloc})
                runs.append(dict(rec, allocator=alloc, round=i))
                print(f"{name} round {i + 1}: shardfit {alloc}: {rec['tokens_per_s']:.0f} tok/s whole process, "
                      f"peak {rec['peak_mem_gib']:.3f} GiB", flush=True)
            if name in args.peer_workloads and tcmalloc is not None:
                peer = w.peers[0]
                for alloc, env in (("system", {}), ("tcmalloc", {"LD_PRELOAD": tcmalloc.path})):
                    out = work / f"{name}-r{i}-{peer}-{alloc}"
                    rec = compare.run_peer(w, peer, "same_config", user_config(w, paths, str(out)),
                                           work / f"{out.name}-cfg", w.micro_batch, env=env)
                    runs.append(dict(rec, allocator=alloc, round=i))
                    print(f"{name} round {i + 1}: {peer} {alloc}: {rec['tokens_per_s']:.0f} tok/s whole process, "
                          f"peak {rec['peak_mem_gib']:.3f} GiB", flush=True)
        medians = {}
        for who in dict.fromkeys(r["who"] for r in runs):
            for alloc in available:
                mine = [r for r in runs if r["who"] == who and r["allocator"] == alloc and "failed" not in r]
                if mine:
                    medians[f"{who}/{alloc}"] = {k: statistics.median(r[k] for r in mine)
                                                 for k in ("tokens_per_s", "train_tokens_per_s", "peak_mem_gib")}
        for key, m in medians.items():
            base = medians.get(key.split("/")[0] + "/system")
            if base:
                m["speed_vs_system"] = m["tokens_per_s"] / base["tokens_per_s"]
                m["memory_vs_system"] = m["peak_mem_gib"] / base["peak_mem_gib"]
        report["workloads"].append({"name": name, "runs": args.runs, "medians": medians, "all_runs": runs})
    report["bench_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(report, indent=1))
    for e in report["workloads"]:
        for key, m in e["medians"].items():
            print(f"{e['name']:28s} {key:22s} {m['tokens_per_s']:7.0f} tok/s  {m['peak_mem_gib']:.3f} GiB  "
                  f"speed {m.get('speed_vs_system', 1):.2f}x  memory {m.get('memory_vs_system', 1):.2f}x")


if __name__ == "__main__":
    main()
