"""A LoRA run whose model loaded in fp32 under 16-bit autocast (`loaded_fp32`: TRL's ModelConfig default): each
frozen weight's 16-bit cast is not in autocast's cache (torch caches casts of leaf tensors that require grad only),
it lives on as the matmul's saved tensor, so checkpointed blocks keep none of them in forward and only the
recomputed block's in backward; without checkpointing every block keeps its casts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardfit.plan.activations import activation_bytes, forward_activation_bytes, weight_cast_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

STRATEGY = "single"


def _w(ckpt: str) -> Workload:
    return Workload(method="lora", precision="bf16", grad_ckpt=ckpt, seq_len=1024, micro_batch=1,
                    frozen_fp32=True, loaded_fp32=True)


def test_autocast_caches_only_casts_of_weights_that_require_grad() -> None:
    """The mechanism, on torch itself: within one autocast region two matmuls over a trainable fp32 weight save the
    same cached 16-bit copy; over a frozen one each saves a copy of its own (as many copies as uses)."""
    x = torch.randn(2, 4, requires_grad=True)
    for trainable, copies in ((True, 1), (False, 2)):
        weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=trainable)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, into=saved: into.append(t) or t, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.linear(x, weight)
            torch.nn.functional.linear(x, weight)
        casts = {t.untyped_storage().data_ptr() for t in saved if t.shape == (4, 4) and t.dtype == torch.bfloat16}
        assert len(casts) == copies, (trainable, len(casts))


def test_checkpointed_forward_keeps_no_frozen_weight_casts() -> None:
    shape = resolve_shape("Qwen/Qwen2.5-7B")
    ckpt, bare = _w("full"), _w("none")
    casts = 2 * shape.decoder_params()
    plain = dataclasses.replace(ckpt, loaded_fp32=False, frozen_fp32=False)
    # checkpointed: the forward's peak holds no cast of the frozen weights (it did hold the whole body's: 13 GiB)
    assert forward_activation_bytes(shape, ckpt, shape.layers, STRATEGY) < casts / 4
    # backward: the recomputed block's casts only, as its saved tensors
    assert weight_cast_bytes(shape, ckpt, STRATEGY) == pytest.approx(2 * shape.layer_params())
    assert activation_bytes(shape, ckpt, shape.layers, STRATEGY) < casts / 4
    # without checkpointing every block keeps its casts for its inputs' gradients
    assert forward_activation_bytes(shape, bare, shape.layers, STRATEGY) - \
        forward_activation_bytes(shape, dataclasses.replace(bare, loaded_fp32=False), shape.layers, STRATEGY) >= \
        casts * 0.9
    assert forward_activation_bytes(shape, plain, shape.layers, STRATEGY) < casts / 4


def test_fsdp_gathers_an_fp32_loaded_block_in_the_compute_dtype() -> None:
    """Under FSDP the frozen fp32 weights are stored fp32 on each rank's shard, but MixedPrecision's param_dtype
    gathers every unit in bf16: the gathered temporaries are those of a bf16 load."""
    from shardfit import strategy as strategies
    from shardfit.plan.estimate import per_rank
    from shardfit.plan.hardware import parse_gpus

    shape, hw, s = resolve_shape("Qwen/Qwen2.5-7B"), parse_gpus("4xH100"), strategies.get("zero3")
    fp32, bf16 = _w("full"), dataclasses.replace(_w("full"), loaded_fp32=False, frozen_fp32=False)
    a, b = per_rank(shape, fp32, hw, s), per_rank(shape, bf16, hw, s)
    assert a.fwd_temp == pytest.approx(b.fwd_temp) and a.weights > 1.9 * b.weights
