"""expert_parallel's refusals (resolve/experts_rules.py): what this version shares out, and the exit-2 messages."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from shardfit.config import Config
from shardfit.config.schema import LoraSettings
from shardfit.errors import UserError
from shardfit.resolve.dims import ParallelDims
from shardfit.resolve.experts_rules import check_ep_config, check_ep_layout, check_ep_model
from shardfit.resolve.job import Resolved


def _cfg(n: int = 2, **over) -> Config:
    return dataclasses.replace(Config(), expert_parallel=n, **{"method": "full", **over})


def test_layouts_accepted() -> None:
    check_ep_layout(_cfg(), "ddp", 2)
    check_ep_layout(_cfg(), "zero3", 2)  # the experts left out of FSDP2's sharding
    check_ep_layout(_cfg(2), "ddp", 4)  # 2 expert groups of 2
    check_ep_layout(_cfg(method="lora", lora=LoraSettings(experts=False)), "ddp", 4)
    check_ep_layout(_cfg(method="lora"), "zero3", 2)  # LoRA on the routed experts: sliced with them
    check_ep_layout(dataclasses.replace(Config(), expert_parallel=1), "single", 1)  # off: nothing to check
    check_ep_model(4, 8, "m")
    check_ep_model(1, 1, "dense")


@pytest.mark.parametrize("cfg,strategy,world,words", [
    (_cfg(), "single", 1, "(ddp, zero2, zero3), not single"),
    (_cfg(), "model_parallel", 1, "not model_parallel"),
    (_cfg(4), "ddp", 6, "expert_parallel: 4 must divide the 6 data-parallel ranks"),
    (_cfg(), "zero3_offload", 2, "not zero3_offload"),
    (_cfg(method="qlora"), "ddp", 2, "does not train qlora"),
    (_cfg(method="freeze"), "ddp", 2, "lora or full in this version, not freeze"),
    (_cfg(objective="dpo"), "ddp", 2, "objective sft only"),
    (_cfg(compile=True), "ddp", 2, "compile: false"),
    (_cfg(eval_metrics=["exact"]), "ddp", 2, "drop eval_metrics"),
    (_cfg(sequence_parallel=2), "ddp", 4, "set sequence_parallel: 1"),
])
def test_layouts_refused(cfg: Config, strategy: str, world: int, words: str) -> None:
    with pytest.raises(UserError) as e:
        check_ep_layout(cfg, strategy, world)
    fix = "expert_parallel: 1" if "must divide" not in words else "use one of 1, 2, 3, 6"
    assert words in str(e.value) and fix in str(e.value), str(e.value)


@pytest.mark.parametrize("n,experts,kw,words", [
    (2, 1, {}, "is a dense model"),
    (3, 4, {}, "4 routed experts per block, which 3 ranks cannot share out evenly (each holds experts/3): use an "
               "expert_parallel that divides 4 (2, 4)"),
    (16, 8, {}, "divides 8 (2, 4, 8)"),
    (2, 16, {"every_expert": True}, "every token through every expert"),
    (2, 8, {"multimodal": True}, "vision or audio tower"),
])
def test_models_refused(n: int, experts: int, kw: dict, words: str) -> None:
    with pytest.raises(UserError) as e:
        check_ep_model(n, experts, "m", **kw)
    assert words in str(e.value), str(e.value)


def test_built_configs() -> None:
    """The built model's config: Qwen3-MoE's num_experts, DeepSeek's n_routed_experts, a dense Qwen3."""
    check_ep_config(2, AutoConfig.for_model("qwen3_moe", num_experts=4), "q")
    check_ep_config(4, AutoConfig.for_model("deepseek_v3", n_routed_experts=8), "d")
    with pytest.raises(UserError, match="dense model"):
        check_ep_config(2, AutoConfig.for_model("qwen3"), "q")
    with pytest.raises(UserError, match="every token through every expert"):
        check_ep_config(2, AutoConfig.for_model("llama4_text", num_local_experts=4), "l")


def test_the_resolved_job_carries_the_experts_dimension() -> None:
    """`Resolved.dims` hands expert_parallel to the layout: rank 3 of 4 is the second of its expert pair."""
    job = dataclasses.replace(_resolved(), expert_parallel=2)
    assert job.dims == ParallelDims(world=4, ep=2) and job.dims.ep_rank(3) == 1
    assert "experts over 2" in job.describe()
    assert Resolved.from_json(job.to_json()) == job


def _resolved() -> Resolved:
    from shardfit.plan.hardware import Hardware
    from shardfit.resolve.job import RowShape

    return Resolved(strategy="ddp", method="full", nproc_per_node=4, nnodes=1, device="cpu", precision="fp32",
                    autocast=None, compile=False, attention="auto", eager_max_width=0,
                    rows=RowShape(limit=64, micro_batch=1), loss_chunk=None,
                    hardware=Hardware(nodes=1, gpus_per_node=4, gpu_mem_gib=8.0, name="cpu"))
