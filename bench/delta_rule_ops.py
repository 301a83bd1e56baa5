"""Count the aten ops the host dispatches per chunk of transformers' torch Gated DeltaNet (the fallback it runs
where flash-linear-attention is not installed: `torch_chunk_gated_delta_rule` loops over the sequence's 64-token
chunks in Python, and `torch_causal_conv1d_update`'s reference path).

    python bench/delta_rule_ops.py          # prints the per-chunk counts plan/dispatch.py DELTA_CHUNK_OPS carries

Counted as bench/dispatch_ops.py counts a layer: an OpCounter over tiny Qwen3.5 text models of 2 and 3 blocks (the
first softmax attention, the rest Gated DeltaNet), LoRA on every linear, at 1024 and 2048 tokens; the difference
of the blocks is one DeltaNet block's ops, and the difference of the lengths over the 16 chunks between them is
one chunk's. Forward alone and forward + backward, with and without bf16 autocast (the frozen base in bf16 under
autocast, fp32 without).
"""

from __future__ import annotations

import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.dispatch_ops import OpCounter
from shardfit.config import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.plan.model_shape import DELTA_CHUNK

LENGTHS = (1024, 2048)


def block_ops(blocks: int, seq: int, autocast: bool, backward: bool) -> tuple[int, int]:
    """(kernels, views) of one micro-batch of a tiny Qwen3.5 text model with `blocks - 1` DeltaNet blocks."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_5_text", num_hidden_layers=blocks, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, use_cache=False, attn_implementation="sdpa",
        layer_types=["full_attention"] + ["linear_attention"] * (blocks - 1))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if autocast else torch.float32)
    model = apply_lora(model, LoraSettings(rank=4, alpha=8))
    ids = torch.randint(0, 128, (1, seq))
    counter = OpCounter()
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if backward:
            loss.backward()
    return counter.ops["kernel"], counter.ops["view"]


def per_chunk(autocast: bool, backward: bool) -> tuple[float, float]:
    """(kernels, views) one more chunk of the sequence adds to one DeltaNet block."""
    def block(seq: int) -> tuple[int, int]:
        two, three = block_ops(2, seq, autocast, backward), block_ops(3, seq, autocast, backward)
        return three[0] - two[0], three[1] - two[1]

    (k1, v1), (k2, v2) = (block(seq) for seq in LENGTHS)
    chunks = (LENGTHS[1] - LENGTHS[0]) / DELTA_CHUNK
    return (k2 - k1) / chunks, (v2 - v1) / chunks


def main() -> None:
    warnings.filterwarnings("ignore")
    for autocast in (True, False):
        forward, step = per_chunk(autocast, False), per_chunk(autocast, True)
        print(f"autocast {autocast}: forward {forward}, forward + backward {step} (kernels, views per chunk)")


if __name__ == "__main__":
    main()
