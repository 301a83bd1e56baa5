"""Count the aten ops the host dispatches for one training micro-batch of a decoder, per recipe.

    python bench/dispatch_ops.py            # prints the table, writes bench/results/dispatch_ops.json

A TorchDispatchMode sees every aten op below autograd, forward, backward and checkpointing's recomputation alike,
which is what eager PyTorch hands to the device one call at a time. Each count is taken on tiny transformers models
of 1 and 2 decoder layers (fp32, CPU, sdpa attention, a padded-free batch of one row); the difference is one
layer's ops, the rest the model's fixed ops (embedding, final norm, head, loss). Views (`aten.view`, `t`,
`transpose`, ...) are counted apart: they cost host time but launch no kernel. The widths do not change the count,
so the tiny model's count is the real model's. plan/dispatch.py (LAYER_OPS) carries the figures this prints.

shardfit's chunked loss (train/loss.py) adds the ops of each chunk after the first: counted on the loss alone over
64 labelled positions in one chunk and in four, head trained (full) and frozen (LoRA), with and without autocast.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "dispatch_ops.json"
# The ops a compiler keeps as their own kernels (inductor calls cuBLAS / the attention kernel for these and fuses
# what lies between them).
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class OpCounter(TorchDispatchMode):
    """Counts aten ops by whether they are views (no kernel) or not."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops["view" if func.is_view else "kernel"] += 1
        name = func.overloadpacket.__name__
        if name in MATMULS or "scaled_dot_product" in name:
            self.ops["matmul"] += 1
        return func(*args, **(kwargs or {}))


def build(arch: str, layers: int, method: str, ckpt: bool, targets: list[str], dropout: float,
          bf16: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=layers, vocab_size=128, max_position_embeddings=256, attn_implementation="sdpa")
    model = LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    if bf16:  # the frozen base in bf16 (as loaded for LoRA); peft keeps the adapters in fp32
        model.to(torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        if ckpt:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, lora_dropout=dropout))
    model.train()
    return model


def count(arch: str, layers: int, method: str, ckpt: bool, targets: list[str], dropout: float,
          bf16: bool) -> Counter[str]:
    """aten ops of one forward + backward (the loss included) of a batch of one 32-token row; `bf16`: a bf16 base
    under autocast, as a 16-bit LoRA run on a GPU (the casts autocast inserts are ops too)."""
    model = build(arch, layers, method, ckpt, targets, dropout, bf16)
    ids = torch.randint(0, 128, (1, 32))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return warm_step_ops(step, model)


def warm_step_ops(step: Callable[[], None], model: torch.nn.Module) -> Counter[str]:
    """aten ops of `step` run once more after a warm-up run (lazy initialisation stays out of the count), the
    gradients of the warm-up dropped in between."""
    step()
    model.zero_grad(set_to_none=True)
    with OpCounter() as c:
        step()
    return c.ops


def per_layer(arch: str, method: str, ckpt: bool, targets: list[str], dropout: float = 0.0,
              bf16: bool = False) -> dict[str, int]:
    """One decoder layer's ops (the 2-layer count minus the 1-layer one) and the model's fixed ops."""
    one, two = (count(arch, n, method, ckpt, targets, dropout, bf16) for n in (1, 2))
    out = {}
    for k in ("kernel", "view", "matmul"):
        out[f"layer_{k}"] = two[k] - one[k]
        out[f"fixed_{k}"] = one[k] - out[f"layer_{k}"]
    return out


def loss_ops(chunks: int, head_trains: bool, bf16: bool) -> Counter[str]:
    """aten ops of shardfit's chunked loss, forward + backward, over 64 labelled positions in `chunks` chunks."""
    from shardfit.train.loss import chunked_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 128, bias=False).requires_grad_(head_trains)
    hidden = torch.randn(1, 64, 64, requires_grad=True)
    targets = torch.randint(0, 128, (1, 64))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = chunked_cross_entropy(hidden, head, targets, chunk=64 // chunks)
        loss.backward()

    step()
    with OpCounter() as c:
        step()
    return c.ops


def per_loss_chunk(head_trains: bool, bf16: bool) -> dict[str, float]:
    """The ops one more chunk of the loss adds (four chunks against one, per extra chunk)."""
    one, four = loss_ops(1, head_trains, bf16), loss_ops(4, head_trains, bf16)
    return {f"chunk_{k}": (four[k] - one[k]) / 3 for k in ("kernel", "view", "matmul")}


# The grid plan/dispatch.py reads: the base's method, checkpointing, autocast; LoRA on all seven linears or on two
# (the difference is the per-target cost), and dropout on the adapters.
RECIPES = {f"{m}{'+ckpt' if c else ''}{'+autocast' if a else ''}": (m.rstrip("27"), c, t, 0.0, a)
           for m, t in (("full", []), ("lora7", ALL_LINEAR), ("lora2", ["q_proj", "v_proj"]))
           for c in (False, True) for a in (False, True)}
RECIPES["lora7+ckpt+dropout"] = ("lora", True, ALL_LINEAR, 0.05, False)
RECIPES["lora7+dropout"] = ("lora", False, ALL_LINEAR, 0.05, False)


def main() -> None:
    torch.set_num_threads(1)
    result = {"torch": torch.__version__, "counts": {}}
    for arch in ("llama", "qwen2"):
        for name, (method, ckpt, targets, dropout, bf16) in RECIPES.items():
            r = per_layer(arch, method, ckpt, targets, dropout, bf16)
            result["counts"][f"{arch}/{name}"] = r
            print(f"{arch:6s} {name:20s} per layer: {r['layer_kernel']:4d} kernels ({r['layer_matmul']:3d} matmuls) + "
                  f"{r['layer_view']:4d} views; fixed: {r['fixed_kernel']:4d} + {r['fixed_view']:4d}", flush=True)
    for head_trains in (True, False):
        for bf16 in (False, True):
            name = f"loss/{'full' if head_trains else 'lora'}{'+autocast' if bf16 else ''}"
            r = per_loss_chunk(head_trains, bf16)
            result["counts"][name] = r
            print(f"{name:27s} per extra chunk: {r['chunk_kernel']:5.1f} kernels ({r['chunk_matmul']:3.1f} matmuls) + "
                  f"{r['chunk_view']:5.1f} views", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
