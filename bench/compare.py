"""shardfit against the Hugging Face Trainer on the same fine-tune (CONTRACTS.md section 8).

    python bench/compare.py                 # every workload, 3 interleaved runs each, writes bench/results/
    python bench/compare.py --runs 1 --workloads smollm2-135m-lora

Each run is its own subprocess; the model is loaded before the timed part for both, and peak memory is the
resident set sampled during training (the whole process's peak RSS, load included, is recorded beside it).
Runs alternate shardfit, Trainer, shardfit, ... so machine noise hits both alike.

shardfit runs with `compile: true` (each decoder block torch.compile'd); its kernels are cached in a folder new
to each bench, so shardfit's first run includes compiling and later runs reuse the cache, as a user's second run
of the same model would. Every run's numbers are kept in the JSON beside the medians.

The Trainer is set up as LLaMA-Factory and axolotl set it up by default: padding to the longest sequence in the
batch, no packing, DataCollatorForSeq2Seq, the same LoRA config, learning rate, cosine schedule, warmup, seed
and epochs, and as many examples per step as shardfit's packed rows hold, so both see the same tokens per
optimizer step. Eval loss is computed the same way for both (mean token loss over the held-out examples).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEMO = ROOT / "src" / "shardfit" / "demo"


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # "smollm2" (the bundled GGUF) or "qwen2-small" (built from a config, random init)
    method: str
    data: str  # "demo" or "longtail"
    max_seq_len: int
    micro_batch: int  # shardfit packed rows per step
    lr: float
    epochs: int = 1
    compile: bool = True  # shardfit's `compile: true` (the Trainer runs eager, as those tools do by default)
    attention: str = "auto"  # shardfit's attn_implementation (the Trainer keeps transformers' default, SDPA)


WORKLOADS = {
    # Rows of 256 tokens: on CPU, compiled eager attention (fused matmul-mask-softmax) beats SDPA's masked flash
    # kernel, which cannot skip the causal half when packing passes a mask (step 2.8 -> 2.15 s, measured).
    "smollm2-135m-lora": Workload("smollm2-135m-lora", "smollm2", "lora", "demo", 256, 4, 1e-3, attention="eager"),
    # Four narrow blocks under a 49k-token head: compiling the blocks buys nothing here and costs its compile time.
    "qwen2-small-full-longtail": Workload("qwen2-small-full-longtail", "qwen2-small", "full", "longtail", 1024, 2,
                                          5e-4, compile=False),
}


def _longtail(out: Path) -> tuple[Path, Path]:
    """Many short conversations and a few long ones (lengths ~ geometric), built from the demo notes."""
    rng = random.Random(7)
    notes = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    rows = []
    for _ in range(260):
        k = min(1 + int(rng.expovariate(0.35)), 24)
        picked = rng.sample(notes, k)
        rows.append({"instruction": "Extract every contact record from these notes, one per line.",
                     "input": "\n".join(n["input"] for n in picked),
                     "output": "\n".join(n["output"] for n in picked)})
    train, held = rows[:230], rows[230:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    return out / "train.jsonl", out / "eval.jsonl"


def _qwen2_small(out: Path) -> Path:
    """A small Qwen2-architecture model (random init, fixed seed) with the SmolLM2 tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from shardfit.models.build import load_tokenizer
    from shardfit.models.source import resolve_model

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")).save_pretrained(out)
    return out


def prepare(w: Workload, work: Path) -> dict:
    """Model path and data paths for a workload (created once per bench invocation)."""
    if w.data == "demo":
        train, evals = DEMO / "train.jsonl", DEMO / "heldout.jsonl"
    else:
        train, evals = _longtail(work / "longtail")
    model = "HuggingFaceTB/SmolLM2-135M-Instruct" if w.model == "smollm2" else str(_qwen2_small(work / "qwen2"))
    return {"model": model, "train": str(train), "eval": str(evals)}


