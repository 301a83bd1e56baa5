"""The strategy a running job uses for `strategy: auto`, and the refusal to start what cannot fit."""

from __future__ import annotations

from typing import Any

from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.build import format_table, make_plan
from shardfit.plan.estimate import Workload
from shardfit.plan.hardware import Hardware, detect, host_mem_gib
from shardfit.plan.shapes import ModelShape, resolve_shape

# transformers' attention implementations by what they keep: a dense mask (sdpa, and transformers' default) or not.
ATTENTION_MEMORY = {"eager": "eager", "flash_attention_2": "flash", "flex_attention": "flash"}


def workload_of(cfg: Any) -> Workload:
    """What the planner needs of a training config."""
    return Workload(method=cfg.method, precision=cfg.precision, seq_len=cfg.max_seq_len, micro_batch=cfg.micro_batch,
                    grad_ckpt=cfg.grad_ckpt, optimizer="adamw", lora_rank=cfg.lora.rank,
                    attention=ATTENTION_MEMORY.get(cfg.attn_implementation, "sdpa"), grad_accum=cfg.grad_accum)


def hardware_of(env: Any) -> Hardware:
    """This job's hardware: its GPUs, or on a CPU machine the host RAM shared by its ranks."""
    if env.device.type == "cuda":
        hw = detect()
        return Hardware(max(1, env.world // hw.gpus_per_node), min(hw.gpus_per_node, env.world), hw.gpu_mem_gib,
                        hw.cpu_mem_gib, hw.name)
    mem = host_mem_gib() or 16.0
    return Hardware(1, env.world, mem / env.world, mem, "cpu")


def shape_of_config(cfg: Any) -> tuple[ModelShape, str | None]:
    """The shape of a config's model, and the folder whose config.json a simulation can build from (None for
    GGUF and catalog-only ids). A bundled GGUF model's shape comes from the catalog under its hub id."""
    from shardfit.models.source import resolve_model

    source = resolve_model(cfg.model)
    if source.gguf_file:
        return resolve_shape(cfg.model), None
    return resolve_shape(source.folder), source.folder


def plan_for_run(cfg: Any, env: Any) -> dict | None:
    """The plan of a training run, or None when the model's shape cannot be read (e.g. a remote hub id)."""
    try:
        shape, _ = shape_of_config(cfg)
    except UserError:
        return None
    return make_plan(shape, workload_of(cfg), hardware_of(env))


def auto_strategy(cfg: Any, env: Any, plan: dict | None = None) -> str:
    """One process: `single`. Several ranks: the planner's fastest multi-rank strategy that fits."""
    if not env.distributed:
        return "single"
    plan = plan if plan is not None else plan_for_run(cfg, env)
    if plan is None:
        return "zero3"  # shape unknown: sharding is the choice that fits most
    multi = [c for c in plan["candidates"] if c["strategy"] in ("ddp", "zero2", "zero3", "zero3_offload")]
    for name in ("ddp", "zero2", "zero3", "zero3_offload"):
        if any(c["strategy"] == name and c["fits"] for c in multi):
            return name
    raise DoesNotFitError("no strategy fits this hardware.\n" + format_table(plan))


def refuse_if_oom(plan: dict | None, strategy: str, force: bool) -> None:
    """Exit 3 before loading when the plan predicts out-of-memory for the chosen strategy (unless `force`)."""
    if plan is None or force:
        return
    c = next((c for c in plan["candidates"] if c["strategy"] == strategy), None)
    if c is not None and not c["fits"]:
        raise DoesNotFitError(f"strategy {strategy} is predicted not to fit: {c['notes']} "
                              f"(set force: true to start anyway).\n" + format_table(plan))
