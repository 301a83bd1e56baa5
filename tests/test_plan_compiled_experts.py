"""bitsandbytes QLoRA of a mixture under torch_compile: transformers sends the fp32 expert stacks peft upcast to
its own fallback op, whose backward computes every stack's weight gradient, frozen or not (transformers 5.23
integrations/moe.py `_can_use_grouped_mm` l.323, `_grouped_mm_fallback_bwd` l.236-256). The plan counts that
gradient's FLOPs, its mm per expert and its whole-stack temporary, from one rule (plan/flops.py
`expert_weight_grad_stacks`; review s65, finding R1)."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.plan.backward_temps import expert_weight_grad_bytes
from shardfit.plan.estimate import estimate
from shardfit.plan.flops import (
    expert_weight_grad_stacks,
    fp32_expert_flops,
    fp32_expert_mms,
    fp32_grouped_mm_calls,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

GIB = 2**30
QWEN3_MOE = resolve_shape("Qwen/Qwen3-30B-A3B")
H200 = parse_gpus("1xH200", 1, None)
# axolotl's `lora_target_linear` on transformers 5: attention adapted, the expert stacks not
EAGER = Workload(method="qlora", precision="bf16", seq_len=2048, micro_batch=1, grad_ckpt="full", quant_backend="bnb",
                 frozen_fp32=True, lora_experts=False, lora_targets=("q", "k", "v", "o"))
COMPILED = dataclasses.replace(EAGER, compile=True)


def test_the_compiled_fallback_computes_every_stack_s_weight_gradient() -> None:
    """Eager, a frozen stack's backward is its input gradient alone; compiled, every stack's weight gradient too:
    one forward's worth more per backward layer (a third more fp32-expert FLOPs with full checkpointing), one
    more mm per expert, and still one offsets read-back per stack and backward (one op for both gradients)."""
    assert expert_weight_grad_stacks(QWEN3_MOE, EAGER) == ()
    assert set(expert_weight_grad_stacks(QWEN3_MOE, COMPILED)) == {"expert_gate_up", "expert_down"}
    eager, compiled = fp32_expert_flops(QWEN3_MOE, EAGER), fp32_expert_flops(QWEN3_MOE, COMPILED)
    assert compiled == pytest.approx(eager * 4 / 3, rel=1e-9)  # passes: fwd + recompute + dgrad (+ wgrad)
    layers, experts = QWEN3_MOE.moe_layers, QWEN3_MOE.experts
    assert fp32_grouped_mm_calls(QWEN3_MOE, COMPILED) == fp32_grouped_mm_calls(QWEN3_MOE, EAGER) == 6 * layers
    assert fp32_expert_mms(QWEN3_MOE, EAGER) == 6 * layers * experts
    assert fp32_expert_mms(QWEN3_MOE, COMPILED) == 8 * layers * experts


def test_the_compiled_fallback_s_step_is_slower_and_holds_a_stack_s_gradient() -> None:
    """One H200: the compiled step takes the weight gradients' fp32 FLOPs and 12,288 more mm launches a
    micro-batch; its backward holds the largest stack's fp32 gradient (gate/up: 128 x 2048 x 1536 x 4 bytes,
    1.5 GiB) beside the block's tensors. A stack FSDP hands the step in bf16 takes torch's grouped kernel: none
    of it."""
    eager, compiled = step_time(QWEN3_MOE, EAGER, H200, "single"), step_time(QWEN3_MOE, COMPILED, H200, "single")
    more_mms = 2 * QWEN3_MOE.moe_layers * QWEN3_MOE.experts
    assert more_mms == 12_288
    assert compiled.host_s > eager.host_s
    c = estimate(QWEN3_MOE, COMPILED, H200, "single")
    assert c.peak_phase == "backward"
    stack = QWEN3_MOE.experts * QWEN3_MOE.hidden * 2 * QWEN3_MOE.expert_width * 4
    assert stack / GIB == pytest.approx(1.5)
    eager_temps = estimate(QWEN3_MOE, EAGER, H200, "single").per_gpu_gib.temporaries
    assert eager_temps < 0.1  # the residual stream's gradient and one attention weight's dequantization
    assert c.per_gpu_gib.temporaries - eager_temps == pytest.approx(stack / GIB, abs=0.05)
    assert expert_weight_grad_stacks(QWEN3_MOE, COMPILED, "zero3") == ()


def test_a_folded_stack_s_backward_makes_the_merged_stack_s_gradient() -> None:
    """LoRA folded into a fused expert stack (peft's `_LoraFactorsProxy.forward`: `baddbmm(W, lhs, rhs)`), eager
    too: the grouped matmul's backward returns the merged stack's whole gradient, in its dtype, before the baddbmm
    turns it into A's and B's (seen here on torch's CPU grouped_mm). Qwen3-30B-A3B bf16 LoRA on every expert
    stack on one H200: the backward holds the gate/up stack's bf16 gradient (0.75 GiB) beside the block's
    tensors; with the experts not adapted, none (review s65, noticed and confirmed)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    experts, width_in, width_out, rank = 4, 16, 32, 2
    frozen = torch.randn(experts, width_in, width_out)
    lhs = torch.randn(experts, width_in, rank, requires_grad=True)
    rhs = torch.zeros(experts, rank, width_out, requires_grad=True)
    merged = torch.baddbmm(frozen, lhs, rhs, alpha=2.0)
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    merged.register_hook(lambda g: seen.append((tuple(g.shape), g.dtype)))
    x = torch.randn(12, width_in, requires_grad=True)
    out = F.grouped_mm(x, merged, offs=torch.tensor([3, 6, 9, 12], dtype=torch.int32))
    out.backward(torch.randn_like(out))
    assert seen == [((experts, width_in, width_out), torch.float32)]

    lora = Workload(method="lora", precision="bf16", seq_len=2048, micro_batch=1, grad_ckpt="full")
    attention_only = dataclasses.replace(lora, lora_experts=False, lora_targets=("q", "k", "v", "o"))
    assert set(expert_weight_grad_stacks(QWEN3_MOE, lora)) == {"expert_gate_up", "expert_down"}
    stack = QWEN3_MOE.experts * QWEN3_MOE.hidden * 2 * QWEN3_MOE.expert_width * 2
    folded, plain = estimate(QWEN3_MOE, lora, H200, "single"), estimate(QWEN3_MOE, attention_only, H200, "single")
    assert folded.peak_phase == plain.peak_phase == "backward"
    assert folded.per_gpu_gib.temporaries - plain.per_gpu_gib.temporaries == pytest.approx(stack / GIB, rel=1e-6)


def test_a_dense_mlp_computes_no_expert_stack_gradient() -> None:
    """A dense model's MLP is named as one expert's stacks in the shape, but it is plain nn.Linear layers under
    LoRA: no stack's weight gradient is made whole, so no backward temporary, compiled or not (a dense 72B's
    LoRA on every linear once read 0.9 GiB more here)."""
    shape = resolve_shape("Qwen/Qwen2-VL-72B-Instruct")
    for compile_ in (False, True):
        w = Workload(method="lora", seq_len=2048, grad_ckpt="full", compile=compile_)
        assert expert_weight_grad_stacks(shape, w, "single") == ()
        assert expert_weight_grad_bytes(shape, w, "single") == 0.0