def _config(w: Workload, paths: dict, out: Path):
    from shardfit.config import load_config

    return load_config(None, [f"model={paths['model']}", f"data={paths['train']}", f"eval_data={paths['eval']}",
                              f"method={w.method}", f"max_seq_len={w.max_seq_len}", f"micro_batch={w.micro_batch}",
                              f"lr={w.lr}", f"epochs={w.epochs}", "precision=bf16", "warmup_ratio=0.05",
                              "lora.rank=16", "lora.alpha=32", "save_steps=100000", "eval_steps=100000",
                              "log_steps=1000", "seed=42", "resume=never", f"output_dir={out}"])


def eval_loss(model, examples) -> float:
    """Mean token loss over examples, one at a time (the same function for both trainers)."""
    import torch

    from shardfit.data.loader import collate
    from shardfit.data.packing import no_pack
    from shardfit.train.loss import CausalLMLoss

    module = CausalLMLoss(model)
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for row in no_pack(examples):
            b = collate([row], 0)
            loss, k = module(b.input_ids, b.position_ids, b.targets)
            total, n = total + float(loss), n + k
    return total / max(n, 1)


class PeakRss:
    """Peak resident memory of this process while the block runs (sampled every 20 ms from /proc)."""

    def __enter__(self) -> PeakRss:
        import threading

        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_shardfit(w: Workload, paths: dict, out: Path, eager: bool = False) -> dict:
    from shardfit.data.dataset import build_datasets
    from shardfit.models.build import build_model, load_tokenizer
    from shardfit.models.source import resolve_model
    from shardfit.parallel.env import init_distributed
    from shardfit.train.recipe import train

    cfg = dataclasses.replace(_config(w, paths, out), compile=w.compile and not eager,
                              attn_implementation="auto" if eager else w.attention)
    # Loading is outside the timed part, as for the Trainer.
    model, tok = build_model(cfg, "single", weights=True), load_tokenizer(resolve_model(cfg.model))
    t0 = time.perf_counter()
    with PeakRss() as mem:
        result = train(cfg, init_distributed(), model=model, tokenizer=tok, quiet=True)
    wall = time.perf_counter() - t0
    _, evals, _ = build_datasets(cfg, result.tokenizer)
    return {"tokens": result.summary["tokens"], "wall_s": wall, "eval_loss": eval_loss(result.model, evals),
            "peak_mem_gib": mem.peak / 2**30}


def run_trainer(w: Workload, paths: dict, out: Path) -> dict:
    import torch
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from shardfit.data.dataset import build_datasets
    from shardfit.data.packing import pack
    from shardfit.data.tokenize import IGNORE
    from shardfit.models.build import build_model, load_tokenizer
    from shardfit.models.source import resolve_model

    cfg = _config(w, paths, out)
    model, tok = build_model(cfg, "single", weights=True), load_tokenizer(resolve_model(cfg.model))  # LoRA applied
    train_ex, eval_ex, _ = build_datasets(cfg, tok)
    # As many examples per step as shardfit's packed rows hold: the same tokens per optimizer step.
    rows = pack(train_ex, cfg.max_seq_len)
    per_step = max(1, round(len(train_ex) / len(rows) * w.micro_batch))

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(train_ex)

        def __getitem__(self, i: int) -> dict:
            ex = train_ex[i]
            labels = [IGNORE] + ex.targets[:-1]  # the Trainer shifts labels itself
            return {"input_ids": ex.input_ids, "attention_mask": [1] * len(ex.input_ids), "labels": labels}

    total_steps = -(-len(train_ex) // per_step) * w.epochs
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
                             learning_rate=w.lr, lr_scheduler_type="cosine", warmup_steps=int(0.05 * total_steps),
                             num_train_epochs=w.epochs, bf16=True, use_cpu=True, logging_steps=1000,
                             save_strategy="no", report_to=[], seed=42, dataloader_num_workers=0, max_grad_norm=1.0,
                             weight_decay=0.0, optim="adamw_torch", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(),
                      data_collator=DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=IGNORE))
    t0 = time.perf_counter()
    with PeakRss() as mem:
        trainer.train()
    wall = time.perf_counter() - t0
    tokens = sum(len(ex.input_ids) for ex in train_ex) * w.epochs
    return {"tokens": tokens, "wall_s": wall, "eval_loss": eval_loss(model, eval_ex), "examples_per_step": per_step,
            "peak_mem_gib": mem.peak / 2**30}


