"""Measure what eager attention's L x L scores hold in memory, per attention op chain.

    python bench/eager_attention_memory.py      # writes bench/results/eager_attention_memory.json

plan/eager_memory.py plans, per head and query-key pair, the score-sized tensors autograd saves for backward (the
softmax's output, its 16-bit cast, Gemma 2's tanh output, the dropout's mask and output, gpt-oss's sink column) and
the peaks above those saved tensors that the forward and the backward reach. This script measures them on one real
tiny decoder layer of each chain's transformers family (bench/eager_attention_bytes.py CHAINS; gpt-oss for the
sinks), trained in full on a CPU, in three precisions (bf16 weights; fp32; fp32 weights under bf16 autocast, whose
additive mask is fp32 while the scores are bf16), with attention dropout off and at 0.1, and with shardfit's full
and selective checkpointing (what a checkpointed layer keeps of its scores).

Two counts, each solved as a*H*L^2 + m*L^2 + r*L + s*H*L + c + d*H over the FIT shapes (H heads, L tokens in one
row) and checked on HELD_OUT (bench/eager_attention_bytes.py):
- `saved`: what saved-tensor hooks see packed during the forward, each storage once, weights left out; and,
  for a checkpointed layer, what torch.distributed._tools.mem_tracker's MemTracker sees the layer hold when its
  forward returns (its memory after the forward less before it: its output, and GPT-J's and BLOOM's attention
  probabilities, which their layers return and the model drops at the next layer);
- `live`: every score-sized storage alive at once ([..., L, L] or [..., L, L + 1] tensors, tracked from their
  creation by a TorchDispatchMode to their release by a weak reference): its peak in the forward (`forward_peak`),
  what is alive when the forward returns (`forward_end`, the saved scores and the mask), its peak in the backward
  (`backward_peak`) and in a forward without gradients (`no_grad_peak`, a reference model's).
`a` is the per head and score coefficient the planner carries; `m` the mask's, which plan/activations.py counts
apart (`held_mask_bytes`). Beside them, the aten ops that read or write a score-sized tensor, kernels and views,
in the forward and in the backward (the same at every shape; plan/dispatch.py carries them as the ops eager
attention launches beyond SDPA's kernel).

A GPU runs attention dropout as ATen's fused native_dropout (a bool mask beside the output); a CPU runs it as a
bernoulli mask in the scores' dtype. The count runs the CUDA path on the CPU: `torch.nn.functional.dropout` is
replaced, for the count only, by native_dropout, which is what ATen's dropout calls on CUDA for 0 < p < 1
(shardfit/simulate/gpu_kernels.py `dropout_as_on_a_gpu`, which the simulated step runs under too).
"""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardfit.simulate.gpu_kernels import dropout_as_on_a_gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eager_attention_bytes import CHAINS, FIT, HEAD_DIM, HELD_OUT, HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB, terms  # noqa: E402
from elementwise_bytes import solve  # noqa: E402 - bench/ is not a package; its path is set above

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "eager_attention_memory.json"
# The chains, by the family counted for each (gpt-oss's sinks beside bench/eager_attention_bytes.py's CHAINS).
FAMILIES = {**CHAINS, "sinks": "gpt_oss"}
# bf16 weights; fp32; fp32 weights under bf16 autocast.
PRECISIONS = ("bf16", "fp32", "amp")
DROPOUTS = (0.0, 0.1)
CHECKPOINTING = ("full", "selective")


