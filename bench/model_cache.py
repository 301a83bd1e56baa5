"""Loading a GGUF model with and without the model cache (models/gguf_cache.py), each in a fresh process.

    python bench/model_cache.py              # bundled SmolLM2-135M GGUF; writes bench/results/model_cache.json
    python bench/model_cache.py --model x.gguf --precision bf16 --runs 3

Three ways, interleaved `--runs` times: `gguf` (cache off: transformers parses and de-quantizes the file, as before
the cache), `cold` (an empty cache: the same, plus saving the converted folder) and `warm` (the folder saved by a
`cold` run). Each process times the tokenizer and the model as a run loads them (load_tokenizer, build_model with
the demo's method and the given precision); the parent times the whole process (interpreter and imports
included). Reported: medians and the ratios warm/gguf and cold/gguf.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from shardfit.config import Config
from shardfit.models.build import build_model, load_tokenizer
from shardfit.models.source import resolve_model
t1 = time.perf_counter()
tok = load_tokenizer(resolve_model(sys.argv[1]))
t2 = time.perf_counter()
build_model(Config(model=sys.argv[1], method="lora", precision=sys.argv[2]), "single", weights=True)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "tokenizer_s": t2 - t1, "model_s": t3 - t2}))
"""


def one(model: str, precision: str, cache: str) -> dict[str, float]:
    """One fresh process loading the tokenizer and the model; `cache`: the SHARDFIT_MODEL_CACHE value."""
    env = dict(os.environ, SHARDFIT_MODEL_CACHE=cache, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, model, precision], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {**{k: round(v, 2) for k, v in out.items()}, "process_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "model_cache.json"))
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"gguf": [], "cold": [], "warm": []}
    for i in range(args.runs):
        cache = tempfile.mkdtemp(prefix="shardfit-model-cache-")
        try:
            rows["gguf"].append(one(args.model, args.precision, "0"))
            rows["cold"].append(one(args.model, args.precision, cache))
            rows["warm"].append(one(args.model, args.precision, cache))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"run {i + 1}/{args.runs}: " + "  ".join(f"{k} {v[-1]}" for k, v in rows.items()), flush=True)
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in v[0]} for k, v in rows.items()}
    ratio = {f"{k}_over_gguf": {m: round(med[k][m] / med["gguf"][m], 3) if med["gguf"][m] else None
                                for m in ("tokenizer_s", "model_s", "process_s")} for k in ("warm", "cold")}
    result = {"machine": f"{os.cpu_count()}-core {platform.machine()}", "date": time.strftime("%Y-%m-%d"),
              "model": args.model, "precision": args.precision, "runs": args.runs, "median": med, **ratio,
              "all": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median": med, **ratio}, indent=2))


if __name__ == "__main__":
    main()
