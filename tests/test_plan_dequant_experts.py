"""bitsandbytes QLoRA over a mixture whose experts are an nn.Linear each (transformers 4's per-expert MLPs,
Llama 4's unfused experts, Lightning's plugin over litgpt): every expert that gets tokens is its own Linear4bit,
dequantized by its own kernels in every use, so the host dispatches three dequantizations per expert hit, not one
per fused stack (plan/dequant.py `dequantized_weights_per_layer`; review s65, finding R2)."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.plan.dequant import LAYER_WEIGHTS, dequantized_weights_per_layer, experts_hit
from shardfit.plan.dispatch import host_dispatch_s
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

QWEN3_MOE = "Qwen/Qwen3-30B-A3B"
# axolotl's QLoRA recipe on transformers 4.57: bitsandbytes, peft's upcast, an nn.Linear per expert
TF4 = Workload(method="qlora", precision="bf16", seq_len=2048, micro_batch=2, grad_ckpt="full", quant_backend="bnb",
               frozen_fp32=True, fused_experts=False)


def test_per_expert_linears_are_each_dequantized() -> None:
    """Qwen3-30B-A3B, 4,096 tokens at top-8: all 128 experts get tokens, so each block dequantizes q, k, v, o and
    3 x 128 expert weights (388), where transformers 5's fused stacks stay 16-bit (4); a micro-batch of 4 tokens
    reaches at most 32 experts."""
    shape = resolve_shape(QWEN3_MOE)
    assert shape.experts == 128 and shape.top_k == 8
    assert dequantized_weights_per_layer(shape, TF4) == pytest.approx(4 + 3 * 128)
    assert dequantized_weights_per_layer(shape, dataclasses.replace(TF4, fused_experts=True)) == pytest.approx(4)
    short = dataclasses.replace(TF4, seq_len=4, micro_batch=1)
    assert experts_hit(shape, short) == 32
    assert dequantized_weights_per_layer(shape, short) == pytest.approx(4 + 3 * 32)
    # Lightning's plugin over litgpt's mixture: every linear 4-bit, the router too, and each expert its own
    lit = dataclasses.replace(TF4, bnb_precision=True, fused_experts=True)
    assert dequantized_weights_per_layer(shape, lit) == pytest.approx(5 + 3 * 128)
    # shardfit's torchao QLoRA quantizes the fused stacks whole and dequantizes each a slice of experts at a time
    # (models/quantize_experts.py): q, k, v, o, then gate/up in 8 slices of 16 experts and down in 4 of 32; a dense
    # model's layer keeps the measured count
    own = dataclasses.replace(TF4, quant_backend="torchao", fused_experts=True, frozen_fp32=False)
    assert dequantized_weights_per_layer(shape, own) == 4 + 8 + 4
    assert dequantized_weights_per_layer(resolve_shape("meta-llama/Llama-3.1-8B"), own) == LAYER_WEIGHTS


def test_llama4_s_unfused_experts_are_each_dequantized() -> None:
    """Llama 4 Scout under bitsandbytes: transformers replaces its fused experts by an MLP per expert before
    quantizing (SequentialLlama4TextExperts), and every token runs through every one of the 16."""
    shape = resolve_shape("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    w = dataclasses.replace(TF4, fused_experts=True)
    assert dequantized_weights_per_layer(shape, w) > 3 * shape.experts


def test_a_transformers_4_moe_qlora_step_is_host_bound() -> None:
    """The same job on one H200: the per-expert dequantizations' launches (381 more weights x 3 kernels x 3 uses
    x 48 layers at about 8 us) make the host take over a second per micro-batch, and the step waits on it."""
    shape, hw = resolve_shape(QWEN3_MOE), parse_gpus("1xH200", 1, None)
    assert host_dispatch_s(shape, TF4) > 1.2
    t = step_time(shape, TF4, hw, "single")
    assert t.bound == "host"
