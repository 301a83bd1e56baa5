"""The ten-minute GPU check: every method trains, memory against the plan, speed against the Trainer, one profile.

    python bench/gpu.py check --out bench/results/gpu_check.json          # on a machine with one CUDA GPU
    python bench/gpu.py check --tiny --out /tmp/gpu_check.json            # the same steps with tiny models (CPU)

Offline, from the repo alone: the tokenizer comes from the bundled SmolLM2 package (`bench/gpu.py export`), every
model is built from a config written here with random weights (seed 0), the data from the demo notes and generated
images. Each run is `python -m shardfit train CONFIG` in its own process, as a user runs it:

    methods   lora, qlora and full on Qwen2.5-0.5B's architecture, and a LoRA on a tiny Qwen2-VL with images, a few
              steps each: the losses are finite and the adapter or model folder was written; the full run profiles
              one step (profile_steps: 1) and the JSON keeps the top of its op table
    memory    each run's peak allocated GPU memory against the plan the run itself made (plan.json, the same
              planner as `shardfit plan`), for the strategy it ran, total and the plan's categories
    speed     tokens/s of the training loop, shardfit's defaults against the HF Trainer (bf16, SDPA) on the same
              token ids, full and LoRA on Qwen2.5-0.5B at rows of about 2048 tokens, with MFU from the card's peak

The JSON is written after every run (a check stopped half-way keeps what it measured) and names the card. On a
machine without CUDA the check stops at once, unless `--tiny` asks for the rehearsal: tiny models, short rows, the
same steps on whatever device there is, in well under a minute of training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compare  # noqa: E402 - bench/ is not a package; its path is set above
from proc import run_measured  # noqa: E402
from workloads import DEMO, Workload, user_config  # noqa: E402

# Qwen2.5-0.5B's architecture (its config.json), built with random weights: the full fine-tune model.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY_TEXT = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


@dataclass(frozen=True)
class Scale:
    """How big the check runs: the GPU's sizes, or the rehearsal's (`tiny`)."""

    text: dict[str, Any]
    method_seq: int = 512
    method_steps: int = 4
    speed_seq: int = 2048
    speed_micro_batch: int = 4
    speed_steps: int = 12
    run_timeout_s: float = 240.0


GPU = Scale(QWEN25_05B)
TINY = Scale(TINY_TEXT, method_seq=256, method_steps=3, speed_seq=256, speed_micro_batch=2, speed_steps=3,
             run_timeout_s=300.0)
METHODS = {"lora": {"method": "lora", "lora": {"rank": 16, "alpha": 32}},
           "qlora": {"method": "qlora", "lora": {"rank": 16, "alpha": 32}},
           "full": {"method": "full", "profile_steps": 1}}


def text_model(out: Path, assets: Path, arch: dict[str, Any]) -> Path:
    """A Qwen2 model of `arch` with random weights (seed 0), bf16 safetensors, and the exported tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = Qwen2Config(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets).save_pretrained(out)
    return out


def vl_model(out: Path, assets: Path) -> Path:
    """A tiny Qwen2-VL with random weights and a small-image processor (tests/helpers.py builds the same one)."""
    from tests.helpers import make_tiny_vl

    return out if (out / "config.json").is_file() else make_tiny_vl(out, assets)


def note_rows(n: int) -> list[dict[str, Any]]:
    """The first `n` demo notes (alpaca rows)."""
    return [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()[:n]]


def long_rows(n: int, tokens: int, tokenizer: Any) -> list[dict[str, Any]]:
    """`n` alpaca rows of about `tokens` tokens each: demo notes put together until the row is nearly full."""
    rng = random.Random(0)
    notes = note_rows(10**6)
    rows = []
    for _ in range(n):
        inputs, outputs, size = [], [], 32
        while True:
            note = rng.choice(notes)
            cost = len(tokenizer(note["input"] + note["output"])["input_ids"]) + 4
            if size + cost > tokens * 0.95:
                break
            inputs.append(note["input"])
            outputs.append(note["output"])
            size += cost
        rows.append({"instruction": "Extract every contact record from these notes, one per line.",
                     "input": "\n".join(inputs), "output": "\n".join(outputs)})
    return rows


