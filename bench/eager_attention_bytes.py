"""Count the bytes eager attention's scores move, per head and query-key pair of the square it computes.

    python bench/eager_attention_bytes.py            # prints the table, writes bench/results/eager_attention_bytes.json
    python bench/eager_attention_bytes.py --chains   # only the per-chain counts (CHAINS), merged into that file

transformers' `eager_attention_forward` materialises each head's L x L scores: QK^T's output, the scaling, the
additive mask, the softmax (Llama's: upcast to fp32, softmax, cast back; gpt-oss's: its sinks concatenated, the
row maximum subtracted, softmax in the scores' dtype), dropout where p > 0, and PV's read of the probabilities; in
backward the gradient of each, and under checkpointing the forward again. SDPA and flash attention keep the scores
on chip. bench/elementwise_bytes.py measured its per-token coefficients under SDPA, so none of these bytes is in
them; they grow with L^2, the rest of a layer with L.

- eager (TorchDispatchMode): every aten op that touches memory, the matmuls and the attention kernels included
  (the score-sized operands and results of QK^T and PV and of their gradients are traffic a kernel with K =
  head_dim cannot hide), views, allocations and `_unsafe_view` (a reshape that moves nothing) left out. One
  decoder layer: the 2-layer count less the 1-layer one (the model's own mask building, once per forward, goes
  with the rest).
- compiled: inductor's count (`graph.count_bytes()`) of every scheduler node of the forward and backward graphs,
  the extern kernels (bmm, mm) included, under eager attention.
- forward: one forward without gradients (a reference model's, and what checkpointing runs again), both ways.
  Under checkpointing the compiled count does not follow the polynomial (the held-out shape is off by a sixth: the
  partitioner's choice of what to save and recompute moves with the sizes), so the planner takes the compiled
  forward once more instead; the eager counts show that rule exact (full + checkpointing less full = forward).

On one layer, bytes = a*H*L^2 + m*L^2 + r*L + s*H*L + c + d*H (H heads, L tokens of a row, the other widths
fixed): `a` per head and score, `m` per mask element (the mask is [rows, 1, L, L], broadcast over the heads), r and
s the part that grows with L, c and d the weights' (matmuls read them and write their gradients). Solved exactly
from six (H, L) and checked on a seventh. Llama: eager attention less SDPA, both
with this counter (SDPA's own L^2 coefficients are 0: its CPU flash kernel reads q, k, v and writes o); gpt-oss
(no SDPA in any release): eager alone.

Per chain (`chains` in the json): each family whose eager attention runs its own ops on the scores (CHAINS: Llama's
upcast softmax; Gemma 2's logit softcapping; GPT-2's softmax in the scores' dtype; GPT-J's and CodeGen's `_attn`,
which upcasts q and k so the scores are fp32 from QK^T on; BLOOM's baddbmm, which adds ALiBi and scales inside the
matmul), eager alone (the L^2 coefficients under SDPA are 0, above), without checkpointing, with full and with
shardfit's selective checkpointing (models/checkpointing.py, which keeps mm/addmm and the SDPA/flash kernels'
outputs only, so none of eager's score ops), in bf16 and fp32, each with the score-sized bytes by op at HELD_OUT.
`a_less_matmuls` is `a` less the score matmuls' share (bmm/baddbmm): plan/timing.py charges those matmuls as FLOPs
at the training utilization already. plan/timing.py (EAGER_SCORE_BYTES) carries a_less_matmuls and m.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elementwise_bytes import (  # noqa: E402 - bench/ is not a package; its path is set above
    NO_TOUCH,
    ByteCounter,
    _step,
    compiled_bytes,
    configure,
    eager_bytes,
    forward_only,
    solve,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "eager_attention_bytes.json"
HIDDEN, INTERMEDIATE, KV_HEADS, HEAD_DIM, VOCAB = 96, 160, 2, 16, 136
# (heads, tokens): six to solve with (each of 1, L, L^2 with and without H), one to check. No L equals a width, so
# a score is told by its shape.
FIT = [(4, 40), (8, 40), (4, 56), (8, 56), (4, 72), (8, 72)]
HELD_OUT = (6, 64)
RECIPES = {"full": ("full", False), "full+ckpt": ("full", True), "lora7": ("lora", False), "lora7+ckpt": ("lora", True)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The attention op chains of plan/timing.py's EAGER_SCORE_BYTES and the transformers family counted for each
# (CodeGen's `_attn` is GPT-J's line for line; gpt-oss's sinks are counted by `measure_gpt_oss`).
CHAINS = {"llama": "llama", "softcap": "gemma2", "plain": "gpt2", "fp32_qk": "gptj", "alibi": "bloom"}
CHECKPOINTING = ("none", "full", "selective")
MATMUL_OPS = ("bmm", "baddbmm")


def shape_of(heads: int, tokens: int) -> tuple[int, ...]:
    """elementwise_bytes's shape row (h, i, heads, kv_heads, head_dim, tokens) at the fixed widths."""
    return (HIDDEN, INTERMEDIATE, heads, KV_HEADS, HEAD_DIM, tokens)


