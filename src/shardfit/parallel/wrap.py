"""Wrap the loss module for a strategy with PyTorch's own engines: DDP, or FSDP2 `fully_shard`."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shardfit.parallel.env import DistEnv

log = logging.getLogger(__name__)

SHARDED = ("zero2", "zero3", "zero3_offload")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers: the natural FSDP units (one all-gather per block)."""
    from shardfit.train.loss import decoder_and_head

    decoder, _ = decoder_and_head(model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = next((m for m in decoder.modules() if isinstance(m, nn.ModuleList)), None)
    return list(layers) if layers is not None else []


def untied_input_embedding(model: nn.Module) -> nn.Module | None:
    """The input embedding when it does not share its weight with the output head (then it can be its own FSDP
    unit); None when tied, because a tied pair must stay in one unit."""
    from shardfit.train.loss import decoder_and_head

    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if emb is None or getattr(emb, "weight", None) is None:
        return None
    _, head = decoder_and_head(model)
    if head is None or getattr(head, "weight", None) is emb.weight:
        return None
    return emb


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules shardfit shards on their own, in order: every decoder block, then an untied input embedding.
    Everything else (the head, the final norm) is the root unit. A large-vocabulary model's embedding is as big as
    several blocks; in the root it would stay gathered for the whole step, on its own it is freed right after use."""
    units = transformer_blocks(model)
    emb = untied_input_embedding(model)
    return units + ([emb] if emb is not None else [])


def shard(module: nn.Module, model: nn.Module, **kwargs: Any) -> None:
    """`fully_shard` each unit of `model`, then `module` (the root holding the loss) with the same settings."""
    from torch.distributed.fsdp import fully_shard

    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)


def mp_policy(precision: str) -> Any:
    """FSDP2's mixed precision for a config precision (used by training and by `plan --simulate`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    # Low-precision compute and all-gathers, fp32 gradient reduction (the numerically safe choice).
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def wrap_model(module: nn.Module, strategy: str, env: DistEnv, precision: str) -> nn.Module:
    """Place and wrap `module` (a `CausalLMLoss`) for `strategy`; returns the module to call and step."""
    if strategy in ("single", "model_parallel") or not env.distributed:
        return module.to(env.device) if strategy != "model_parallel" else module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module.to(env.device)
        ids = [env.device.index] if env.device.type == "cuda" else None
        # Gradients as views into DDP's buckets: one copy of them instead of two.
        return DDP(module, device_ids=ids, gradient_as_bucket_view=True)
    if strategy in SHARDED:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        mesh = init_device_mesh(env.device.type, (env.world,))
        kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy(precision),
                                  "reshard_after_forward": strategy != "zero2"}
        if strategy == "zero3_offload" and env.device.type != "cpu":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        else:
            # On a CPU-only machine the shards already live in host memory: zero3_offload is zero3 there.
            if strategy == "zero3_offload" and env.is_main:
                log.info("zero3_offload on CPU: shards already live in host memory, running as zero3")
            module.to(env.device)
        shard(module, module.model, **kwargs)
        return module
    raise ValueError(f"unknown strategy {strategy}")


def set_grad_sync(model: nn.Module, enabled: bool) -> Any:
    """A context (DDP) or a flag (FSDP2) that skips gradient communication on non-final micro-batches."""
    import contextlib

    if hasattr(model, "no_sync"):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