def build(arch: str, layers: int, heads: int, precision: str, dropout: float, ckpt: str) -> torch.nn.Module:
    """A `layers`-layer model of transformers' `arch` at bench/eager_attention_bytes.py's widths, eager attention,
    attention dropout `dropout` (no other dropout), trained in full with shardfit's checkpointing `ckpt`."""
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        GPTJConfig,
        GPTJForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from shardfit.models.checkpointing import enable_hf_checkpointing

    torch.manual_seed(0)
    gpt = dict(n_embd=HIDDEN, n_head=heads, n_layer=layers, n_positions=256, vocab_size=VOCAB, attn_pdrop=dropout,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    llama = dict(num_hidden_layers=layers, vocab_size=VOCAB, attn_implementation="eager", hidden_size=HIDDEN,
                 intermediate_size=INTERMEDIATE, num_attention_heads=heads, num_key_value_heads=KV_HEADS,
                 head_dim=HEAD_DIM, max_position_embeddings=256, attention_dropout=dropout)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**llama))
    elif arch == "gemma2":  # every block global: a window's mask is the same dense square under eager
        model = Gemma2ForCausalLM(Gemma2Config(**llama, layer_types=["full_attention"] * layers))
    elif arch == "gpt_oss":  # every expert active, every block global
        model = GptOssForCausalLM(GptOssConfig(**llama, num_local_experts=2, num_experts_per_tok=2,
                                               layer_types=["full_attention"] * layers))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**gpt))
    elif arch == "gptj":
        model = GPTJForCausalLM(GPTJConfig(**gpt, rotary_dim=8))
    elif arch == "bloom":
        model = BloomForCausalLM(BloomConfig(hidden_size=HIDDEN, n_head=heads, n_layer=layers, vocab_size=VOCAB,
                                             attention_dropout=dropout, hidden_dropout=0.0,
                                             attn_implementation="eager"))
    else:
        raise ValueError(f"no model for {arch}")
    if ckpt != "none":
        enable_hf_checkpointing(model, selective=ckpt == "selective")
    return model.to(torch.bfloat16 if precision == "bf16" else torch.float32).train()


def first_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The model's first decoder layer."""
    body = getattr(model, "model", None) or model.transformer
    return (body.layers if hasattr(body, "layers") else body.h)[0]