def terms(heads: int, tokens: int) -> list[int]:
    """(H L^2, L^2, L, H L, 1, H) of a row of `tokens` over `heads` heads."""
    return [heads * tokens * tokens, tokens * tokens, tokens, heads * tokens, 1, heads]


class TrafficCounter(ByteCounter):
    """Every aten op's input and output bytes but those that touch no memory; the score-sized ones ([..., L, L],
    or L + 1 keys where gpt-oss's sink joins them) also summed by op into `by_op` where `tokens` is given."""

    tokens = 0
    by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_TOUCH or name == "_unsafe_view"):
            for t in tree_leaves((args, kwargs or {}, out)):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
                    if self.tokens and t.dim() >= 2 and t.shape[-2] == self.tokens and \
                            t.shape[-1] in (self.tokens, self.tokens + 1):
                        self.by_op[name] = self.by_op.get(name, 0) + t.numel() * t.element_size()
        return out


def layer_bytes(arch: str, heads: int, tokens: int, method: str, ckpt: bool, attention: str, dtype: str,
                by_op: dict | None = None, forward: bool = False) -> int:
    """One decoder layer's traffic in a forward + backward of one row (2 layers less 1; `forward`: one forward
    without gradients); `by_op`: filled with the layer's score-sized bytes per op."""
    counts = []
    for layers in (1, 2):
        ops: dict[str, int] = defaultdict(int)
        counter = type("Counter", (TrafficCounter,), {"tokens": tokens if by_op is not None else 0, "by_op": ops})
        counts.append(eager_bytes(arch, layers, shape_of(heads, tokens), method, ckpt, VOCAB, counter=counter,
                                  step=forward_only if forward else _step, attention=attention,
                                  dtype=DTYPES[dtype]))
        if by_op is not None:
            by_op[layers] = dict(ops)
    if by_op is not None:
        one, two = by_op.pop(1), by_op.pop(2)
        by_op.update({k: two.get(k, 0) - one.get(k, 0) for k in two})
    return counts[1] - counts[0]


def fit(count) -> dict:
    """`count(heads, tokens)`'s coefficients (a: per head and score, m: per mask element, r: per token, s: per
    head and token, c: per layer, d: per head: the weights' reads and gradients), solved on FIT and checked on
    HELD_OUT."""
    values = [float(count(*p)) for p in FIT]
    coef = solve([terms(*p) for p in FIT], values)
    held = float(count(*HELD_OUT))
    predicted = sum(c * x for c, x in zip(coef, terms(*HELD_OUT), strict=True))
    return {"coef": dict(zip(("a", "m", "r", "s", "c", "d"), coef, strict=True)), "fit": values,
            "held_out": {"measured": held, "predicted": predicted, "error": predicted / held - 1}}


def measure_llama(recipe: str, dtype: str, forward: bool = False) -> dict:
    """Llama's eager and SDPA layers, and eager less SDPA, each solved; the scores' bytes by op at HELD_OUT;
    `forward`: also one forward without gradients, eager less SDPA (`forward_less_sdpa`)."""
    method, ckpt = RECIPES[recipe]
    cache: dict = {}

    def layer(attention: str, heads: int, tokens: int, fwd: bool = False) -> int:
        key = (attention, heads, tokens, fwd)
        if key not in cache:
            cache[key] = layer_bytes("llama", heads, tokens, method, ckpt, attention, dtype, forward=fwd)
        return cache[key]

    out = {side: fit(lambda h, t, side=side: layer(side, h, t)) for side in ("eager", "sdpa")}
    out["eager_less_sdpa"] = fit(lambda h, t: layer("eager", h, t) - layer("sdpa", h, t))
    if forward:
        out["forward_less_sdpa"] = fit(lambda h, t: layer("eager", h, t, True) - layer("sdpa", h, t, True))
    out["scores_by_op"] = scores_by_op("llama", method, ckpt, dtype)
    return out


