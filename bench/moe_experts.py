"""Time transformers' implementations of the fused experts (eager, batched_mm, grouped_mm) on this machine.

    python bench/moe_experts.py                 # writes bench/results/moe_experts.json
    python bench/moe_experts.py --dtype bf16    # the same in bf16 (another file: moe_experts_bf16.json)

transformers 5 runs every mixture family's routed experts through one of these (`config._experts_implementation`):
`eager` loops over the experts a batch reaches, `batched_mm` gathers each token's expert weights and runs one
batched matmul (a copy of the weights per routed token), `grouped_mm` sorts the tokens by expert and runs one grouped
matmul (torch's own kernel on a GPU of compute capability 8 or more, and on a CPU with torch > 2.8).
models/experts.py's `EXPERTS_BY_DEVICE` reads what this measures.

Each case is a tiny-but-not-trivial model of two decoder blocks (a Qwen3-MoE and a gpt-oss layout) trained one
step, forward and backward with the loss, full fine-tune and LoRA as shardfit sets it up (peft `target_parameters`
on the fused expert weights, all-linear less the routers). The same model switches implementation between runs, so
the weights are the same; the implementations run interleaved (one step each per round) so that load from other
work on a shared machine falls on all of them alike. The loss and every trainable gradient of each implementation
are compared with eager's. batched_mm is skipped where the weight copies it gathers would pass MAX_GATHER_GIB.
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

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.config.schema import LoraSettings  # noqa: E402
from shardfit.models.adapters import apply_lora  # noqa: E402

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
# batched_mm copies the up and down weights of each (token, expert) pair and keeps a gradient of the same size:
# past this, the copies alone fill a small machine.
MAX_GATHER_GIB = 3.0
COMMON = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              vocab_size=512, max_position_embeddings=4096)
FAMILIES = {
    # Qwen3-30B-A3B's layout (128 experts, top-8) at a quarter of the experts.
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=32, num_experts_per_tok=8, moe_intermediate_size=192,
                      intermediate_size=512, router_aux_loss_coef=0.001),
    # gpt-oss-20b's layout (32 experts, top-4, biases, transposed fused weights).
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=32, num_experts_per_tok=4, intermediate_size=256,
                    sliding_window=128, router_aux_loss_coef=0.001),
}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "avx512": " avx512f" in flags, "amx_bf16": " amx_bf16" in flags,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "torch": torch.__version__, "load_avg_1m_at_start": os.getloadavg()[0],
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def build(family: str, method: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model to train, the transformers model whose experts implementation is switched)."""
    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **COMMON, **spec)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if method == "full":
        return base.train(), base
    model = apply_lora(base, LoraSettings(rank=16))
    return model.train(), base


def gather_gib(family: str, tokens: int, dtype: torch.dtype) -> float:
    """What batched_mm's weight copies (and their gradient) take for one block."""
    spec, h = FAMILIES[family], COMMON["hidden_size"]
    width = spec.get("moe_intermediate_size") or spec["intermediate_size"]
    pairs = tokens * spec["num_experts_per_tok"]
    return 2 * pairs * 3 * width * h * torch.finfo(dtype).bits / 8 / 2**30


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """One forward and backward: (seconds, loss, every trainable gradient flattened)."""
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    sync()
    dt = time.perf_counter() - t0
    grads = torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])
    return dt, float(loss.detach()), grads


def case(family: str, method: str, seq: int, dtype: torch.dtype, device: str, rounds: int) -> dict:
    model, base = build(family, method, dtype, device)
    impls = [i for i in IMPLEMENTATIONS if i != "batched_mm" or gather_gib(family, seq, dtype) <= MAX_GATHER_GIB]
    torch.manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (1, seq), device=device)
    times: dict[str, list[float]] = {i: [] for i in impls}
    first: dict[str, tuple[float, torch.Tensor]] = {}
    for r in range(rounds + 1):  # round 0 warms up (allocator, kernels) and gives the values compared
        for impl in impls:
            base.set_experts_implementation(impl)
            dt, loss, grads = step(model, ids)
            if r == 0:
                first[impl] = (loss, grads)
            else:
                times[impl].append(dt)
    ref_loss, ref_grads = first["eager"]
    scale = float(ref_grads.abs().max())
    out = {"family": family, "method": method, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
           "skipped": {"batched_mm": f"gathers {gather_gib(family, seq, dtype):.1f} GiB of weight copies"}
           if "batched_mm" not in impls else {}, "results": {}}
    for impl in impls:
        loss, grads = first[impl]
        out["results"][impl] = {
            "median_s": round(statistics.median(times[impl]), 4), "min_s": round(min(times[impl]), 4),
            "loss_diff": abs(loss - ref_loss), "grad_max_rel_diff": float((grads - ref_grads).abs().max()) / scale}
    fastest = min(impls, key=lambda i: out["results"][i]["median_s"])
    out["fastest"] = fastest
    out["eager_over_grouped"] = round(out["results"]["eager"]["median_s"] / out["results"]["grouped_mm"]["median_s"],
                                      3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or ROOT / "bench" / "results" / ("moe_experts.json" if args.dtype == "fp32" and device == "cpu"
                                                    else f"moe_experts_{device}_{args.dtype}.json")
    report = {"machine": machine(), "device": device, "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
              "max_gather_gib": MAX_GATHER_GIB, "config": COMMON, "families": FAMILIES, "cases": []}
    for family in FAMILIES:
        for method in ("lora", "full"):
            for seq in args.seq:
                c = case(family, method, seq, dtype, device, args.rounds)
                report["cases"].append(c)
                line = ", ".join(f"{k} {v['median_s']:.3f} s (grad diff {v['grad_max_rel_diff']:.1e})"
                                 for k, v in c["results"].items())
                print(f"{family} {method} seq {seq}: {line}; fastest {c['fastest']}", flush=True)
                out.write_text(json.dumps(report, indent=2) + "\n")  # a partial file if a later case dies
    report["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
