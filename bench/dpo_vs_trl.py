"""shardfit's DPO against TRL's DPOTrainer on the same pairs, model, LoRA and schedule (issue 44).

    python bench/dpo_vs_trl.py              # 8 steps of 4 pairs, 24 held-out pairs: under 10 minutes on 2 cores
    python bench/dpo_vs_trl.py --threads 1  # one thread a process, on a machine shared with other jobs
    python bench/dpo_vs_trl.py --runs 3     # medians of 3 interleaved rounds

The pairs are made from the demo's contact notes (src/shardfit/demo/train.jsonl, heldout.jsonl): the prompt is the
note, the chosen answer the record as the demo writes it (`name=Anya Khan; city=Denver; ext=2485`), the rejected
one the same facts in another layout (`Anya Khan (Denver), extension 2485`), as TRL conversational rows
({"prompt", "chosen", "rejected"} message lists) that both tools read from the same file. The first
`steps x micro_batch` training notes are trained on for one epoch; the held-out notes are evaluated once, at the
end.

shardfit runs as a user runs it (`python -m shardfit train cfg.json`, through bench/compare.py's `run_shardfit`):
objective dpo, the sigmoid loss, the LoRA reference (the adapters switched off). TRL's DPOTrainer gets the same
model folder (SmolLM2-135M-Instruct's bundled GGUF dequantised once into a safetensors folder, bench/workloads.py),
the same rows, LoRA r8/alpha16 on all linear layers with dropout 0 (a peft config, so its reference is the
adapters switched off too), beta, max_length, micro batch, lr, cosine schedule with 5% warmup, AdamW, clipping,
seed and precision (bench/peers.py's arguments); anything else is TRL's default (its gradient checkpointing
included). Precision is what shardfit's `auto` resolves to on this machine, given to both: bf16 on a GPU or a CPU
with bf16 units, fp32 elsewhere.

Each side runs in its own process. Measured: tokens/s (both answers of every trained pair with their prompt, the
tokens each tool forwards; the two tools' tokenisations are checked to give the same count) over the whole process
and over the training loop alone (shardfit's summary.json; TRL's `trainer.train()`); peak memory (CPU: the peak
resident set; GPU: torch.cuda's max allocated), and the process's own peak resident set beside; the held-out loss
and reward accuracy after training (shardfit counts a tie as half a hit, TRL as a miss; after training ties do not
happen). Written to bench/results/dpo_vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

# bench/ is not a package; its path is set above.
from compare import THREADS, _env, _failed, machine_name, medians, ratios, run_shardfit, work_folder  # noqa: E402
from proc import run_measured  # noqa: E402
from threads import _cpu_model  # noqa: E402
from workloads import DEMO, SMOLLM2, Workload, _smollm2_folder, _write_jsonl, user_config  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PEER = "trl_dpo"
BETA = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (one epoch of steps x micro-batch pairs)")
    p.add_argument("--micro-batch", type=int, default=4, help="pairs per step (grad_accum 1)")
    p.add_argument("--eval-pairs", type=int, default=24, help="held-out pairs (the demo has 48)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=1, help="interleaved rounds (medians over them)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP threads per process")
    p.add_argument("--out", default=str(RESULTS / "dpo_vs_trl.json"))
    p.add_argument("--work-dir", default=None, help="where runs write, kept (default: a temporary folder, removed)")
    p.add_argument("--peer-config", help=argparse.SUPPRESS)  # the TRL child: its config and result files
    p.add_argument("--peer-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.steps, args.micro_batch, args.eval_pairs, args.runs, args.threads) < 1:
        p.error("--steps, --micro-batch, --eval-pairs, --runs and --threads must be at least 1")
    return args


def pair_row(note: dict) -> dict:
    """A demo note as a TRL conversational preference row: the demo's record chosen, the same facts as prose
    rejected."""
    name, city, ext = re.fullmatch(r"name=(.*); city=(.*); ext=(.*)", note["output"]).groups()
    return {"prompt": [{"role": "user", "content": f"{note['instruction']}\n{note['input']}"}],
            "chosen": [{"role": "assistant", "content": note["output"]}],
            "rejected": [{"role": "assistant", "content": f"{name} ({city}), extension {ext}"}]}


def write_pairs(work: Path, n_train: int, n_eval: int) -> dict[str, Path]:
    notes = {s: [json.loads(line) for line in (DEMO / f"{s}.jsonl").read_text().splitlines()]
             for s in ("train", "heldout")}
    if n_train > len(notes["train"]) or n_eval > len(notes["heldout"]):
        raise SystemExit(f"the demo has {len(notes['train'])} training and {len(notes['heldout'])} held-out notes; "
                         f"asked for {n_train} and {n_eval}")
    return {"train": _write_jsonl(work / "pairs" / "train.jsonl", [pair_row(n) for n in notes["train"][:n_train]]),
            "eval": _write_jsonl(work / "pairs" / "eval.jsonl", [pair_row(n) for n in notes["heldout"][:n_eval]])}


def dpo_config(w: Workload, model: Path, data: dict[str, Path], out: Path) -> dict[str, Any]:
    """The user's config: the SFT bench's (bench/workloads.py) with the preference keys and the held-out pairs."""
    cfg = user_config(w, {"model": str(model), "train": str(data["train"])}, str(out))
    cfg.update(objective="dpo", dpo={"beta": BETA, "loss": "sigmoid"}, eval_data=str(data["eval"]),
               lora=dict(cfg["lora"], dropout=0.0), report_to=["none"])
    return cfg


# -- the TRL side (its own process) -------------------------------------------------------------------------------
def run_trl(cfg: dict, batch: int) -> dict:
    """TRL's DPOTrainer on the config's rows; this process's measurements."""
    import datasets
    from peers import _common_args, _lora_config, _model_dtype
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from shardfit.train.metrics import peak_mem_gib

    def rows(path: str) -> datasets.Dataset:
        return datasets.Dataset.from_list([json.loads(x) for x in Path(path).read_text().splitlines()])

    out = Path(cfg["output_dir"])
    args = DPOConfig(**_common_args(cfg, batch, out), beta=cfg["dpo"]["beta"], loss_type=["sigmoid"],
                     max_length=cfg["max_seq_len"], per_device_eval_batch_size=batch, eval_strategy="no")
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=_model_dtype(cfg, bool(args.bf16)))
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows(cfg["data"]), eval_dataset=rows(cfg["eval_data"]),
                         processing_class=AutoTokenizer.from_pretrained(cfg["model"]), peft_config=_lora_config(cfg))
    ds = trainer.train_dataset
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    evals = trainer.evaluate()
    tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"],
                                                                strict=True))
    return {"train_s": train_s, "steps": trainer.state.global_step, "examples": len(ds), "tokens": tokens,
            "peak_mem_gib": peak_mem_gib(trainer.args.device), "precision": "bf16" if args.bf16 else "fp32",
            "eval_loss": evals["eval_loss"], "eval_reward_accuracy": evals["eval_rewards/accuracies"],
            "eval_rewards_margin": evals["eval_rewards/margins"],
            "trl_gradient_checkpointing": args.gradient_checkpointing}


