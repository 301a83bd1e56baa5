"""One count of optimizer states per trainable weight on every path of the plan: single, FSDP, ZeRO (DeepSpeed),
the pipeline's parts outside the blocks and expert parallelism's share of the experts."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.plan.adapters import lora_expert_params
from shardfit.plan.deepspeed import ZeroSettings, zero_memory
from shardfit.plan.estimate import estimate, trainable_params
from shardfit.plan.experts import routed_expert_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.optimizer_states import fp32_state_params, optimizer_state_bytes
from shardfit.plan.pipeline import _part_gib, stage_breakdown
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

GIB = 2**30
FULL = Workload(method="full", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="full", fused_adamw=True)
# (workload overrides, bytes of states per trainable weight): fp32 AdamW moments of fp32 masters, bitsandbytes'
# 8-bit states with an fp32 absmax per 256 elements each, its 32-bit states (fp32 whatever the weight's dtype).
OPTIMIZERS = [({"optimizer": "adamw"}, 8.0), ({"optimizer": "adamw8bit"}, 2 * (1 + 4 / 256)),
              ({"optimizer": "adamw", "bnb_optimizer": True}, 8.0)]


@pytest.mark.parametrize(("over", "per_weight"), OPTIMIZERS)
def test_every_path_counts_the_same_optimizer_bytes_per_trainable_weight(over: dict, per_weight: float) -> None:
    """Mixtral full fine-tune on 8 H100s: single, zero3 (FSDP) x 8, ZeRO-3 x 8 less its fp32 masters, the
    pipeline's trained parts and what expert parallelism (8) moves off a ddp rank all give the same bytes per
    trained weight."""
    shape, hw = resolve_shape("mistralai/Mixtral-8x7B-v0.1"), parse_gpus("8xH100", 1, None)
    w = dataclasses.replace(FULL, **over)
    t = trainable_params(shape, w)
    assert optimizer_state_bytes(w) == pytest.approx(per_weight)
    single = estimate(shape, w, hw, "single").per_gpu_gib.optimizer * GIB / t
    fsdp = estimate(shape, w, hw, "zero3").per_gpu_gib.optimizer * GIB * 8 / t
    zero = zero_memory(shape, w, 8, ZeroSettings(stage=3))
    deepspeed = (zero.states - 4 * t / 8) * 8 / t
    pipe = _part_gib(1000, True, w)[2] * GIB / 1000
    one = estimate(shape, w, hw, "ddp").per_gpu_gib.optimizer
    ep = estimate(shape, dataclasses.replace(w, expert_parallel=8), hw, "ddp").per_gpu_gib.optimizer
    moved = (one - ep) * GIB / (routed_expert_params(shape) * 7 / 8)
    for got in (single, fsdp, deepspeed, pipe, moved):
        assert got == pytest.approx(per_weight, rel=1e-6)
    assert ep > 0


@pytest.mark.parametrize(("over", "per_weight"), OPTIMIZERS)
def test_expert_parallel_lora_with_16bit_adapters_moves_what_was_counted(over: dict, per_weight: float) -> None:
    """LoRA with 16-bit adapters on the experts: expert parallelism moves 7/8 of the expert adapters' states at
    the optimizer's own bytes per weight (fp32 for bitsandbytes' 32-bit AdamW, the adapters' bf16 for torch's), never
    more than the rank held, and leaves every row's optimizer column positive."""
    shape, hw = resolve_shape("mistralai/Mixtral-8x7B-v0.1"), parse_gpus("8xH100", 1, None)
    w = dataclasses.replace(FULL, method="lora", adapters_16bit=True, **over)
    per = optimizer_state_bytes(w)
    if over == {"optimizer": "adamw"}:
        assert per == 4.0  # torch AdamW's moments in the adapters' own bf16
    adapters = lora_expert_params(shape, w)
    for strategy in ("ddp", "zero2", "zero3"):
        one = estimate(shape, w, hw, strategy).per_gpu_gib.optimizer
        ep = estimate(shape, dataclasses.replace(w, expert_parallel=8), hw, strategy).per_gpu_gib.optimizer
        assert 0 < ep <= one
    one = estimate(shape, w, hw, "ddp").per_gpu_gib.optimizer
    ep = estimate(shape, dataclasses.replace(w, expert_parallel=8), hw, "ddp").per_gpu_gib.optimizer
    assert (one - ep) * GIB == pytest.approx(adapters * 7 / 8 * per, rel=1e-6)