def scores_by_op(arch: str, method: str, ckpt: bool, dtype: str) -> dict[str, float]:
    """One layer's score-sized bytes per op at HELD_OUT, per head and score (the mask's share in `add`)."""
    heads, tokens = HELD_OUT
    ops: dict = {}
    layer_bytes(arch, heads, tokens, method, ckpt, "eager", dtype, by_op=ops)
    return {k: v / (heads * tokens * tokens) for k, v in sorted(ops.items()) if v}


def measure_gpt_oss(recipe: str) -> dict:
    """gpt-oss's eager layer (sinks, the row maximum, softmax in the scores' dtype) solved alone: it has no SDPA."""
    method, ckpt = RECIPES[recipe]
    out = {"eager": fit(lambda h, t: layer_bytes("gpt_oss", h, t, method, ckpt, "eager", "bf16"))}
    if not ckpt:
        out["forward"] = fit(lambda h, t: layer_bytes("gpt_oss", h, t, method, ckpt, "eager", "bf16", forward=True))
    out["scores_by_op"] = scores_by_op("gpt_oss", method, ckpt, "bf16")
    return out


def measure_compiled(recipe: str) -> dict:
    """Llama's layer under torch.compile with eager attention, extern kernels included, solved alone; without
    checkpointing also one forward without gradients (`forward`, inductor's inference graph)."""
    method, ckpt = RECIPES[recipe]

    def layer(heads: int, tokens: int, step=_step) -> int:
        one, two = (compiled_bytes("llama", n, shape_of(heads, tokens), method, ckpt, VOCAB, extern=True,
                                   step=step, attention="eager") for n in (1, 2))
        return two - one

    out = {"eager": fit(layer)}
    if not ckpt:
        out["forward"] = fit(lambda h, t: layer(h, t, forward_only))
    return out


def build_chain(arch: str, layers: int, heads: int, ckpt: str, dtype: str) -> torch.nn.Module:
    """A `layers`-layer model of transformers' `arch` at the fixed widths (GPT-2's family: hidden HIDDEN split over
    `heads`), eager attention, no dropout, trained in full with shardfit's checkpointing `ckpt`."""
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        GPTJConfig,
        GPTJForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from shardfit.models.checkpointing import enable_hf_checkpointing

    torch.manual_seed(0)
    common = dict(num_hidden_layers=layers, vocab_size=VOCAB, attn_implementation="eager")
    gpt = dict(n_embd=HIDDEN, n_head=heads, n_layer=layers, n_positions=256, vocab_size=VOCAB,
               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    llama_kw = dict(common, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=heads,
                    num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**llama_kw))
    elif arch == "gemma2":  # every block global: the window's mask is the same dense square under eager
        model = Gemma2ForCausalLM(Gemma2Config(**llama_kw, layer_types=["full_attention"] * layers))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**gpt))
    elif arch == "gptj":
        model = GPTJForCausalLM(GPTJConfig(**gpt, rotary_dim=8))
    elif arch == "bloom":
        model = BloomForCausalLM(BloomConfig(hidden_size=HIDDEN, n_head=heads, n_layer=layers, vocab_size=VOCAB,
                                             attention_dropout=0.0, hidden_dropout=0.0,
                                             attn_implementation="eager"))
    else:
        raise ValueError(f"no chain model for {arch}")
    if ckpt != "none":
        enable_hf_checkpointing(model, selective=ckpt == "selective")
    return model.to(DTYPES[dtype]).train()


def chain_layer_bytes(arch: str, heads: int, tokens: int, ckpt: str, dtype: str, by_op: dict | None = None) -> int:
    """One decoder layer's traffic (2 layers less 1) in a forward + backward of one row of `arch`; `by_op`: filled
    with the layer's score-sized bytes per op."""
    counts, ops_by_layers = [], []
    for layers in (1, 2):
        model = build_chain(arch, layers, heads, ckpt, dtype)
        ids = torch.randint(0, VOCAB, (1, tokens))
        _step(model, ids)  # warm-up: lazy initialisation stays out of the count
        model.zero_grad(set_to_none=True)
        ops: dict[str, int] = defaultdict(int)
        counter = type("Counter", (TrafficCounter,), {"tokens": tokens if by_op is not None else 0, "by_op": ops})
        with counter() as c:
            _step(model, ids)
        counts.append(c.bytes)
        ops_by_layers.append(dict(ops))
    if by_op is not None:
        one, two = ops_by_layers
        by_op.update({k: two.get(k, 0) - one.get(k, 0) for k in two})
    return counts[1] - counts[0]


