"""Threads per process on a machine with other load: the old policy (PyTorch's default, a thread per CPU) against
shardfit's (parallel/threads.py: the cores this process may use, less what the load takes; passive waits).

    python bench/threads.py                      # busy loop on one core, then a second `shardfit train` as load
    python bench/threads.py --load none busy --rounds 3 --steps 16

Each measured run is `python -m shardfit train cfg.yaml` as a user runs it, on a small Qwen2-architecture model
(bench/workloads.py) with LoRA. The policies differ only in the environment the run starts with:

    old           OMP_NUM_THREADS = the CPUs of this process's affinity (what PyTorch chose before shardfit did)
    old+passive   the same, with OMP_WAIT_POLICY=PASSIVE (how much of the loss the wait policy alone recovers)
    new           nothing set: shardfit decides

The load runs for the whole of a round: `busy` is one Python process spinning (one core's worth), `train` a
second `shardfit train` of the same job, restarted whenever it ends, `none` nothing. Steps per second are the
training loop's (summary.json: steps over the loop's time, loading excluded). Rounds alternate the policies'
order so drift hits all alike; the JSON keeps every run with the load average when it began, and the medians'
ratios to `old`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import DEMO, ROOT, qwen2_small_folder  # noqa: E402

POLICIES = ("old", "old+passive", "new")
LOADS = ("none", "busy", "train")


def policy_env(policy: str) -> dict[str, str]:
    """The environment of a measured run: this one without any thread setting, plus the policy's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "SHARDFIT_OMP", "MKL_NUM"))}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cpus = str(len(os.sched_getaffinity(0)))
    if policy.startswith("old"):
        env["OMP_NUM_THREADS"] = cpus
    if policy == "old+passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def write_config(work: Path, name: str, steps: int) -> Path:
    """The job: LoRA on the small Qwen2 model, the demo's rows, `steps` steps, nothing written between them."""
    rows = (DEMO / "train.jsonl").read_text().splitlines()[:128]
    data = work / "train.jsonl"
    if not data.exists():
        data.write_text("\n".join(rows) + "\n")
    cfg = {"model": str(qwen2_small_folder(work / "qwen2")), "data": str(data), "method": "lora",
           "max_seq_len": 256, "micro_batch": 4, "max_steps": steps, "log_steps": 1, "save_steps": 10_000,
           "eval_steps": 10_000, "report_to": "none", "resume": "never", "precision": "fp32", "compile": False,
           "output_dir": str(work / f"run-{name}")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def measure(cfg: Path, policy: str, timeout_s: float) -> dict:
    """One `shardfit train` run: steps per second of its training loop, and its start line's thread count."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "shardfit", "train", str(cfg)], capture_output=True, text=True,
                       env=policy_env(policy), timeout=timeout_s, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{policy}: shardfit train failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out_dir = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    s = json.loads((out_dir / "summary.json").read_text())
    steps_per_s = s["tokens_per_s"] * s["steps"] / s["tokens"]
    threads = next((part.strip() for line in r.stdout.splitlines() for part in line.split(";")
                    if "per rank" in part), "?")
    return {"policy": policy, "steps_per_s": round(steps_per_s, 4), "wall_s": round(wall, 2),
            "load_avg_1m": load, "threads": threads}


class Load:
    """The other work on the machine while a round runs."""

    def __init__(self, kind: str, work: Path, steps: int):
        self.kind, self.procs = kind, []
        self.cfg = write_config(work, "load", max(steps, 50)) if kind == "train" else None
        self.log = open(work / "load.log", "w")  # noqa: SIM115 - closed in stop()

    def start(self) -> None:
        if self.kind == "busy":
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
        elif self.kind == "train":  # restarted whenever it ends, so the load lasts the round
            loop = f"while true; do {sys.executable} -m shardfit train {self.cfg}; done"
            self.procs = [subprocess.Popen(["bash", "-c", loop], env=policy_env("new"), cwd=ROOT, stdout=self.log,
                                           stderr=subprocess.STDOUT, start_new_session=True)]
        time.sleep(20 if self.kind == "train" else 2)  # the second training past its start-up, computing

    def stop(self) -> None:
        for p in self.procs:
            if self.kind == "train":
                os.killpg(p.pid, 9)
            else:
                p.kill()
            p.wait()
        self.procs = []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", nargs="+", choices=LOADS, default=["busy", "train"])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each measured run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one measured run may take")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "threads.json"))
    args = p.parse_args()
    result: dict = {"cpus": len(os.sched_getaffinity(0)), "cpu_model": _cpu_model(), "steps": args.steps,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loads": {}}
    with tempfile.TemporaryDirectory(prefix="shardfit-threads-") as tmp:
        work = Path(tmp)
        cfg = write_config(work, "measured", args.steps)
        for kind in args.load:
            load, runs = Load(kind, work, args.steps), []
            load.start()
            try:
                for r in range(args.rounds):
                    order = args.policies if r % 2 == 0 else list(reversed(args.policies))
                    for policy in order:
                        runs.append(measure(cfg, policy, args.timeout))
                        print(f"load {kind}, round {r + 1}: {runs[-1]}", flush=True)
            finally:
                load.stop()
            result["loads"][kind] = summarise(runs, args.policies)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def summarise(runs: list[dict], policies: list[str]) -> dict:
    """Every run, each policy's median steps per second, and its ratio to the old policy's."""
    med = {p: statistics.median(r["steps_per_s"] for r in runs if r["policy"] == p) for p in policies}
    base = med.get("old")
    return {"runs": runs, "median_steps_per_s": {p: round(v, 4) for p, v in med.items()},
            "ratio_to_old": {p: round(v / base, 2) for p, v in med.items()} if base else {}}


def report(result: dict) -> str:
    lines = [f"{result['cpus']} CPU(s), {result['cpu_model']}; {result['steps']} steps per run"]
    for kind, s in result["loads"].items():
        cells = ", ".join(f"{p} {v:.3f} steps/s" + (f" ({s['ratio_to_old'][p]:.2f}x old)" if s["ratio_to_old"]
                                                    else "") for p, v in s["median_steps_per_s"].items())
        threads = sorted({f"{r['policy']}: {r['threads']}" for r in s["runs"]})
        lines.append(f"load {kind}: {cells}\n  threads: " + "; ".join(threads))
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    raise SystemExit(main())
