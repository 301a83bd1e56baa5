"""How long shardfit's commands take to start, this checkout against another commit, each in a fresh process.

    python bench/startup.py                     # against main; writes bench/results/startup.json
    python bench/startup.py --base HEAD~3 --runs 5 --only plan launch

The other commit's `src/` is taken with `git archive` into a temporary folder; both run from the same interpreter
and virtual environment, interleaved `--runs` times in alternating order (before, after, after, before, ...), so
that a machine shared with other work loads both alike. Three commands:
- `plan`: `shardfit plan --model FOLDER` on a folder holding only a config.json (a 1.1B Llama's sizes);
- `launch`: `shardfit train CONFIG --nproc 2` up to the torchrun it would start (stubbed out, so no rank starts):
  the config read, the job resolved, the launch checked;
- `demo`: `shardfit train` with no config (the demo) with an empty model cache, as its first run on a machine; one
  step, one held-out row: its `model_load_s` (demo.json: the tokenizer and the model, GGUF parsing and the
  cache's conversion included) and the whole process.
Reported: the median seconds of each and after/before as a ratio. A timing, never a test (the machine's load
moves it); tests/test_gguf_reads.py and tests/test_plan_cli.py check the structure instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# A 1.1B Llama's config.json (TinyLlama's sizes): what `plan --model ./folder` reads.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
         "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 22,
         "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}

# The launch up to torchrun: `relaunch` (what starts torchrun) answers at once instead.
LAUNCH = """
import sys
import shardfit.parallel.launch as launch
launch.relaunch = lambda cmd, env: 0
from shardfit.cli.main import main
sys.exit(main(["train", sys.argv[1], "--nproc", "2"]))
"""


def base_src(ref: str, into: Path) -> Path:
    """`src/` of commit `ref`, written under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def timed(argv: list[str], src: Path, env_extra: dict[str, str] | None = None) -> float:
    """Seconds one fresh process of `argv` takes with `src` on its path; a failure stops the bench."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(env_extra or {}))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} ({src}) failed:\n{r.stderr[-3000:]}")
    return round(wall, 2)


def plan_cmd(work: Path) -> Callable[[Path], dict[str, float]]:
    folder = work / "llama-1b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return lambda src: {"process_s": timed(["-m", "shardfit", "plan", "--model", str(folder)], src)}


def launch_cmd(work: Path) -> Callable[[Path], dict[str, float]]:
    folder = work / "launch"
    folder.mkdir()
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text(json.dumps(LLAMA))
    (folder / "train.jsonl").write_text(json.dumps({"instruction": "say hi", "output": "hi"}) + "\n")
    (folder / "train.yaml").write_text(f"model: {folder / 'model'}\ndata: {folder / 'train.jsonl'}\n"
                                       f"method: lora\nmax_seq_len: 128\noutput_dir: {folder / 'runs'}\n")
    return lambda src: {"process_s": timed(["-c", LAUNCH, str(folder / "train.yaml")], src)}


def demo_cmd(work: Path) -> Callable[[Path], dict[str, float]]:
    heldout = work / "heldout.jsonl"
    demo = ROOT / "src" / "shardfit" / "demo" / "heldout.jsonl"
    heldout.write_text(demo.read_text().splitlines(keepends=True)[0])
    runs = iter(range(10**6))

    def one(src: Path) -> dict[str, float]:
        n = next(runs)
        out, cache = work / f"demo-{n}", work / f"cache-{n}"  # an empty model cache: the demo's first run
        wall = timed(["-m", "shardfit", "train", "--set", "max_steps=1", "--set", f"eval_data={heldout}", "--set",
                      f"output_dir={out}", "--set", "save_steps=100"], src, {"SHARDFIT_MODEL_CACHE": str(cache)})
        load = json.loads((out / "demo.json").read_text())["model_load_s"]
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        return {"model_load_s": round(load, 2), "process_s": wall}

    return one


COMMANDS = {"plan": plan_cmd, "launch": launch_cmd, "demo": demo_cmd}


def summary(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float | None]]:
    """Medians of each measure before and after, and after/before."""
    out: dict[str, dict[str, float | None]] = {}
    for measure in rows["before"][0]:
        before = statistics.median(r[measure] for r in rows["before"])
        after = statistics.median(r[measure] for r in rows["after"])
        out[measure] = {"before": round(before, 2), "after": round(after, 2),
                        "after_over_before": round(after / before, 3) if before else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="the commit to compare with (before)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=sorted(COMMANDS), default=sorted(COMMANDS))
    ap.add_argument("--out", default=str(RESULTS / "startup.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardfit-startup-"))
    try:
        sources = {"before": base_src(args.base, work), "after": ROOT / "src"}
        result: dict[str, object] = {
            "machine": f"{os.cpu_count()}-core {platform.machine()}", "date": time.strftime("%Y-%m-%d"),
            "base": args.base, "runs": args.runs,
            "load_1m_at_start": round(os.getloadavg()[0], 2)}
        for name in args.only:
            command = COMMANDS[name](work)
            rows: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for i in range(args.runs):
                # the order alternates: the second process of a pair meets the first one's page cache and load
                for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    rows[side].append(command(sources[side]))
                print(f"{name} {i + 1}/{args.runs}: before {rows['before'][-1]}  after {rows['after'][-1]}",
                      flush=True)
            result[name] = {"median": summary(rows), "all": rows}
        result["load_1m_at_end"] = round(os.getloadavg()[0], 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v["median"] for k, v in result.items() if isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
