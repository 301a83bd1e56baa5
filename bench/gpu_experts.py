"""One mixture block's routed experts with fp32 stacks against 16-bit ones, timed: the planner's fp32-experts term.

    python bench/gpu_experts.py --out bench/results/gpu_experts.json   # on a CUDA GPU (about a minute)
    python bench/gpu_experts.py --tiny --out /tmp/gpu_experts.json     # the rehearsal: small widths, any device

A bitsandbytes QLoRA of a mixture under transformers 5 leaves the fused expert stacks unquantized, and peft's
prepare_model_for_kbit_training upcasts them to fp32; transformers' grouped experts then multiply in the weights'
dtype, which bf16 autocast does not change (`_grouped_mm` has no autocast kernel), so torch takes its fallback: an
fp32 mm per expert. The planner charges that at the card's fp32 rate (plan/flops.py `fp32_experts_s`), 5-15 times
the bf16 time on an H100, unmeasured when it was written. This times Qwen3-30B-A3B's MoE block (its config's
widths, one layer, random weights) forward and backward under bf16 autocast, the stacks and router in bf16 and then
in fp32 (as peft leaves them), with and without TF32, and writes the ratios beside the card's rate ratios the
planner uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

# Qwen3-30B-A3B's MoE block (its config.json); the rehearsal's is a small one of the same build.
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def moe_block(widths: dict[str, int]) -> Any:
    """The MoE block of a one-layer Qwen3-MoE built from its config (random weights, seed 0): built through the
    model so that transformers picks its default experts implementation, as a loaded model gets."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, intermediate_size=4 * widths["hidden_size"], num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, **widths)
    return Qwen3MoeForCausalLM(cfg).model.layers[0].mlp


def time_block(block: Any, tokens: int, hidden: int, device: str, steps: int) -> float:
    """Median seconds of one forward and backward of `block` over `tokens` rows under bf16 autocast; the input
    needs its gradient (the stacks are frozen: only their input gradient is computed, as in QLoRA)."""
    import torch

    for p in block.parameters():
        p.requires_grad_(False)
    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    times = []
    for i in range(steps + 2):  # two warm-up steps
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        x.grad = None
    return statistics.median(times)


def measure(widths: dict[str, int], tokens: int, steps: int, device: str) -> dict[str, Any]:
    """The block's step in bf16 stacks, fp32 stacks (TF32 off, torch's default and the HF Trainer's) and fp32
    stacks with TF32 on; the ratios to bf16."""
    import torch

    block = moe_block(widths).to(device)
    out: dict[str, Any] = {"widths": widths, "tokens": tokens, "steps": steps}
    out["bf16_s"] = time_block(block.to(torch.bfloat16), tokens, widths["hidden_size"], device, steps)
    block = block.to(torch.float32)  # peft's upcast of every non-4-bit weight
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        out["fp32_s"] = time_block(block, tokens, widths["hidden_size"], device, steps)
        torch.backends.cuda.matmul.allow_tf32 = True
        out["fp32_tf32_s"] = time_block(block, tokens, widths["hidden_size"], device, steps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out["fp32_over_bf16"] = round(out["fp32_s"] / out["bf16_s"], 2)
    out["fp32_tf32_over_bf16"] = round(out["fp32_tf32_s"] / out["bf16_s"], 2)
    return out


def card_ratios() -> dict[str, Any]:
    """The card's name and the rate ratios the planner uses for it (plan/cards.yaml): bf16 over fp32 and over TF32."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    from shardfit.plan.cards import card_of
    from shardfit.plan.hardware import parse_gpus

    name = torch.cuda.get_device_name(0)  # "NVIDIA H100 80GB HBM3": the model word is what --gpus takes
    try:
        card = card_of(parse_gpus(f"1x{name.removeprefix('NVIDIA ').split()[0]}", 1, None))
    except Exception as e:  # noqa: BLE001 - a card the table lacks: the timing still stands on its own
        return {"gpu": name, "plan_card": None, "why": str(e)}
    return {"gpu": name, "plan_card": card.key,
            "plan_bf16_over_fp32": round(card.dense_flops("bf16") / card.dense_flops("fp32"), 2),
            "plan_bf16_over_tf32": round(card.dense_flops("bf16") / card.fp32_matmul_flops(True), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    p.add_argument("--tiny", action="store_true", help="the rehearsal: small widths, any device")
    p.add_argument("--tokens", type=int, default=None, help="rows of the block's input (default 8192; tiny 64)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("bench/gpu_experts.py: no CUDA GPU here; `--tiny` rehearses on this machine.", file=sys.stderr)
        return 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    widths = TINY if args.tiny else QWEN3_30B_A3B
    tokens = args.tokens or (64 if args.tiny else 8192)
    report = {"date": time.strftime("%Y-%m-%d"), "tiny": args.tiny, "torch": torch.__version__, **card_ratios(),
              **measure(widths, tokens, args.steps, device)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"bench/gpu_experts.py: fp32 stacks {report['fp32_over_bf16']}x the bf16 step "
          f"({report['fp32_tf32_over_bf16']}x with TF32) on {report['gpu'] or 'the CPU'}; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