def measure_chain(chain: str, ckpt: str, dtype: str) -> dict:
    """CHAINS[chain]'s eager layer solved alone, its score-sized bytes by op at HELD_OUT (per head and score) and
    `a` less the score matmuls' share (`a_less_matmuls`)."""
    arch = CHAINS[chain]
    out = {"model": arch, "eager": fit(lambda h, t: chain_layer_bytes(arch, h, t, ckpt, dtype))}
    heads, tokens = HELD_OUT
    ops: dict = {}
    chain_layer_bytes(arch, heads, tokens, ckpt, dtype, by_op=ops)
    out["scores_by_op"] = {k: v / (heads * tokens * tokens) for k, v in sorted(ops.items()) if v}
    matmuls = sum(out["scores_by_op"].get(k, 0.0) for k in MATMUL_OPS)
    out["a_less_matmuls"] = out["eager"]["coef"]["a"] - matmuls
    return out


def measure_chains() -> dict:
    """Every chain under each checkpointing in bf16 and fp32 (selective in bf16 only: it matches full)."""
    out = {}
    for chain in CHAINS:
        for ckpt in CHECKPOINTING:
            for dtype in DTYPES:
                if ckpt == "selective" and dtype != "bf16":
                    continue
                r = measure_chain(chain, ckpt, dtype)
                out[f"{chain}/{ckpt}/{dtype}"] = r
                c = r["eager"]["coef"]
                print(f"{chain:8s} {ckpt:9s} {dtype}  a={c['a']:7.3f} m={c['m']:6.3f} "
                      f"a-matmuls={r['a_less_matmuls']:7.3f} held-out {r['eager']['held_out']['error']:+.2%}",
                      flush=True)
    return out


def row(label: str, r: dict) -> str:
    c, held = r["coef"], r["held_out"]["error"]
    return f"{label:34s} a={c['a']:7.3f} m={c['m']:6.3f} r={c['r']:9.2f} s={c['s']:8.2f} held-out {held:+.2%}"


def main() -> None:
    configure()
    if "--chains" in sys.argv[1:]:
        result = json.loads(OUT.read_text())
        result["chains"] = measure_chains()
        OUT.write_text(json.dumps(result, indent=2))
        return
    import peft
    import transformers
    result: dict = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                    "widths": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "kv_heads": KV_HEADS,
                               "head_dim": HEAD_DIM, "vocab": VOCAB},
                    "fit": FIT, "held_out": HELD_OUT,
                    "unit": "bytes per decoder layer and row = a*H*L^2 + m*L^2 + r*L + s*H*L + c + d*H "
                            "(H heads, L tokens)",
                    "mask": "[rows, 1, L, L] in the scores' dtype, broadcast over the heads", "eager": {},
                    "compiled": {}}
    for recipe in RECIPES:
        for dtype in ("bf16", "fp32"):
            if dtype == "fp32" and recipe != "full":
                continue
            r = measure_llama(recipe, dtype, forward=(recipe, dtype) == ("full", "bf16"))
            result["eager"][f"llama/{recipe}/{dtype}"] = r
            for side in ("eager", "sdpa", "eager_less_sdpa", "forward_less_sdpa"):
                if side in r:
                    print(row(f"llama {recipe} {dtype} {side}", r[side]), flush=True)
    for recipe in ("full", "full+ckpt"):
        r = measure_gpt_oss(recipe)
        result["eager"][f"gpt_oss/{recipe}/bf16"] = r
        for side in ("eager", "forward"):
            if side in r:
                print(row(f"gpt_oss {recipe} bf16 {side}", r[side]), flush=True)
    for recipe in ("full", "full+ckpt"):
        r = measure_compiled(recipe)
        result["compiled"][f"llama/{recipe}/bf16"] = r
        for side in ("eager", "forward"):
            if side in r:
                print(row(f"llama {recipe} bf16 compiled {side}", r[side]), flush=True)
    result["chains"] = measure_chains()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
