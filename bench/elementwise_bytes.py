"""Count the bytes the non-matmul kernels of one training micro-batch move, per token and decoder layer, eager vs
compiled (torch.compile, inductor), per recipe.

    python bench/elementwise_bytes.py       # prints the table, writes bench/results/elementwise_bytes.json

Eager PyTorch runs every elementwise op (RMSNorm's pow/mean/rsqrt/mul, rotary's mul/cat/neg/add, SiLU * up, the
residual adds, casts, and each one's backward) as its own kernel that reads its inputs from GPU memory and writes
its output back. Inductor fuses the ops between two matmuls into one kernel that reads each input once and writes
each output once. What a compiled step saves is the difference in bytes, at the card's memory bandwidth.

- eager: a TorchDispatchMode sums the bytes of every tensor input and output of each aten op below autograd
  (forward, backward, checkpointing's recomputation) that launches an elementwise/reduction kernel: neither a
  matmul, nor the attention kernel (both are counted as FLOPs by plan/flops.py), nor a view, nor an allocation
  that touches no memory (`empty*`).
- compiled: inductor's own count (`graph.count_bytes()`, logged with `inductor_metrics`) of every scheduler node
  of the forward and backward graphs (AOT autograd), leaving out its extern kernels (the matmuls and attention it
  calls rather than generates), so both sides count the same thing.

Both are taken on transformers' Llama (and Qwen2, as a check) in bf16 (the base and, for LoRA, peft's adapters:
what a bf16 GPU run holds), sdpa attention, on the CPU (inductor's C++ backend fuses by the same scheduler as its
GPU one), on models of 1 and 2 decoder layers: the difference is one layer. The bytes per token and layer are
linear in the widths (hidden h, intermediate i, q = heads x head_dim, kv = kv_heads x head_dim), so they are
solved exactly from four shapes, a*h + b*i + c*q + d*kv, and checked on a fifth with other widths, head_dim and
tokens. plan/timing.py (ELEMENTWISE_BYTES) carries the coefficients this writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch._inductor.metrics as inductor_metrics
from peft import LoraConfig, get_peft_model
from torch._inductor.scheduler import ExternKernelSchedulerNode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "elementwise_bytes.json"
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
ATTENTION = ("scaled_dot_product", "_flash_", "_efficient_")
NO_TOUCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (hidden, intermediate, heads, kv_heads, head_dim, tokens): four to solve with, one to check (other widths,
# another head_dim and token count).
FIT = [(64, 128, 4, 2, 16, 64), (128, 128, 4, 2, 16, 64), (64, 384, 4, 2, 16, 64), (64, 128, 8, 2, 16, 64)]
HELD_OUT = (96, 256, 3, 1, 32, 48)
RECIPES = {"full": ("full", False), "full+ckpt": ("full", True), "lora7": ("lora", False), "lora7+ckpt": ("lora", True)}


def widths(shape: tuple[int, ...]) -> list[int]:
    """(h, i, q, kv) of a shape row."""
    h, i, heads, kv_heads, hd, _ = shape
    return [h, i, heads * hd, kv_heads * hd]


def build(arch: str, layers: int, shape: tuple[int, ...], method: str, ckpt: bool, vocab: int = 128, *,
          attention: str = "sdpa", dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A `layers`-layer model of `arch` (llama, qwen2, gpt_oss) at `shape`'s widths, trained as `method` with or
    without full checkpointing, attending with transformers' `attention` kernel, in `dtype`. gpt-oss (whose class
    has no SDPA: eager only) gets 4 experts, every one active for every token, so that the experts' bytes do not
    depend on the routing, and a sliding window of 8 on its windowed layers."""
    h, i, heads, kv_heads, hd, _ = shape
    torch.manual_seed(0)
    kw = dict(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=hd, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=256,
              attn_implementation=attention)
    if arch == "gpt_oss":
        model = GptOssForCausalLM(GptOssConfig(**kw, num_local_experts=4, num_experts_per_tok=4, sliding_window=8))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        if ckpt:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=8, target_modules=ALL_LINEAR, lora_dropout=0.0))
    model.to(dtype).train()
    return model


class ByteCounter(TorchDispatchMode):
    """Sums the bytes read and written by every aten op that runs an elementwise or reduction kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (func.is_view or name in MATMULS or name in NO_TOUCH or any(a in name for a in ATTENTION)):
            for t in tree_leaves((args, kwargs or {}, out)):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def _step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def forward_only(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One forward without gradients (a reference model's; what checkpointing's recomputation runs again)."""
    with torch.no_grad():
        model(input_ids=ids, labels=ids)