def peer_run(w: Workload, cfg: dict, run_dir: Path) -> dict:
    """The TRL child, measured as compare.py measures a peer."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, result = run_dir / "config.json", run_dir / "result.json"
    path.write_text(json.dumps(cfg))
    m = run_measured([sys.executable, __file__, "--peer-config", str(path), "--peer-result", str(result)], _env(1))
    if m.returncode != 0:
        raise _failed(PEER, m)
    r = json.loads(result.read_text())
    return {"who": PEER, "wall_s": m.wall_s, "tokens_per_s": r["tokens"] / m.wall_s,
            "train_tokens_per_s": r["tokens"] / r["train_s"], "examples_per_step": r["examples"] / max(r["steps"], 1),
            "process_peak_rss_gib": m.peak_rss_gib, "load_avg_1m": m.load_avg_1m, "batch_per_device": w.micro_batch,
            **r}


def shardfit_run(w: Workload, cfg: dict, run_dir: Path) -> dict:
    """shardfit through compare.py's runner, with the held-out preference figures of its summary."""
    rec = run_shardfit(w, cfg, run_dir, w.rows)
    summary = json.loads((Path(cfg["output_dir"]) / "summary.json").read_text())
    rec.update({k: summary.get(k) for k in ("eval_loss", "eval_reward_accuracy", "eval_rewards_margin", "reference",
                                            "loss_chunk", "packing")})
    return rec


