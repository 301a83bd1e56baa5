"""Where a CPU LoRA step on SmolLM2-135M spends its time: data, matmuls, attention, the loss, the optimizer, and
the Python between the kernels.

    python bench/profile_step.py                  # writes bench/results/profile_step.json
    python bench/profile_step.py --steps 4 --attention sdpa

The demo's data and LoRA (r16, fp32, micro_batch 4, max_seq_len 256, packing), through shardfit's own pipeline
(tokenisation, the per-step packing schedule, collate, the chunked loss), after one warm-up step. Phases are timed
with torch.profiler's record_function; inside forward and backward the kernels' own time is split by op name,
and what the phases took beyond their kernels is the Python and dispatch overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEMO = ROOT / "src" / "shardfit" / "demo"

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_")
ATTENTION = ("scaled_dot_product", "flash_attention", "aten::_softmax", "aten::_softmax_backward_data",
             "aten::_efficient_attention", "aten::masked_fill")


def category(op: str) -> str | None:
    """The kernel category of a profiler op name (None: a wrapper whose time is in its children)."""
    if op in MATMUL:
        return "matmuls"
    if any(k in op for k in ATTENTION):
        return "attention"
    return "other kernels"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention", default="eager", help="attn_implementation (what auto picks on CPU: eager)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="bf16: frozen weights in bf16 and autocast, as `train` runs precision bf16")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile_step.json")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardfit.config import Config, LoraSettings
    from shardfit.data.dataset import encode_split, read_split
    from shardfit.data.loader import BatchSchedule, collate
    from shardfit.data.packing import pack
    from shardfit.models.anatomy import decoder_and_head
    from shardfit.models.build import build_model, load_tokenizer
    from shardfit.models.source import resolve_model
    from shardfit.train.loss import chunked_cross_entropy
    from shardfit.train.optim import build_optimizer

    torch.manual_seed(0)
    cfg = Config(model="HuggingFaceTB/SmolLM2-135M-Instruct", data=str(DEMO / "train.jsonl"), method="lora",
                 precision=args.precision, max_seq_len=256, micro_batch=4, lora=LoraSettings(rank=16, alpha=32),
                 attn_implementation=args.attention)
    tok = load_tokenizer(resolve_model(cfg.model))
    train_ex, _ = encode_split(cfg, tok, read_split(cfg))
    schedule = BatchSchedule(train_ex, cfg.micro_batch, 1, 1, 0, cfg.seed,
                             functools.partial(pack, max_len=cfg.max_seq_len))
    model = build_model(cfg, "single", weights=True)
    decoder, head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, 1e-4, 0.0)

    amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()

    def step(k: int) -> int:
        with record_function("phase: data"):
            rows = schedule.step(k)
            batch = collate(rows.micro_batches[0], tok.pad_token_id)
        with record_function("phase: forward"), amp:
            hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)[0]
        with record_function("phase: loss"), amp:
            loss, n = chunked_cross_entropy(hidden, head, batch.targets)
        with record_function("phase: backward"):
            (loss / n).backward()
        with record_function("phase: optimizer"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return batch.n_real_tokens

    step(0)  # warm-up: first-call allocations and lazy initialisation
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = sum(step(k) for k in range(1, args.steps + 1))
    wall = time.perf_counter() - t0

    phases: dict[str, float] = {}
    kernels: dict[str, float] = {"matmuls": 0.0, "attention": 0.0, "other kernels": 0.0}
    for evt in prof.key_averages():
        if evt.key.startswith("phase: "):
            phases[evt.key[7:]] = evt.cpu_time_total / 1e6
    # Kernel time inside forward and backward by category (self time, so nothing counts twice). Backward ops run
    # on autograd's thread outside the record_function range, so all non-phase events are attributed by name.
    in_phase = {"phase: data", "phase: optimizer", "phase: loss"}
    for evt in prof.events():
        parent, owner = evt.cpu_parent, None
        while parent is not None:
            if parent.name.startswith("phase: "):
                owner = parent.name
            parent = parent.cpu_parent
        if owner in in_phase or evt.name.startswith("phase: "):
            continue
        cat = category(evt.name)
        if cat is not None:
            kernels[cat] += evt.self_cpu_time_total / 1e6
    fwd_bwd = phases.get("forward", 0.0) + phases.get("backward", 0.0)
    table = {
        "data (schedule, packing, collate)": phases.get("data", 0.0),
        "matmuls (forward + backward)": kernels["matmuls"],
        "attention (forward + backward)": kernels["attention"],
        "other kernels (norms, activations, RoPE, copies)": kernels["other kernels"],
        "Python and dispatch overhead (forward + backward)": max(0.0, fwd_bwd - sum(kernels.values())),
        "loss (chunked output head + cross-entropy, its gradient included)": phases.get("loss", 0.0),
        "optimizer (clip + AdamW + zero_grad)": phases.get("optimizer", 0.0),
    }
    total = sum(table.values())
    share = {k: round(100 * v / total, 1) for k, v in table.items()}
    out = {"machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "load_avg_1m_at_end": os.getloadavg()[0],
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "attention": args.attention, "precision": args.precision, "steps": args.steps,
           "tokens_per_step": tokens / args.steps,
           "wall_s_per_step": round(wall / args.steps, 3), "seconds": {k: round(v, 3) for k, v in table.items()},
           "percent": share, "top_ops": [(e.key, round(e.self_cpu_time_total / 1e6, 3)) for e in sorted(
               prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for k, v in share.items():
        print(f"{v:5.1f} %  {k}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