def child(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    w = WORKLOADS[args.workload]
    paths = json.loads(args.paths)
    out = Path(args.out_dir)
    res = run_shardfit(w, paths, out, args.eager) if args.run == "shardfit" else run_trainer(w, paths, out)
    res["tokens_per_s"] = res["tokens"] / res["wall_s"]
    res["process_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(args.result).write_text(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    p.add_argument("--eager", action="store_true", help="shardfit without compile: true (to see what compiling adds)")
    p.add_argument("--run", choices=("shardfit", "trainer"), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        child(args)
        return
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="shardfit-bench-"))
    report = {"machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), "
                         f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
              "date": time.strftime("%Y-%m-%d"), "workloads": []}
    for name in args.workloads:
        w = WORKLOADS[name]
        paths = prepare(w, work)
        runs: dict[str, list[dict]] = {"shardfit": [], "trainer": []}
        for i in range(args.runs):
            for who in ("shardfit", "trainer"):
                result = work / f"{name}-{who}-{i}.json"
                # A cache of compiled kernels new to this bench: run 1 pays the compile, later runs reuse it.
                env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()),
                           TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-cache"))
                cmd = [sys.executable, __file__, "--run", who, "--workload", name, "--paths", json.dumps(paths),
                       "--out-dir", str(work / f"{name}-{who}-{i}"), "--result", str(result)] + \
                    (["--eager"] if args.eager else [])
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.stderr.write(r.stderr[-4000:])
                    raise SystemExit(f"bench run failed: {who} {name}")
                runs[who].append(json.loads(result.read_text()))
                print(f"{name} {who} run {i + 1}: {runs[who][-1]['tokens_per_s']:.0f} tok/s, "
                      f"{runs[who][-1]['wall_s']:.1f} s, eval loss {runs[who][-1]['eval_loss']:.4f}", flush=True)
        med = {who: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "wall_s", "peak_mem_gib",
                                                                       "eval_loss")} for who, rs in runs.items()}
        report["workloads"].append({
            "name": name, "date": report["date"], "shardfit": med["shardfit"], "hf_trainer": med["trainer"],
            "speedup": statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                         for a, b in zip(runs["shardfit"], runs["trainer"], strict=True)),
            "memory_ratio": statistics.median(a["peak_mem_gib"] / b["peak_mem_gib"]
                                              for a, b in zip(runs["shardfit"], runs["trainer"], strict=True)),
            "eval_loss_ratio": statistics.median(a["eval_loss"] / b["eval_loss"]
                                                 for a, b in zip(runs["shardfit"], runs["trainer"], strict=True)),
            "runs": args.runs,
            "per_run_tokens_per_s": {who: [round(r["tokens_per_s"], 1) for r in rs] for who, rs in runs.items()},
            "per_run_peak_mem_gib": {who: [round(r["peak_mem_gib"], 3) for r in rs] for who, rs in runs.items()}})
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("eager.json" if args.eager else "latest.json")
    if path.exists():  # a run of some workloads keeps the others' last results (each entry has its date)
        done = {w["name"] for w in report["workloads"]}
        old = json.loads(path.read_text())["workloads"]
        kept = [w for w in old if w["name"] not in done and w["name"] in WORKLOADS]
        report["workloads"] = sorted(kept + report["workloads"], key=lambda w: list(WORKLOADS).index(w["name"]))
    path.write_text(json.dumps(report, indent=2))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"Measured on {report['machine']} (median of interleaved runs).", "",
             "| workload | shardfit tok/s | Trainer tok/s | speedup | shardfit peak GiB | Trainer peak GiB | "
             "memory ratio | eval loss (shardfit / Trainer) |",
             "|---|---|---|---|---|---|---|---|"]
    for w in report["workloads"]:
        s, t = w["shardfit"], w["hf_trainer"]
        lines.append(f"| {w['name']} | {s['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {w['speedup']:.2f}x | "
                     f"{s['peak_mem_gib']:.2f} | {t['peak_mem_gib']:.2f} | {w['memory_ratio']:.2f} | "
                     f"{s['eval_loss']:.4f} / {t['eval_loss']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