class ScoreTracker(TorchDispatchMode):
    """The bytes of every score-sized storage ([..., L, L] or [..., L, L + 1]) alive at once, from the op that made
    it to its release, and their peak since `reset`."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = 0
        self.peak = 0
        self.ops: Counter[str] = Counter()  # ops that read or write a score-sized tensor, kernels and views

    def reset(self) -> None:
        self.peak = self.now
        self.ops = Counter()

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def scored(self, t: object) -> bool:
        """Whether `t` is a score-sized tensor."""
        return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] == self.tokens and \
            t.shape[-1] in (self.tokens, self.tokens + 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(self.scored(t) for t in tree_leaves((args, kwargs or {}, out))):
            self.ops["view" if func.is_view else "kernel"] += 1
        for t in tree_leaves(out):
            if not self.scored(t):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.refs[key] = weakref.ref(storage, lambda _, key=key: self._release(key))
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        return out


def autocast(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp")


def count(arch: str, heads: int, tokens: int, precision: str, dropout: float, ckpt: str,
          layers: int = 1) -> dict[str, float]:
    """One row of `tokens` through a `layers`-layer model of `arch`: the first layer's saved bytes (hooks, or under
    checkpointing MemTracker's bytes held after its forward), the score-sized storages' live bytes at each moment,
    and the ops that touch them."""
    model = build(arch, layers, heads, precision, dropout, ckpt)
    ids = torch.randint(0, VOCAB, (1, tokens))
    with dropout_as_on_a_gpu():
        with autocast(precision):  # warm-up: lazy initialisation stays out of the count
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        out: dict[str, float] = {}
        with autocast(precision):
            out["saved"] = saved_bytes(model, lambda: model(input_ids=ids, labels=ids)) if ckpt == "none" else \
                kept_bytes(model, ids)
        tracker = ScoreTracker(tokens)
        with tracker:
            with autocast(precision):
                loss = model(input_ids=ids, labels=ids).loss
            out["forward_peak"], out["forward_end"] = tracker.peak, tracker.now
            out["forward_kernels"], out["forward_views"] = tracker.ops["kernel"], tracker.ops["view"]
            tracker.reset()
            loss.backward()
            out["backward_peak"] = tracker.peak
            out["backward_kernels"], out["backward_views"] = tracker.ops["kernel"], tracker.ops["view"]
            del loss
            tracker.reset()
            with torch.no_grad(), autocast(precision):
                model(input_ids=ids, labels=ids)
            out["no_grad_peak"] = tracker.peak
    return out


OPS = ("forward_kernels", "forward_views", "backward_kernels", "backward_views")


def layer_ops(arch: str, precision: str, dropout: float, ckpt: str) -> dict[str, dict[str, int]]:
    """The ops on score-sized tensors of one decoder layer (two layers less one: the mask's own ops are the
    model's), at HELD_OUT and at FIT's first shape: the same counts at both."""
    out = {}
    for heads, tokens in (HELD_OUT, FIT[0]):
        one, two = (count(arch, heads, tokens, precision, dropout, ckpt, layers) for layers in (1, 2))
        out[f"{heads}x{tokens}"] = {k: int(two[k] - one[k]) for k in OPS}
    return out


def saved_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes the layer's forward packs for backward (saved-tensor hooks), each storage once, weights left out."""
    layer = first_layer(model)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if inside[0] and key not in weights:
            kept[key] = t.untyped_storage().nbytes()
        return t

    enter = layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    leave = layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        enter.remove()
        leave.remove()
    return sum(kept.values())


def kept_bytes(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """What a checkpointed layer holds after its forward (MemTracker: after less before; its output included)."""
    layer = first_layer(model)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    stats = tracker.memory_tracking[layer].snapshots

    def total(state: str) -> int:
        snap = next(s for k, v in stats.items() if k.value == state for s in v)
        return sum(d.get("Total", 0) for d in snap.values())

    return total("Post-Forward") - total("Pre-Forward")


def fit(values: dict[tuple[int, int], float]) -> dict:
    """Coefficients of a*H*L^2 + m*L^2 + r*L + s*H*L + c + d*H solved on FIT, checked on HELD_OUT."""
    coef = solve([terms(*p) for p in FIT], [values[p] for p in FIT])
    predicted = sum(c * x for c, x in zip(coef, terms(*HELD_OUT), strict=True))
    measured = values[HELD_OUT]
    return {"coef": dict(zip(("a", "m", "r", "s", "c", "d"), (round(c, 4) for c in coef), strict=True)),
            "held_out": {"measured": measured, "predicted": predicted,
                         "error": predicted / measured - 1 if measured else predicted}}


def measure(chain: str, precision: str, dropout: float, ckpt: str) -> dict:
    """Every count of one configuration, at FIT and HELD_OUT, each solved."""
    arch = FAMILIES[chain]
    rows = {p: count(arch, *p, precision, dropout, ckpt) for p in [*FIT, HELD_OUT]}
    out = {"model": arch, "at": {f"{h}x{t}": rows[(h, t)] for h, t in rows}}
    for key in rows[HELD_OUT]:
        if key not in OPS:
            out[key] = fit({p: r[key] for p, r in rows.items()})
    out["ops"] = layer_ops(arch, precision, dropout, ckpt)
    return out


def main() -> None:
    torch.set_num_threads(1)
    import transformers
    result: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "widths": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "kv_heads": KV_HEADS,
                               "head_dim": HEAD_DIM, "vocab": VOCAB},
                    "fit": FIT, "held_out": HELD_OUT,
                    "unit": "bytes per decoder layer and row = a*H*L^2 + m*L^2 + r*L + s*H*L + c + d*H "
                            "(H heads, L tokens)", "chains": {}}
    configs = [(c, p, d, "none") for c in FAMILIES for p in PRECISIONS for d in DROPOUTS] + \
        [(c, "bf16", 0.0, ck) for c in FAMILIES for ck in CHECKPOINTING]
    for chain, precision, dropout, ckpt in configs:
        r = measure(chain, precision, dropout, ckpt)
        result["chains"][f"{chain}/{precision}/p{dropout}/{ckpt}"] = r
        print(f"{chain:8s} {precision:4s} p={dropout} {ckpt:9s} " + " ".join(
            f"{k}={r[k]['coef']['a']:.2f}({r[k]['held_out']['error']:+.1%})" for k in
            ("saved", "forward_peak", "forward_end", "backward_peak", "no_grad_peak")) +
            f" ops={r['ops'][f'{HELD_OUT[0]}x{HELD_OUT[1]}']}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
