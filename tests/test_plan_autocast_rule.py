"""One autocast rule (plan/precision.py `runs_autocast`) for the memory model, the host's launches of shardfit's
own runner (plan/dispatch.py, through `autocast_launches`) and the runner itself (resolve/decide.py): no autocast
under its FSDP2 (it casts the parameters) or beside its bf16 adapters; a tool's engine autocasts wherever it mixes
precision. The fp32 expert stacks bitsandbytes leaves unquantized reach the grouped matmul in bf16 where the engine
gathers 16-bit parameters (FSDP, accelerate's too, and DeepSpeed)."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit import strategy as strategies
from shardfit.config import Config, LoraSettings
from shardfit.plan.cards import card_of
from shardfit.plan.dispatch import dispatch_ops_per_layer, engine_host_s, host_dispatch_s
from shardfit.plan.flops import fp32_expert_flops
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.precision import autocast_launches, runs_autocast
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.step_ops import step_host_s
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload, model_workload, workload_of
from shardfit.resolve import DeviceFacts, resolve_job

LORA = Workload(method="lora", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="full")
OWN = dataclasses.replace(LORA, tool_autocast=False)  # shardfit's runner (`workload_of`)
NAMES = [s.name for s in strategies.TABLE]


@pytest.mark.parametrize("strategy", NAMES)
def test_shardfit_s_launches_follow_the_memory_model_s_autocast(strategy: str) -> None:
    """Every strategy: shardfit's own host launches autocast's casts exactly where its runner autocasts (the job
    resolve_job makes of fp32 or bf16 adapters and of a full fine-tune); a bf16 LoRA under its zero3 launches
    fewer kernels than under ddp (FSDP2 casts the parameters), a tool's job under FSDP as many as under ddp
    (accelerate and Lightning autocast there)."""
    gpus = parse_gpus("1xH100" if strategy == "single" else "2xH100", 1, None)
    for method, lora in (("lora", LoraSettings()), ("lora", LoraSettings(dtype="bf16")), ("full", LoraSettings())):
        cfg = Config(model="HuggingFaceTB/SmolLM2-135M-Instruct", method=method, strategy=strategy,
                     precision="bf16", lora=lora)
        job, _ = resolve_job(cfg, gpus, DeviceFacts("cuda", True))
        own = dataclasses.replace(workload_of(cfg), adapters_16bit=job.adapter_dtype == "bf16")
        assert autocast_launches(own, strategy) == (job.autocast is not None)
    sharded = strategies.get(strategy).sharded
    assert (dispatch_ops_per_layer(OWN, strategy=strategy)[0] < dispatch_ops_per_layer(OWN)[0]) == sharded
    assert dispatch_ops_per_layer(LORA, strategy=strategy) == dispatch_ops_per_layer(LORA)


def test_a_host_bound_fsdp_lora_step_of_shardfit_has_no_autocast_launches() -> None:
    """Qwen2.5-0.5B LoRA on 8 H100s at 512 tokens (host-bound, shardfit's `plan --model`): the zero3 row's
    launches are those of a run without autocast (its bf16 adapters on one GPU launch the same), fewer than ddp's,
    and the step's host time is those, FSDP2's own and the optimizer step's."""
    shape, hw = resolve_shape("Qwen/Qwen2.5-0.5B-Instruct"), parse_gpus("8xH100", 1, None)
    bare = host_dispatch_s(shape, dataclasses.replace(OWN, adapters_16bit=True))
    assert host_dispatch_s(shape, OWN, "zero3") == pytest.approx(bare)
    assert host_dispatch_s(shape, OWN, "ddp") > bare
    engine = engine_host_s(shape, OWN, strategies.get("zero3"))
    step_host = step_host_s(shape, OWN, card_of(hw))  # the optimizer step's own launches, once a step
    assert step_time(shape, OWN, hw, "zero3").host_s == pytest.approx(bare + engine + step_host)
    assert not model_workload().tool_autocast


def test_the_config_s_bf16_adapters_reach_the_plan_and_the_runner_reads_the_same_rule() -> None:
    """`lora.dtype: bf16` is planned as 16-bit adapters (`workload_of`), and the runner's autocast is the
    planner's predicate: none for bf16 adapters or under zero3, bf16 for fp32 adapters under single."""
    cfg = Config(model="HuggingFaceTB/SmolLM2-135M-Instruct", lora=LoraSettings(rank=8, alpha=16, dtype="bf16"))
    assert workload_of(cfg).adapters_16bit and not workload_of(Config()).adapters_16bit
    assert not runs_autocast(workload_of(cfg), "single") and runs_autocast(workload_of(Config()), "single")
    gpu = DeviceFacts("cuda", True)
    for strategy, lora, want in (("single", cfg.lora, None), ("single", LoraSettings(), "bf16"),
                                 ("zero3", LoraSettings(), None)):
        job, _ = resolve_job(dataclasses.replace(cfg, strategy=strategy, lora=lora),
                             parse_gpus("2xH100" if strategy == "zero3" else "1xH100"), gpu)
        assert job.autocast == want


def test_fp32_experts_are_timed_only_where_the_engine_keeps_them_fp32() -> None:
    """Qwen3-30B-A3B bitsandbytes QLoRA with peft's upcast: single charges its experts' fp32 matmuls; under zero3
    FSDP gathers them in bf16, so the row's step does not move with `frozen_fp32` (bnbtime review, finding 1)."""
    shape, hw = resolve_shape("Qwen/Qwen3-30B-A3B"), parse_gpus("8xH100", 1, None)
    w = Workload(method="qlora", precision="bf16", seq_len=2048, micro_batch=4, grad_ckpt="full",
                 quant_backend="bnb", frozen_fp32=True)
    assert fp32_expert_flops(shape, w) > 0 and fp32_expert_flops(shape, w, "zero3") == 0
    bf16 = dataclasses.replace(w, frozen_fp32=False)
    assert step_time(shape, w, hw, "zero3").step_s == pytest.approx(step_time(shape, bf16, hw, "zero3").step_s,
                                                                     rel=0.02)
    assert step_time(shape, w, hw, "single").step_s > 2 * step_time(shape, bf16, hw, "single").step_s