def eager_bytes(arch: str, layers: int, shape: tuple[int, ...], method: str, ckpt: bool, vocab: int = 128, *,
                counter: type[ByteCounter] = ByteCounter, step=_step, **model_kw) -> int:
    """Bytes of one eager forward + backward (the loss included; `step` forward_only: the forward alone) of one row
    of `shape`'s tokens, as `counter` counts them; `model_kw` goes to `build` (attention, dtype)."""
    model = build(arch, layers, shape, method, ckpt, vocab, **model_kw)
    ids = torch.randint(0, vocab, (1, shape[-1]))
    step(model, ids)  # warm-up: lazy initialisation stays out of the count
    model.zero_grad(set_to_none=True)
    with counter() as c:
        step(model, ids)
    return c.bytes


def compiled_bytes(arch: str, layers: int, shape: tuple[int, ...], method: str, ckpt: bool, vocab: int = 128, *,
                   extern: bool = False, step=_step, **model_kw) -> int:
    """Bytes inductor's generated kernels move in one compiled forward + backward (`step` forward_only: the
    forward alone, an inference graph), extern kernels (the matmuls and the attention kernel it calls) left out, or
    with them (`extern`); `model_kw` goes to `build`."""
    torch._dynamo.reset()
    inductor_metrics.reset()
    model = build(arch, layers, shape, method, ckpt, vocab, **model_kw)
    ids = torch.randint(0, vocab, (1, shape[-1]))
    compiled = torch.compile(model)
    step(compiled, ids)  # compiles the forward now and the backward when backward runs
    total = 0
    for node, _ in inductor_metrics.nodes_num_elem:
        if extern or not isinstance(node, ExternKernelSchedulerNode):
            total += node.get_read_write_buffers_sizes()
    return total


def per_layer_token(fn, arch: str, shape: tuple[int, ...], method: str, ckpt: bool) -> float:
    """One decoder layer's bytes (the 2-layer count minus the 1-layer one) per token."""
    one, two = (fn(arch, n, shape, method, ckpt) for n in (1, 2))
    return (two - one) / shape[-1]


def solve(rows: list[list[int]], values: list[float]) -> list[float]:
    """The exact solution of the 4x4 system rows . x = values."""
    x = torch.linalg.solve(torch.tensor(rows, dtype=torch.float64), torch.tensor(values, dtype=torch.float64))
    return [float(v) for v in x]


def predict(coef: list[float], shape: tuple[int, ...]) -> float:
    return sum(c * w for c, w in zip(coef, widths(shape), strict=True))


def measure(arch: str, recipe: str, check: bool) -> dict:
    method, ckpt = RECIPES[recipe]
    out: dict = {}
    for side, fn in (("eager", eager_bytes), ("compiled", compiled_bytes)):
        values = [per_layer_token(fn, arch, s, method, ckpt) for s in FIT]
        coef = solve([widths(s) for s in FIT], values)
        out[side] = {"coef": dict(zip("hiqk", coef, strict=True)), "fit": values}
        if check:
            held = per_layer_token(fn, arch, HELD_OUT, method, ckpt)
            out[side]["held_out"] = {"measured": held, "predicted": predict(coef, HELD_OUT),
                                     "error": predict(coef, HELD_OUT) / held - 1}
    return out


# The rest of the model (embedding, final norm, head, the loss) per micro-batch, linear in vocabulary V, hidden h
# and tokens T as a*V*T + b*h*T + c*V*h + d*T: the logits and the loss's passes over them per token and entry of
# the vocabulary, the final norm per token and width, the embedding's dense gradient once per micro-batch (where
# the embedding trains), the ids and labels per token. (shape, vocab): four to solve with, one to check.
REST_FIT = [((64, 128, 4, 2, 16, 64), 128), ((64, 128, 4, 2, 16, 64), 512), ((128, 128, 4, 2, 16, 64), 128),
            ((64, 128, 4, 2, 16, 32), 512)]
REST_HELD_OUT = ((96, 256, 3, 1, 32, 48), 384)


def rest_terms(shape: tuple[int, ...], vocab: int) -> list[int]:
    """(V*T, h*T, V*h, T) of a shape row and vocabulary."""
    h, tokens = shape[0], shape[-1]
    return [vocab * tokens, h * tokens, vocab * h, tokens]


