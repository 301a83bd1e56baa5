"""bf16 adapters without autocast (`lora.dtype: bf16`) against fp32 adapters under autocast (the default).

    python bench/bf16_adapters.py            # prints both, writes bench/results/bf16_adapters.json

(a) The aten ops the host dispatches for one training micro-batch, per decoder layer: shardfit's own pieces (its
    LoRA setup, the input-cast skip it applies under autocast, its chunked loss) over tiny bf16 Llama bases of 1 and
    2 layers, LoRA on all seven linears, counted below autograd by bench/dispatch_ops.py's counter (forward, backward
    and the loss). The widths do not change the count, so a layer's count is SmolLM2's or Llama-3.1-8B's.
(b) The loss over 30 steps of the demo data (bf16, a tiny random Llama of the SmolLM2 tokenizer's vocabulary: bf16
    matmuls run ~45x slower than fp32 on the development machine's CPU, which has no bf16 units, so SmolLM2-135M
    itself would take hours), for fp32 and bf16 adapters from the same seed, and the fp32 adapters from a second
    seed: the run-to-run noise the difference is measured against.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.dispatch_ops import warm_step_ops
from shardfit.config import LoraSettings
from shardfit.models.adapters import apply_lora, skip_adapter_input_casts
from shardfit.train.loss import CausalLMLoss

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "bf16_adapters.json"
DEMO = ROOT / "src" / "shardfit" / "demo"


def step_ops(layers: int, adapter_dtype: str) -> Counter[str]:
    """aten ops of one forward + backward of shardfit's loss module over a bf16 base with LoRA on all linears:
    fp32 adapters under autocast (their inputs' casts skipped, as the recipe does) or bf16 adapters without it."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=128, max_position_embeddings=256,
                         attn_implementation="sdpa")
    model = apply_lora(LlamaForCausalLM(config).to(torch.bfloat16),
                       LoraSettings(rank=8, targets="all-linear", dtype=adapter_dtype))
    autocast = adapter_dtype == "fp32"
    if autocast:
        skip_adapter_input_casts(model)
    loss = CausalLMLoss(model).train()
    ids = torch.randint(0, 128, (1, 32))
    positions = torch.arange(32).unsqueeze(0)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total, _ = loss(ids, positions, ids, n_targets=32, restarts=False)
        total.backward()

    return warm_step_ops(step, model)


def per_layer(adapter_dtype: str) -> dict[str, int]:
    """One decoder layer's ops (2 layers minus 1) and the rest of the micro-batch's (embedding, head, loss)."""
    one, two = step_ops(1, adapter_dtype), step_ops(2, adapter_dtype)
    out = {}
    for k in ("kernel", "view", "matmul"):
        out[f"layer_{k}"] = two[k] - one[k]
        out[f"fixed_{k}"] = one[k] - out[f"layer_{k}"]
    return out


def losses(tmp: Path, adapter_dtype: str, seed: int, steps: int = 30) -> list[float]:
    """The training loss of each of `steps` steps of the demo data through `shardfit.train`, in bf16."""
    from shardfit.config import load_config
    from shardfit.parallel.env import init_distributed
    from shardfit.train.recipe import train
    from tests.helpers import make_tiny_model, read_jsonl, write_config

    model = tmp / "tiny"
    if not model.exists():
        from shardfit.models.build import load_tokenizer
        from shardfit.models.source import resolve_model
        load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")).save_pretrained(tmp / "tok")
        make_tiny_model(model, tmp / "tok", "llama")
    run = tmp / f"run-{adapter_dtype}-{seed}"
    cfg = write_config(tmp / f"{run.name}.yaml", model=str(model), data=str(DEMO / "train.jsonl"), method="lora",
                       precision="bf16", strategy="single", lora={"rank": 16, "alpha": 32, "dtype": adapter_dtype},
                       max_seq_len=128, max_bad_rows=0.5, micro_batch=2, lr=1e-2, warmup_ratio=0.0,
                       max_steps=steps, log_steps=1, save_steps=1000, eval_steps=1000, seed=seed,
                       output_dir=str(run), resume="never", report_to=["none"])
    train(load_config(cfg), init_distributed(), quiet=True)
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


def main() -> None:
    torch.set_num_threads(1)
    result: dict = {"torch": torch.__version__, "ops_per_layer": {}, "losses": {}}
    for dtype in ("fp32", "bf16"):
        r = per_layer(dtype)
        result["ops_per_layer"][dtype] = r
        print(f"{dtype} adapters{' (autocast)' if dtype == 'fp32' else ''}: per layer {r['layer_kernel']} kernels "
              f"({r['layer_matmul']} matmuls) + {r['layer_view']} views; fixed {r['fixed_kernel']} + "
              f"{r['fixed_view']}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        for name, dtype, seed in (("fp32", "fp32", 42), ("bf16", "bf16", 42), ("fp32_seed43", "fp32", 43)):
            result["losses"][name] = losses(Path(d), dtype, seed)
            print(name, " ".join(f"{x:.3f}" for x in result["losses"][name]), flush=True)
    L = result["losses"]
    gap = [abs(a - b) for a, b in zip(L["fp32"], L["bf16"], strict=True)]
    noise = [abs(a - b) for a, b in zip(L["fp32"], L["fp32_seed43"], strict=True)]
    result["summary"] = {"max_abs_gap_bf16_vs_fp32": max(gap), "mean_abs_gap_bf16_vs_fp32": sum(gap) / len(gap),
                         "max_abs_gap_seed43_vs_42": max(noise), "mean_abs_gap_seed43_vs_42": sum(noise) / len(noise)}
    print(json.dumps(result["summary"], indent=1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
