"""QLoRA against LoRA on the built-in demo (SmolLM2-135M-Instruct, the record-extraction task), one process.

    python bench/qlora.py                      # both methods, the demo's full epoch, writes bench/results/qlora.json
    python bench/qlora.py --max-steps 20       # a shorter run

Each method runs in its own subprocess with the demo's config (precision auto: fp32 on a CPU, bf16 on a GPU that
computes it), built by build_model as `shardfit train` builds it. Reported per method: the bytes of the frozen
linear weights of the decoder blocks as stored (NF4 for qlora) next to what they take in bf16, the process's peak
resident memory sampled during training (load excluded) and the whole process's peak, training tokens/s, the
held-out eval loss and the demo's held-out exact-match accuracy (greedy answers), before and after training.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from compare import PeakRss  # noqa: E402  (the sibling bench's RSS sampler)


@contextlib.contextmanager
def dense_weights(model: Any) -> Iterator[Any]:
    """`model` with each NF4 weight swapped for its dequantized values while the block runs (the same numbers its
    linear layers compute with, without dequantizing every weight again per generated token), then put back. Not
    a deepcopy: torchao's NF4 clone re-quantizes with its default grouping, which SmolLM2's k_proj cannot take."""
    from torch import nn

    from shardfit.models.quantize import quantized_linears

    kept = quantized_linears(model)
    saved = [m.weight for _, m in kept]
    for _, m in kept:
        m.weight = nn.Parameter(m.weight.get_original_weight(), requires_grad=False)
    try:
        yield model
    finally:
        for (_, m), w in zip(kept, saved, strict=True):
            m.weight = w


def _answers(model: Any, tok: Any, rows: list) -> list:
    from shardfit.demo.evaluate import generate_answers

    with dense_weights(model):
        return generate_answers(model, tok, rows)


def run_one(method: str, max_steps: int | None, heldout_rows: int, out: Path) -> None:
    """One method's run in this process; writes its numbers to `out`."""
    import torch

    from shardfit.config import load_config
    from shardfit.demo.evaluate import accuracy
    from shardfit.demo.run import DEMO_DIR, demo_config_path
    from shardfit.models.build import build_model, load_tokenizer
    from shardfit.models.quantize import is_nf4, nf4_storage_bytes
    from shardfit.models.source import resolve_model
    from shardfit.parallel.env import init_distributed, resolve_precision
    from shardfit.train.metrics import resident_peak_gib
    from shardfit.train.recipe import train

    env = init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"data={DEMO_DIR / 'train.jsonl'}", f"eval_data={DEMO_DIR / 'heldout.jsonl'}", f"method={method}",
                f"output_dir={tmp}/run", "save_steps=100000", "eval_steps=100000", "report_to=[none]"]
        if max_steps:
            over.append(f"max_steps={max_steps}")
        cfg = load_config(demo_config_path(), over)
        cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, env.device.type))
        heldout = [json.loads(x) for x in Path(cfg.eval_data).read_text().splitlines() if x.strip()][:heldout_rows]
        tok = load_tokenizer(resolve_model(cfg.model))
        model = build_model(cfg, "single", weights=True).to(env.device)
        stored = bf16 = 0
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith("base_layer.weight"):
                stored += nf4_storage_bytes(p) if is_nf4(p) else p.numel() * p.element_size()
                bf16 += p.numel() * 2
        print(f"{method}: base model loaded", flush=True)
        before = accuracy(_answers(model, tok, heldout))
        print(f"{method}: accuracy before {before:.1%}", flush=True)
        with PeakRss() as rss:
            result = train(cfg, env, model=model, tokenizer=tok)
        after = accuracy(_answers(result.model, tok, heldout))
        s = result.summary
        res = {"method": method, "precision": cfg.precision, "steps": s["steps"], "frozen_linear_bytes": stored,
               "frozen_linear_bf16_bytes": bf16, "frozen_ratio_to_bf16": round(stored / bf16, 4),
               "train_peak_rss_gib": round(rss.peak / 2**30, 3),
               "process_peak_rss_gib": round(resident_peak_gib(), 3),
               "tokens_per_s": s["tokens_per_s"], "train_loss": s["train_loss"], "eval_loss": s["eval_loss"],
               "accuracy_before": before, "accuracy_after": after, "train_wall_s": s["wall_s"],
               "torch": torch.__version__}
    out.write_text(json.dumps(res, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=None, help="stop each run after this many steps")
    ap.add_argument("--methods", default="lora,qlora")
    ap.add_argument("--heldout", type=int, default=48, help="held-out prompts answered for the accuracy")
    ap.add_argument("--collect", nargs="+", help="write the results of earlier `--one` runs (their JSON files)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_one(args.one, args.max_steps, args.heldout, args.out)
        return
    runs = {}
    if args.collect:
        runs = {r["method"]: r for r in (json.loads(Path(p).read_text()) for p in args.collect)}
    with tempfile.TemporaryDirectory() as tmp:
        for method in [] if args.collect else args.methods.split(","):
            out = Path(tmp) / f"{method}.json"
            cmd = [sys.executable, __file__, "--one", method, "--out", str(out)]
            cmd += ["--heldout", str(args.heldout)] + (["--max-steps", str(args.max_steps)] if args.max_steps else [])
            subprocess.run(cmd, check=True)
            runs[method] = json.loads(out.read_text())
            print(json.dumps(runs[method]), flush=True)
    res = {"machine": f"{platform.machine()} {platform.processor()}".strip(), "runs": runs}
    if {"lora", "qlora"} <= runs.keys():
        lo, q = runs["lora"], runs["qlora"]
        res["qlora_vs_lora"] = {"train_peak_rss": round(q["train_peak_rss_gib"] / lo["train_peak_rss_gib"], 3),
                                "tokens_per_s": round(q["tokens_per_s"] / lo["tokens_per_s"], 3),
                                "frozen_linear_bytes": round(q["frozen_linear_bytes"] / lo["frozen_linear_bytes"], 3)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "qlora.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res.get("qlora_vs_lora", {}), indent=2))


if __name__ == "__main__":
    main()