@pytest.mark.parametrize(("over", "per_weight"), OPTIMIZERS)
def test_deepspeed_states_follow_the_one_rule_on_its_fp32_masters(over: dict, per_weight: float) -> None:
    """DeepSpeed's ZeRO optimizer steps its fp32 master partition, so its states per trained weight are
    `optimizer_state_bytes` of fp32 weights at every stage: the table's bytes for a full fine-tune and for LoRA
    adapters in fp32 or bf16 alike, where the other engines keep torch AdamW's moments in bf16 adapters' own dtype.
    A guard of the rule, not of a change (the pre-merge code gave the same bytes): it fails where DeepSpeed reads
    the adapters' own dtype (bf16 adapters under torch AdamW: 4 bytes, not 8), or where a single GPU reads fp32."""
    shape = resolve_shape("mistralai/Mixtral-8x7B-v0.1")
    for method, extra in (("full", {}), ("lora", {}), ("lora", {"adapters_16bit": True})):
        w = dataclasses.replace(FULL, method=method, **extra, **over)
        t = trainable_params(shape, w)
        assert optimizer_state_bytes(w, fp32_masters=True) == pytest.approx(per_weight)
        for stage in (1, 2, 3):
            zero = zero_memory(shape, w, 8, ZeroSettings(stage=stage))
            assert (zero.states - 4 * t / 8) * 8 / t == pytest.approx(per_weight, rel=1e-9)
    bf16_adapters = dataclasses.replace(FULL, method="lora", adapters_16bit=True, **over)
    t = trainable_params(shape, bf16_adapters)
    single = estimate(shape, bf16_adapters, parse_gpus("1xH100", 1, None), "single").per_gpu_gib.optimizer * GIB
    deepspeed = zero_memory(shape, bf16_adapters, 8, ZeroSettings(stage=2)).states * 8 - 4 * t
    if over == {"optimizer": "adamw"}:
        assert optimizer_state_bytes(bf16_adapters) == 4.0  # torch AdamW beside them, outside DeepSpeed
        assert single == pytest.approx(4.0 * t) and deepspeed == pytest.approx(8.0 * t)
    else:
        assert deepspeed == pytest.approx(single)


def test_a_stage_without_the_embedding_holds_none_of_its_fp32_8bit_states() -> None:
    """Llama-3-8B (untied) in two stages under the HF Trainer's 8-bit AdamW: the first stage holds the trained
    embedding's fp32 states (the Trainer's 32-bit override), the last (the head, an nn.Linear) none of them; the
    same for peft's trained copy of the embedding beside LoRA."""
    shape, hw = resolve_shape("meta-llama/Meta-Llama-3-8B"), parse_gpus("2xA100-80G", 1, None)
    extra = shape.vocab * shape.hidden * (8 - 2 * (1 + 4 / 256)) / GIB
    for w in (dataclasses.replace(FULL, optimizer="adamw8bit", grad_accum=4),
              dataclasses.replace(FULL, method="lora", optimizer="adamw8bit", grad_accum=4, lora_saved=("embed",))):
        trainer = dataclasses.replace(w, bnb_optimizer=True)
        for stage, added in ((0, extra), (1, 0.0)):
            plain = stage_breakdown(shape, w, hw, 2, stage, 16).optimizer
            assert stage_breakdown(shape, trainer, hw, 2, stage, 16).optimizer == pytest.approx(plain + added)
    lora = dataclasses.replace(FULL, method="lora", optimizer="adamw8bit", grad_accum=4, bnb_optimizer=True)
    saved = dataclasses.replace(lora, lora_saved=("embed",))
    assert stage_breakdown(shape, saved, hw, 2, 1, 16).optimizer == \
        pytest.approx(stage_breakdown(shape, lora, hw, 2, 1, 16).optimizer)


def test_a_stage_s_embedding_states_are_those_the_estimate_added() -> None:
    """A trained input embedding under the HF Trainer's 8-bit bitsandbytes AdamW: fp32 states where the estimate
    adds them (`fp32_state_params`), and a pipeline stage's parts take away the same width; under FSDP1's flat
    parameters the estimate adds none (the Trainer's override matches no flat parameter), so a stage without the
    embedding takes away 8-bit states, never more than were counted (review s65, finding R5)."""
    shape = resolve_shape("Qwen/Qwen2.5-0.5B-Instruct")
    w = dataclasses.replace(FULL, optimizer="adamw8bit", bnb_optimizer=True)
    embed = shape.vocab * shape.hidden
    for flat in (False, True):
        v = dataclasses.replace(w, flat_params=flat)
        added = fp32_state_params(shape, v)
        part = _part_gib(embed, True, v, embedding=True)[2] * GIB / embed
        assert (added >= embed) == (not flat)
        assert part == pytest.approx(8.0 if not flat else optimizer_state_bytes(v), rel=1e-9)
