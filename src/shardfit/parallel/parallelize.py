"""Make a training module ready for its strategy, in one order (as torchtitan's `parallelize_llama` reads, its
model converters first): FP8 linear layers -> activation checkpointing -> compiled blocks -> the strategy's engine
(DDP, or FSDP2 `fully_shard` per unit).

`train` and `plan --simulate` both call `parallelize`; the simulation passes a mesh over a fake process group.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardfit.dtypes import DTYPES
from shardfit.models.anatomy import audio_units, transformer_blocks, untied_input_embedding, vision_units
from shardfit.models.checkpointing import enable_checkpointing
from shardfit.parallel.compile import compile_blocks
from shardfit.parallel.float8 import convert_to_float8
from shardfit.parallel.pipeline import DecoderStage
from shardfit.strategy import Strategy

log = logging.getLogger(__name__)



def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own, in order: a vision-language model's vision blocks and merger, an audio
    tower's layers (Qwen2.5-Omni), every decoder block, then an untied input embedding. Everything else (the head,
    the final norm, the patch embedding, the audio tower's convolutions) is the root unit. A large-vocabulary
    model's embedding is as big as several blocks; in the root it would stay gathered for the whole step, on its
    own it is freed right after use."""
    emb = untied_input_embedding(model)
    return vision_units(model) + audio_units(model) + transformer_blocks(model) + ([emb] if emb is not None else [])


def mp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for a config precision: low-precision compute and all-gathers, fp32 gradient
    reduction (the numerically safe choice)."""
    dtype = DTYPES[precision] if precision in ("bf16", "fp16") else None
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(module: nn.Module, model: nn.Module, s: Strategy, mesh: DeviceMesh, precision: str,
          ignored: set[nn.Parameter] | None = None) -> None:
    """`fully_shard` each unit of `model`, then `module` (the root holding the loss), with the strategy's
    resharding and offload and the precision's mixed-precision policy; `ignored`: parameters left to the caller
    (expert parallelism's experts: neither sharded nor reduced)."""
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy(precision),
                              "reshard_after_forward": s.reshard_after_forward}
    if ignored:
        kwargs["ignored_params"] = ignored
    if s.offload and mesh.device_type != "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # A pipeline stage names its own units: the blocks it kept (and the input embedding on the first stage).
    units = module.fsdp_units() if isinstance(module, DecoderStage) else fsdp_units(model)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """Move `module` to `device` unless every tensor is there already (then moving would only copy; under
    `plan --simulate` it would swap fake tensors that are already in place)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device != device for t in tensors):
        module.to(device)
    return module


def parallelize(module: nn.Module, s: Strategy, *, device: torch.device, world: int, precision: str,
                grad_ckpt: str = "none", compile: bool = False, mesh: DeviceMesh | None = None,
                ignored: set[nn.Parameter] | None = None, float8: bool = False) -> nn.Module:
    """Checkpoint, compile and wrap `module` (a loss module holding the model as `.model`) for strategy `s` on
    `world` ranks; returns the module to call and step. `mesh` defaults to one over the rank's device type; given,
    it is also DDP's group (a pipeline stage's data-parallel ranks).
    `ignored`: parameters FSDP2 leaves whole and unreduced (DDP is told by parallel/experts.py). `float8`: the
    decoder blocks' linear layers compute in FP8 (parallel/float8.py), swapped before anything wraps them."""
    model = module.model
    if float8:
        convert_to_float8(model, device)
    if grad_ckpt != "none":
        enable_checkpointing(model, selective=grad_ckpt == "selective")
    if compile:
        compile_blocks(model)  # after checkpointing and before FSDP2, as torchtitan orders them
    if s.engine == "device_map":
        return module  # from_pretrained placed the modules
    if world == 1 or s.engine == "plain":
        return place(module, device)
    if s.engine == "ddp":
        place(module, device)
        ids = [device.index] if device.type == "cuda" else None
        # Gradients as views into DDP's buckets: one copy of them instead of two.
        return DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True,
                                       process_group=mesh.get_group() if mesh is not None else None)
    if s.sharded:
        if s.offload and device.type == "cpu":
            log.info("%s on CPU: shards already live in host memory, running as zero3", s.name)
        if not (s.offload and device.type != "cpu"):
            place(module, device)
        shard(module, model, s, mesh if mesh is not None else init_device_mesh(device.type, (world,)), precision,
              ignored)
        return module
    raise ValueError(f"strategy {s.name}: engine {s.engine} has no branch in parallelize")


def micro_batch_sync(model: nn.Module, last: bool) -> Any:
    """The context for one micro-batch's forward and backward (`last`: the optimizer step's own). DDP: `no_sync()`
    on every other micro-batch (its gradients are whole on every rank either way, so skipping the all-reduce costs
    no memory). FSDP2 reduce-scatters every micro-batch: told not to, each parameter would keep its unsharded
    gradient in the reduce dtype (fp32) on every rank until the optimizer step (FSDPParam
    .to_accumulated_grad_if_needed), a full fine-tune's whole fp32 gradient per rank, which is what zero3 exists to
    avoid and what the plan does not count. torchtitan makes the same choice (pytorch/torchtitan#292, #1710)."""
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()
