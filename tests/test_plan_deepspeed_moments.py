"""DeepSpeed's plan weighs the same moments of the step as the other engines' (plan/estimate.py
`step_candidates`), fed with what the engine holds (plan/deepspeed.py `zero_rank`): what autograd holds is the same
under every engine, only the gradients' buffers and the engine's gathers differ."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.plan.backward_temps import dequantize_bytes
from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed, zero_memory, zero_rank
from shardfit.plan.estimate import GIB, step_candidates
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.quant import dequantize_peak_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.weight_bytes import bnb_dequantize_bytes
from shardfit.plan.workload import Workload

Z3 = ZeroSettings(stage=3)
Z2 = ZeroSettings(stage=2)
FULL = Workload(method="full", precision="bf16", seq_len=32768, micro_batch=1, grad_ckpt="full", loss="full")


def _total(b) -> float:  # noqa: ANN001
    return b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries


def test_long_rows_hold_the_residual_stream_s_gradient_at_a_block_s_end() -> None:
    """At 32,768 tokens the last block's backward peaks with the residual stream's gradient beside the engine's
    temporaries (the block's gathered weights and unreduced gradients): 8 bytes a token and hidden unit, which the
    DeepSpeed twin of the moments never counted."""
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    m = zero_memory(shape, FULL, 8, Z3)
    blocks = step_candidates(shape, FULL, "zero3", zero_rank(shape, FULL, 8, Z3, m))["backward"][1]
    assert blocks.temporaries == pytest.approx(m.bwd_temp + FULL.tokens * shape.hidden * 8)


@pytest.mark.parametrize("z", [Z2, Z3], ids=["zero2", "zero3"])
def test_the_gradients_follow_the_engine_s_buffers(z: ZeroSettings) -> None:
    """ZeRO-3's reduce bucket and 16-bit partition are allocated once and held at every moment; ZeRO-1/2 allocate
    the bucket when backward begins and keep no partition through the forward of a one-micro-batch step."""
    shape = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    w = dataclasses.replace(FULL, seq_len=2048)
    m = zero_memory(shape, w, 8, z)
    moments = step_candidates(shape, w, "zero3" if z.stage == 3 else "zero2", zero_rank(shape, w, 8, z, m))
    bucket = z.reduce_bucket_size * 2
    forward, at_loss = moments["forward"][0].grads, moments["backward"][0].grads
    if z.stage == 3:
        assert forward == at_loss == m.grad_part + bucket
    else:
        assert forward == 0.0 and at_loss == bucket
    assert moments["backward"][1].grads == m.grad_part + bucket


def test_a_deepspeed_qlora_dequantizes_in_backward() -> None:
    """A QLoRA under ZeRO-3: its backward dequantizes each 4-bit weight again, as under every engine (bitsandbytes'
    Linear4bit does it whoever wraps the model), so the plan's backward holds that weight in 16 bits, at the down
    projection's backward (the block's activations as they stand then), not over the whole block's."""
    from shardfit.plan.activations import activation_bytes

    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    w = Workload(method="qlora", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="full",
                 quant_backend="bnb", loss="full")
    m = zero_memory(shape, w, 2, Z3)
    r = zero_rank(shape, w, 2, Z3, m)
    backward = step_candidates(shape, w, "zero3", r)["backward"]
    assert dequantize_bytes(shape, w, "zero3") > 14336 * 4096 * 2
    held = [b for b in backward if b.temporaries == pytest.approx(m.bwd_temp + dequantize_bytes(shape, w, "zero3")
                                                                 + w.tokens * shape.hidden * 8)]
    assert len(held) == 1
    assert held[0].activations == pytest.approx(activation_bytes(shape, w, r.layers, "zero3", at_down_backward=True))


def test_logits_a_loop_keeps_count_under_deepspeed_too() -> None:
    """A hand loop that keeps the step's fp32 logits into the next (`keeps_logits`) holds them through backward
    and the optimizer step under DeepSpeed as under FSDP."""
    shape = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    w = dataclasses.replace(FULL, seq_len=4096)
    hw = parse_gpus("8x80GB")
    plain = estimate_deepspeed(shape, w, hw, Z3)
    kept = estimate_deepspeed(shape, dataclasses.replace(w, keeps_logits=True), hw, Z3)
    logits = w.tokens * shape.vocab * 4 / GIB
    assert kept.extra["optimizer_step_gib"] == pytest.approx(plain.extra["optimizer_step_gib"] + logits)
    assert _total(kept.per_gpu_gib) >= _total(plain.per_gpu_gib) + logits - 1e-6


@pytest.mark.parametrize("fused", [False, True])
def test_experts_of_their_own_dequantize_one_at_a_time(fused: bool) -> None:
    """Mixtral's experts as transformers 4 builds them (an MLP module per expert, `fused_experts` off) are each a
    4-bit linear layer, dequantized alone; transformers 5's fused stack (shardfit's torchao QLoRA quantizes it
    whole) into one 16-bit value, an expert's gate and up projections at a time (models/quantize_experts.py). The
    gradient of the layer's input is made beside it: the input of w2 (down, 14,336 features) apart, of the gate/up
    stack (4,096) fused."""
    shape = resolve_shape("mistralai/Mixtral-8x7B-v0.1")
    w = Workload(method="qlora", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="full", fused_experts=fused)
    expert = 14336 * 4096
    weight = 16 * expert * 2 + dequantize_peak_bytes(2 * expert, 2) if fused else dequantize_peak_bytes(expert, 2)
    assert dequantize_bytes(shape, w) == weight + w.tokens * (4096 if fused else 14336) * 2


def test_lightning_s_experts_dequantize_gate_and_up_apart() -> None:
    """Under Lightning's BitsandbytesPrecision every nn.Linear of litgpt's Mixtral is NF4, and each expert is a
    LLaMAMLP with fc_1 (gate) and fc_2 (up) apart: the largest weight one dequantization writes is one expert's
    14,336 x 4,096 projection (down, whose input is the wider), not the 28,672-row gate/up pair."""
    shape = resolve_shape("mistralai/Mixtral-8x7B-v0.1")
    w = Workload(method="qlora", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="full", bnb_precision=True,
                 untied_head=True)
    assert dequantize_bytes(shape, w) == bnb_dequantize_bytes(14336 * 4096, w) + w.tokens * 14336 * 2