def image_rows(folder: Path, n: int) -> list[dict[str, Any]]:
    """`n` rows asking the colour of a generated 56x56 image."""
    from PIL import Image

    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = list(colours)[i % len(colours)]
        Image.new("RGB", (56, 56), colours[name]).save(folder / "img" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                  {"role": "assistant", "content": name}], "images": [f"img/{i}.png"]})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shardfit_run(name: str, cfg: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """`python -m shardfit train` on `cfg`; what the check reads from its run directory (module doc)."""
    import torch

    run_dir = Path(cfg["output_dir"])
    path = work / f"{name}-config.json"
    path.write_text(json.dumps(cfg))  # JSON is YAML: the config loader reads it as the user's file
    m = run_measured([sys.executable, "-m", "shardfit", "train", str(path)], compare._env(1), timeout_s)
    record: dict[str, Any] = {"exit": m.returncode, "wall_s": round(m.wall_s, 1)}
    if m.returncode != 0 or not (run_dir / "summary.json").is_file():
        return {**record, "ok": False, "error": m.output_tail[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    logged = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    losses = [r["loss"] for r in logged]
    # The run's tokens/s counts its first steps, which pay the card's one-time costs (kernel choice, allocator
    # growth); the median of the later windows is the rate a long run settles at.
    later = [r["tokens_per_s"] for r in logged if r["step"] > 2]
    saved = run_dir / ("adapter" if cfg["method"] in ("lora", "qlora") else "model")
    weights = sorted(p.name for p in saved.glob("*.safetensors"))
    record.update(ok=bool(losses) and all(math.isfinite(x) for x in losses) and bool(weights), losses=losses,
                  saved=str(saved), weight_files=weights, steps=summary["steps"],
                  tokens_per_s=summary["tokens_per_s"],
                  # every step, the first too, as the Trainer's train_tokens_per_s counts: the ratio's numerator
                  train_tokens_per_s=round(summary["tokens"] / summary["train_s"], 1) if summary["train_s"] else None,
                  steady_tokens_per_s=round(statistics.median(later), 1) if later else None,
                  predicted_tokens_per_s=summary["predicted_tokens_per_s"],
                  strategy=summary["strategy"], memory=memory_against_plan(run_dir, summary, torch.cuda.is_available()),
                  resolved={**{k: resolved.get(k) for k in ("precision", "attn_implementation", "compile", "packing")},
                            "static_shape": summary["resolved"].get("static_shape"),
                            "cudnn_attention": summary.get("cudnn_attention")})
    profile = run_dir / "profile" / "ops-rank0.txt"
    if profile.is_file():
        record["profile"] = {"ops_table_top": profile.read_text().splitlines()[:30],
                             "trace": str(run_dir / "profile" / "trace-rank0.json")}
    return record


def head_gradient_16bit() -> bool | None:
    """Whether this device computes a trained head's gradient from 16-bit operands into fp32 (train/loss.py
    `widening_matmul`), None without a GPU."""
    import torch

    from shardfit.train.loss import widening_matmul

    return widening_matmul(torch.device("cuda")) if torch.cuda.is_available() else None


def memory_against_plan(run_dir: Path, summary: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The run's peak memory against its plan's for the strategy it ran, total and the plan's categories: on a GPU
    allocated memory, against the plan without its runtime overhead (the CUDA context, which allocated memory does
    not count); on a CPU the resident set, against the whole plan."""
    measured = max(summary["peak_mem_gib"])
    plan_path = run_dir / "plan.json"
    if not plan_path.is_file():
        return {"measured_gib": round(measured, 3), "planned": None}
    plan = json.loads(plan_path.read_text())
    cand = next((c for c in plan["candidates"] if c["strategy"] == summary["strategy"]), None)
    if cand is None:
        return {"measured_gib": round(measured, 3), "planned": None}
    parts = cand["per_gpu_gib"]
    allocated = parts["total"] - (parts.get("runtime_overhead", 0.0) + parts.get("allocator_reserve", 0.0)
                                  if gpu else 0.0)
    return {"measured_gib": round(measured, 3), "planned_gib": round(allocated, 3),
            "measured_over_planned": round(measured / allocated, 3) if allocated else None,
            "planned_parts_gib": parts, "peak_phase": cand.get("peak_phase")}


def trainer_run(name: str, cfg: dict[str, Any], work: Path, method: str) -> dict[str, Any]:
    """The HF Trainer (bench/peers.py hf_trainer, bf16 autocast, SDPA) on the same config and token ids."""
    w = Workload(name, "given", method, "given", 0, cfg["max_seq_len"], cfg["micro_batch"], cfg["lr"],
                 ("hf_trainer",), precision="bf16")
    rec = compare.run_peer(w, "hf_trainer", "same_precision", dict(cfg, precision="bf16"), work / f"{name}-cfg",
                           cfg["micro_batch"])
    keep = ("failed", "train_tokens_per_s", "peak_mem_gib", "steps", "train_s", "wall_s", "precision")
    return {k: rec[k] for k in keep if k in rec}


def base_config(model: Path, data: Path, out: Path, seq: int, micro_batch: int, steps: int) -> dict[str, Any]:
    """A user's config for one run of the check (bench/workloads.py `user_config`, a few steps, no saves)."""
    w = Workload(out.name, "given", "lora", "given", 0, seq, micro_batch, 1e-4, ())
    cfg = user_config(w, {"model": str(model), "train": str(data)}, str(out))
    cfg.pop("epochs")
    cfg.pop("lora", None)
    return dict(cfg, max_steps=steps, save_steps=10**6, eval_steps=10**6, report_to=["none"])


def card() -> dict[str, Any]:
    """The device the check ran on, in words, its bf16 peak, and whether a trained head's gradient runs from
    16-bit operands (None without a GPU)."""
    import torch

    cuda = torch.cuda.is_available()
    return {"machine": compare.machine_name(), "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "torch": torch.__version__, "bf16_peak_flops": compare.gpu_peak_flops(),
            "head_gradient_16bit": head_gradient_16bit()}


PIECES = (*METHODS, "vl_lora", "speed-full", "speed-lora")
# Runs outside the ten minutes, named with --only: the full fine-tune again with one input shape per run (every
# micro-batch one row of micro_batch x seq tokens, flex attention's block mask, compiled blocks).
# `speed-float8`: the same full fine-tune with FP8 matmuls (`float8: true`, torchao; an sm_89+ card), whose ratio to
# `speed-full` is what the time model predicts (plan/timing.py); run them together: --only speed-full speed-float8.
EXTRA = {"speed-static": ("full", {"static_shape": True, "attn_implementation": "flex_attention", "compile": True}),
         "speed-float8": ("full", {"float8": True})}


def check(out: Path, work: Path, assets: Path, scale: Scale, only: tuple[str, ...] = PIECES) -> dict[str, Any]:
    """The check's runs at `scale` (module doc; `only`: some of PIECES); the JSON at `out` rewritten after each
    run."""
    from transformers import AutoTokenizer

    tiny = scale.text is TINY_TEXT
    t0 = time.perf_counter()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "tiny": tiny, **card(), "methods": {},
                              "speed": {}}

    def save() -> None:
        report["check_s"] = round(time.perf_counter() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    text = text_model(work / "qwen2", assets, scale.text)
    tok = AutoTokenizer.from_pretrained(assets)
    notes = write_jsonl(work / "data" / "notes.jsonl", note_rows(64))
    for name, over in ((n, o) for n, o in METHODS.items() if n in only):
        cfg = dict(base_config(text, notes, work / name, scale.method_seq, 4, scale.method_steps), log_steps=1,
                   **over)
        report["methods"][name] = shardfit_run(name, cfg, work, scale.run_timeout_s)
        save()
    if "vl_lora" in only:
        vl = vl_model(work / "vl", assets)
        images = write_jsonl(work / "vl-data" / "train.jsonl", image_rows(work / "vl-data", 16))
        cfg = dict(base_config(vl, images, work / "vl_lora", 128, 4, scale.method_steps), method="lora",
                   lora={"rank": 8, "alpha": 16}, log_steps=1)
        report["methods"]["vl_lora"] = shardfit_run("vl_lora", cfg, work, scale.run_timeout_s)
        save()
    rows = scale.speed_micro_batch * scale.speed_steps
    long = write_jsonl(work / "data" / "long.jsonl", long_rows(rows, scale.speed_seq, tok))
    for method in ("full", "lora"):
        if f"speed-{method}" in only:
            report["speed"][method] = speed(method, text, long, work, scale)
            save()
    for piece, (method, over) in EXTRA.items():
        if piece in only:
            report["speed"][piece.removeprefix("speed-")] = speed(method, text, long, work, scale, over, piece)
            save()
    fp8, bf16 = (report["speed"].get(k, {}).get("shardfit", {}) for k in ("float8", "full"))
    if fp8.get("ok") and bf16.get("ok"):
        report["float8_over_bf16"] = {
            "measured": round(fp8["train_tokens_per_s"] / bf16["train_tokens_per_s"], 3),
            "predicted": round(fp8["predicted_tokens_per_s"] / bf16["predicted_tokens_per_s"], 3)
            if fp8.get("predicted_tokens_per_s") and bf16.get("predicted_tokens_per_s") else None}
    save()
    return report


def speed(method: str, model: Path, data: Path, work: Path, scale: Scale, over: dict[str, Any] | None = None,
          name: str | None = None) -> dict[str, Any]:
    """shardfit's defaults (and `over`, settings beside them) against the Trainer on one epoch of the long rows:
    tokens/s, peak memory, MFU."""
    name = name or f"speed-{method}"
    cfg = base_config(model, data, work / name, scale.speed_seq, scale.speed_micro_batch, scale.speed_steps)
    cfg = dict(cfg, method=method, log_steps=1, **({"lora": {"rank": 16, "alpha": 32}} if method == "lora" else {}),
               **(over or {}))
    ours = shardfit_run(name, cfg, work, scale.run_timeout_s)
    peer_cfg = {k: v for k, v in cfg.items() if k not in (over or {})}
    peer_cfg = dict(peer_cfg, output_dir=str(work / f"{name}-trainer"), epochs=1)
    peer_cfg.pop("max_steps")
    theirs = trainer_run(f"{name}-trainer", peer_cfg, work, method)
    result: dict[str, Any] = {"shardfit": ours, "hf_trainer_bf16": theirs}
    if ours.get("ok") and "train_tokens_per_s" in theirs:
        result["speedup"] = round(ours["train_tokens_per_s"] / theirs["train_tokens_per_s"], 3)
        result["memory_ratio"] = round(ours["memory"]["measured_gib"] / theirs["peak_mem_gib"], 3)
        peak = compare.gpu_peak_flops()
        if peak:
            per_token = compare.model_flops_per_token(cfg)
            result["mfu"] = {"shardfit": round(ours["train_tokens_per_s"] * per_token / peak, 4),
                             "shardfit_steady": round((ours["steady_tokens_per_s"] or 0) * per_token / peak, 4),
                             "hf_trainer_bf16": round(theirs["train_tokens_per_s"] * per_token / peak, 4)}
    return result


def main(argv: list[str] | None = None) -> int:
    """`bench/gpu.py check`: the exit status is 0 when every run trained and wrote its outputs."""
    import argparse

    p = argparse.ArgumentParser(prog="bench/gpu.py check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=compare.RESULTS / "gpu_check.json", help="the JSON written")
    p.add_argument("--tiny", action="store_true", help="the rehearsal: tiny models and rows, on any device")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfit-gpu-check"),
                   help="models, data and runs (kept; a later check reuses the models)")
    p.add_argument("--speed-steps", type=int, default=None, metavar="N",
                   help="optimizer steps of each speed run (default 12 on a GPU): more steps, a steadier rate")
    p.add_argument("--only", nargs="+", choices=(*PIECES, *EXTRA), default=list(PIECES), metavar="RUN",
                   help=f"some of the runs: {', '.join(PIECES)}; or beside them {', '.join(EXTRA)}")
    args = p.parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(f"bench/gpu.py check: no CUDA GPU here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}); the check measures a GPU. `--tiny` rehearses its steps on this "
              "machine.", file=sys.stderr)
        return 1
    from gpu import export

    assets = args.work_dir / "assets"
    if not (assets / "tokenizer_config.json").is_file():
        export(assets)
    scale = TINY if args.tiny else GPU
    if args.speed_steps:
        scale = dataclasses.replace(scale, speed_steps=args.speed_steps)
    report = check(args.out, args.work_dir, assets, scale, tuple(args.only))
    runs = {**report["methods"], **{f"speed-{k}": v["shardfit"] for k, v in report["speed"].items()}}
    failed = [name for name, r in runs.items() if not r.get("ok")]
    print(f"bench/gpu.py check: {len(runs) - len(failed)} of {len(runs)} runs trained on {report['gpu'] or 'the CPU'}"
          f" in {report['check_s']:.0f} s; {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
