"""What one decoder block saves for backward, eager and under torch.compile, per token.

    python bench/compile_activations.py

A transformers Llama block in bf16 (no autocast: torchtune's and Answer.AI's pure 16-bit runs) runs once eagerly,
its saved tensors read with saved-tensor hooks, and once through AOTAutograd with the partitioner inductor uses
(min-cut rematerialisation), the saved tensors read from the forward graph's outputs. Only tensors with a token
dimension count (weights and the rotary tables are shared, not per token). The planner's per-block formula
(plan/activations.py `block_activation_bytes_per_token`) is printed beside each measurement.
The partition runs on CPU in seconds: no kernel is generated.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardfit.plan.activations import block_activation_bytes_per_token  # noqa: E402
from shardfit.plan.shapes import ModelShape  # noqa: E402
from shardfit.plan.workload import Workload  # noqa: E402

# Distinct widths, so that a tensor's shape says what it is; 48 tokens appear in no weight's shape.
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, TOKENS = 64, 4, 2, 176, 48


def per_token(tensors: list[tuple[tuple[int, ...], torch.dtype]]) -> float:
    """Bytes per token of the tensors that have a token dimension, rotary tables left out."""
    head_dim = HIDDEN // HEADS
    rope = {(1, TOKENS, head_dim), (1, 1, TOKENS, head_dim)}
    kept = [(s, d) for s, d in tensors if TOKENS in s and s not in rope]
    return sum(math.prod(s) * d.itemsize for s, d in kept) / TOKENS


def measure() -> dict[str, float]:
    """Saved bytes per token of one bf16 Llama block: eager and compiled."""
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=1, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(TOKENS)[None]
    rope = LlamaRotaryEmbedding(cfg)(x, positions)

    def step(module: torch.nn.Module) -> torch.Tensor:
        out = module(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    eager: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        eager[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(layer)

    compiled: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward_graph(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        # The first output is the block's own; the rest are what the forward saves for backward.
        compiled.extend((tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in outputs[1:]
                        if hasattr(o, "meta") and "val" in o.meta)
        return gm

    def backend(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        return aot_module_simplified(gm, inputs, fw_compiler=forward_graph, bw_compiler=lambda g, _i: g,
                                     partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                                    compiler="inductor"))

    torch._dynamo.reset()
    step(torch.compile(layer, backend=backend))
    return {"eager": per_token(list(eager.values())), "compiled": per_token(compiled)}


def main() -> None:
    shape = ModelShape("tiny", 1, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, 128)
    w = Workload(method="lora", pure_16bit=True, attention="flash", lora_rank=0, seq_len=TOKENS)
    measured = measure()
    for kind, compiled in (("eager", False), ("compiled", True)):
        planned = block_activation_bytes_per_token(shape, Workload(**{**w.__dict__, "compile": compiled}))
        print(f"{kind}: measured {measured[kind]:.0f} bytes/token; planner {planned:.0f}")


if __name__ == "__main__":
    main()