def rest_bytes(fn, arch: str, shape: tuple[int, ...], vocab: int, method: str) -> float:
    """Bytes of one micro-batch outside the decoder layers: the 1-layer count less one layer (2-layer less 1-layer)."""
    one, two = (fn(arch, n, shape, method, False, vocab) for n in (1, 2))
    return 2 * one - two


def measure_rest(arch: str, method: str) -> dict:
    """The rest's coefficients, eager and compiled, solved on REST_FIT and checked on REST_HELD_OUT."""
    out: dict = {}
    for side, fn in (("eager", eager_bytes), ("compiled", compiled_bytes)):
        values = [rest_bytes(fn, arch, s, v, method) for s, v in REST_FIT]
        coef = solve([rest_terms(s, v) for s, v in REST_FIT], values)
        held = rest_bytes(fn, arch, *REST_HELD_OUT, method)
        predicted = sum(c * x for c, x in zip(coef, rest_terms(*REST_HELD_OUT), strict=True))
        out[side] = {"coef": dict(zip(("vt", "ht", "vh", "t"), coef, strict=True)), "fit": values,
                     "held_out": {"measured": held, "predicted": predicted, "error": predicted / held - 1}}
    return out


# Where the Qwen2 check is read: Llama-3.1-8B's widths (h, i, q, kv).
CHECK_WIDTHS = (4096, 14336, 4096, 1024)


def qwen_check(result: dict) -> dict:
    """Qwen2's per-layer bytes over Llama's at CHECK_WIDTHS, eager and compiled, from the solved coefficients."""
    out = {}
    for side in ("eager", "compiled"):
        at = {arch: sum(c * w for c, w in zip(result["recipes"][f"{arch}/full"][side]["coef"].values(), CHECK_WIDTHS,
                                               strict=True)) for arch in ("llama", "qwen2")}
        out[side] = at["qwen2"] / at["llama"] - 1
    return out


def configure() -> None:
    """One thread, and inductor set to count the bytes of every graph it compiles."""
    torch.set_num_threads(1)
    torch._logging.set_logs(inductor_metrics=True)  # makes compile_fx call graph.count_bytes()
    # ...which it also logs, a page per graph: the records stop at their logger, the count still runs.
    torch._logging.getArtifactLogger("torch._inductor.compile_fx", "inductor_metrics").addFilter(lambda r: False)
    torch._dynamo.config.cache_size_limit = 64
    # A cached graph skips the lowering that counts its bytes: compile every graph afresh.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def main() -> None:
    configure()
    import peft
    import transformers
    result: dict = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                    "dtype": "bf16", "fit_shapes": FIT, "held_out_shape": HELD_OUT,
                    "unit": "bytes per token per decoder layer = h*coef.h + i*coef.i + q*coef.q + kv*coef.k",
                    "recipes": {}}
    for arch in ("llama", "qwen2"):
        for recipe in RECIPES:
            if arch == "qwen2" and recipe != "full":
                continue
            r = measure(arch, recipe, check=arch == "llama")
            result["recipes"][f"{arch}/{recipe}"] = r
            e, c = r["eager"]["coef"], r["compiled"]["coef"]
            print(f"{arch:6s} {recipe:11s} eager " + " ".join(f"{k}={v:7.2f}" for k, v in e.items())
                  + "  compiled " + " ".join(f"{k}={v:7.2f}" for k, v in c.items())
                  + ("  held-out error eager {:+.1%} compiled {:+.1%}".format(
                      r["eager"]["held_out"]["error"], r["compiled"]["held_out"]["error"])
                     if "held_out" in r["eager"] else ""), flush=True)
    result["rest_unit"] = "bytes per micro-batch = V*T*coef.vt + h*T*coef.ht + V*h*coef.vh + T*coef.t"
    result["rest"] = {}
    for method in ("full", "lora"):
        r = measure_rest("llama", method)
        result["rest"][f"llama/{method}"] = r
        print(f"rest   {method:11s} " + "  ".join(
            f"{side} " + " ".join(f"{k}={v:9.3f}" for k, v in r[side]["coef"].items())
            + f" held-out {r[side]['held_out']['error']:+.1%}" for side in ("eager", "compiled")), flush=True)
    result["qwen2_vs_llama_full"] = qwen_check(result)
    print("qwen2 vs llama (full, at Llama-3.1-8B's widths): eager {eager:+.1%}, compiled {compiled:+.1%}".format(
        **result["qwen2_vs_llama_full"]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