# -- the driver ---------------------------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from shardfit.parallel.env import resolve_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = resolve_precision("auto", device)
    n_train = args.steps * args.micro_batch
    w = Workload("smollm2-135m-lora-dpo", "smollm2", "lora", "demo-pairs", n_train, args.max_seq_len,
                 args.micro_batch, args.lr, (PEER,), eval_rows=args.eval_pairs, precision=precision)
    t0, runs = time.perf_counter(), []
    data = write_pairs(work, n_train, args.eval_pairs)
    model = _smollm2_folder(work / "smollm2")
    for i in range(args.runs):
        for who, runner in (("shardfit", shardfit_run), (PEER, peer_run)):
            out = work / f"r{i}-{who}"
            rec = dict(runner(w, dpo_config(w, model, data, out), work / f"{out.name}-cfg"), round=i)
            runs.append(rec)
            print(f"round {i + 1}: {who}: {rec['train_tokens_per_s']:.0f} tok/s training, {rec['tokens_per_s']:.0f} "
                  f"whole process, peak {rec['peak_mem_gib']:.2f} GiB, held-out reward accuracy "
                  f"{rec['eval_reward_accuracy']:.3f}, load {rec['load_avg_1m']:.1f}", flush=True)
    return summarise(args, w, runs, time.perf_counter() - t0)


def summarise(args: argparse.Namespace, w: Workload, runs: list[dict], bench_s: float) -> dict:
    """Medians per side, shardfit / TRL ratios per round then their median (compare.py's), every run kept."""
    sides = {who: [r for r in runs if r["who"] == who] for who in ("shardfit", PEER)}
    extra = ("eval_reward_accuracy", "eval_rewards_margin")
    out = {who: {**medians(rs), **{k: statistics.median(r[k] for r in rs) for k in extra},
                 "precision": rs[0]["precision"]} for who, rs in sides.items()}
    return {"machine": machine_name(), "cpu": _cpu_model(), "date": time.strftime("%Y-%m-%d"),
            "command": "python bench/dpo_vs_trl.py " + " ".join(sys.argv[1:]), "omp_threads": args.threads,
            "model": SMOLLM2, "steps": args.steps, "micro_batch": args.micro_batch, "train_pairs": w.rows,
            "eval_pairs": w.eval_rows, "lr": w.lr, "beta": BETA, "max_seq_len": w.max_seq_len,
            "lora": {"rank": w.lora_rank, "alpha": w.lora_alpha, "dropout": 0.0}, "precision": w.precision,
            "runs": args.runs, "bench_s": round(bench_s, 1),
            # Both tools forwarded the same tokens: their tokenisations of the same rows agree.
            "same_tokens": len({r["tokens"] for r in runs}) == 1,
            **out, "ratios": ratios(sides["shardfit"], sides[PEER]), "all_runs": runs}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peer_config:
        cfg = json.loads(Path(args.peer_config).read_text())
        Path(args.peer_result).write_text(json.dumps(run_trl(cfg, cfg["micro_batch"])))
        return
    THREADS["n"] = args.threads
    with work_folder(args.work_dir, "shardfit-dpo-bench-") as work:
        report = run_bench(args, work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    s, t, r = report["shardfit"], report[PEER], report["ratios"]
    print(f"shardfit / TRL: {r['train_speedup']:.2f}x training tokens/s, {r['speedup']:.2f}x whole process, memory "
          f"{r['memory_ratio']:.2f}x; held-out reward accuracy {s['eval_reward_accuracy']:.3f} vs "
          f"{t['eval_reward_accuracy']:.3f}; written to {out}")


if __name__ == "__main__":
    main()
