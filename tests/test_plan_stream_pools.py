"""The caching allocator's per-stream pools in a reading: FSDP makes each rank's gradient shards on its
reduce-scatter stream (FSDP1 `_reduce_grad`: `new_sharded_grad = torch.empty_like(chunks[0])` under the
post-backward stream; FSDP2 `foreach_reduce`: "the GPU sharded gradient is allocated in the RS stream"), and a
cached block serves only requests of the stream it was made on (c10/cuda/CUDACachingAllocator.cpp `get_free_block`:
`(*it)->stream != p.stream()` -> no). So on a card with room the two pools peak apart: what the compute stream
reserves at its own worst moment (the backward, where the gradient shards do not count) plus the gradient shards,
not the allocated peak of one moment (the optimizer step of a full fine-tune)."""

from __future__ import annotations

import pytest

from shardfit import strategy as strategies
from shardfit.plan import estimate as est
from shardfit.plan.estimate import (
    ALLOCATOR_CACHE,
    GIB,
    Breakdown,
    estimate,
    peak_reading,
    per_rank,
    planned_shape,
    planned_workload,
    step_candidates,
    step_moments,
    with_loss_chunk,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

MODEL = "mistralai/Mistral-7B-v0.1"


def _tensors(b: Breakdown) -> float:
    return b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries


def _pools(model: str, w: Workload, gpus: str, strategy: str) -> tuple[float, float, float]:
    """(the allocated peak, the compute stream's own peak, the gradient shards' peak), GiB, from the moments the
    estimate weighs, computed here apart from the planner's sum."""
    shape, hw = resolve_shape(model), parse_gpus(gpus)
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    phases = step_candidates(shape, w, strategy, per_rank(shape, w, hw, strategies.get(strategy))).values()
    moments = [m for ms in phases for m in ms]
    reduced = step_moments(shape, w, strategy, per_rank(shape, w, hw, strategies.get(strategy))).values()
    assert max(_tensors(m) for m in moments) == max(_tensors(m) for m in reduced)  # the phases' maxima hold the peak
    return (max(_tensors(m) for m in moments) / GIB, max(_tensors(m) - m.grads for m in moments) / GIB,
            max(m.grads for m in moments) / GIB)


def test_a_full_fine_tune_under_fsdp_reads_both_pools() -> None:
    """A full fine-tune without checkpointing sharded over two ranks peaks in backward, before any gradient shard
    exists; the shards made after it sit in the other pool, beside the activations the compute stream keeps
    cached: the idle pool is the shards, and the reading holds it beside the cache."""
    w = Workload(method="full", seq_len=1024, micro_batch=2, grad_ckpt="none", attention="flash", precision="bf16",
                 pure_16bit=True, fsdp1=True)
    c = estimate(resolve_shape(MODEL), w, parse_gpus("2xA100-80G"), "zero3")
    b = c.per_gpu_gib
    peak, compute, shards = _pools(MODEL, w, "2xA100-80G", "zero3")
    assert c.peak_phase == "backward" and shards > 1.0
    assert compute + shards > peak + 1.0
    assert b.stream_pool == pytest.approx(compute + shards - peak, rel=1e-6)
    tensors = b.total - b.allocator_reserve - b.runtime_overhead
    assert tensors == pytest.approx(peak, rel=1e-6)  # the verdict's total is unchanged: a full card frees the pool
    assert peak_reading(b, float("inf"), "reserved") == pytest.approx(tensors * (1 + ALLOCATOR_CACHE) + b.stream_pool)
    assert peak_reading(b, float("inf"), "allocated") == pytest.approx(tensors)


def test_fsdp2_makes_its_shards_on_the_reduce_scatter_stream_too() -> None:
    """FSDP2 (no `fsdp1`): the same two pools."""
    w = Workload(method="full", seq_len=1024, micro_batch=2, grad_ckpt="none", attention="flash", precision="bf16",
                 pure_16bit=True)
    b = estimate(resolve_shape(MODEL), w, parse_gpus("2xA100-80G"), "zero3").per_gpu_gib
    peak, compute, shards = _pools(MODEL, w, "2xA100-80G", "zero3")
    assert b.stream_pool == pytest.approx(max(0.0, compute + shards - peak), rel=1e-6) and b.stream_pool > 0


@pytest.mark.parametrize(("gpus", "strategy"), [("1xA100-80G", "single"), ("2xA100-80G", "ddp")])
def test_one_stream_has_one_pool(gpus: str, strategy: str) -> None:
    """Without FSDP the gradients are autograd's, made on the compute stream: no second pool."""
    w = Workload(method="full", seq_len=1024, grad_ckpt="full", attention="flash")
    assert estimate(resolve_shape("Qwen/Qwen2.5-0.5B"), w, parse_gpus(gpus), strategy).per_gpu_gib.stream_pool == 0


def test_no_sync_keeps_autograd_gradients_on_the_compute_stream() -> None:
    """Under FSDP1's no_sync() the micro-batches before the last hold autograd's unsharded gradients, made on the
    compute stream: the planner's gradient column is not the reduce-scatter pool there, so it counts none of it
    (the gathered weights' pool, less than the shards here, still counts)."""
    w = Workload(method="full", seq_len=1024, grad_ckpt="full", attention="flash", fsdp1=True, fsdp1_no_sync=True,
                 grad_accum=4)
    shape, hw = resolve_shape("Qwen/Qwen2.5-0.5B"), parse_gpus("2xA100-80G")
    b = estimate(shape, w, hw, "zero3").per_gpu_gib
    gathered = per_rank(shape, w, hw, strategies.get("zero3")).gathered / GIB
    assert 0 < gathered < b.grads
    assert b.stream_pool <= gathered + 1e-9


def test_the_pool_is_capped_by_the_card() -> None:
    """Before a request fails the allocator frees every cached block, of every stream, and retries: near its card
    a run reads what the card leaves, the idle pool included."""
    b = Breakdown(weights=30.0, stream_pool=8.0, allocator_reserve=30.0 * est.ALLOCATOR_RESERVE,
                  runtime_overhead=1.0)
    b.total = 30.0 + b.allocator_reserve + b.runtime_overhead
    assert peak_reading(b, 36.0, "total") == pytest.approx(36.0)
    assert peak_reading(b, 80.0, "total") == pytest.approx(30.0 * (1 + ALLOCATOR_CACHE) + 8.0 + 1.0)


def test_fsdp1_gathers_into_its_unshard_streams_pool() -> None:
    """FSDP1 all-gathers each unit into its padded unsharded flat parameter under its unshard stream
    (_runtime_utils.py `_unshard`: `with ...stream(unshard_stream): handle.unshard()`). A checkpointed full fine-tune
    peaks at the optimizer step, when nothing is gathered: the unshard pool still holds its most (the root unit and
    two blocks, in the compute dtype) beside the compute stream's step (FSDP2's all-gather pool:
    `test_fsdp2_gathers_into_its_copy_in_streams_pool`)."""
    w = Workload(method="full", seq_len=4096, micro_batch=2, grad_ckpt="full", attention="flash", precision="bf16",
                 pure_16bit=True, fsdp1=True)
    shape, hw = resolve_shape(MODEL), parse_gpus("2xA100-80G")
    c = estimate(shape, w, hw, "zero3")
    peak, compute, shards = _pools(MODEL, w, "2xA100-80G", "zero3")
    assert c.peak_phase == "optimizer" and compute + shards == pytest.approx(peak)  # the shards' pool adds nothing
    gathered = (shape.embed_params() + shape.hidden + 2 * shape.layer_params()) * 2 / GIB
    assert c.per_gpu_gib.stream_pool == pytest.approx(gathered, rel=1e-6)


def test_fsdp2_gathers_into_its_copy_in_streams_pool() -> None:
    """FSDP2 copies each gathered parameter out on the compute stream, but the all-gather output it copies from is
    allocated under its all-gather copy-in stream in forward and backward (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py `foreach_all_gather`: `with device_handle.stream(all_gather_copy_in_stream)` around
    `all_gather_comm.allocate`; _fsdp_param_group.py `get_all_gather_streams`), and in forward one unit's output
    is freed only after the next unit's copy-out (`wait_for_unshard`): two neighbours' buffers at once. At the
    optimizer step that pool sits idle beside the compute stream's step: the most two neighbouring units hold, in
    shardfit's layout (parallel/parallelize.py) the root's own weights, an untied input embedding, the blocks."""
    w = Workload(method="full", seq_len=4096, micro_batch=2, grad_ckpt="full", attention="flash", precision="bf16",
                 pure_16bit=True)
    shape, hw = resolve_shape(MODEL), parse_gpus("2xA100-80G")
    c = estimate(shape, w, hw, "zero3")
    layer, emb = shape.layer_params() * 2, shape.vocab * shape.hidden * 2  # Mistral's embedding is untied
    root = (shape.embed_params() + shape.hidden) * 2
    assert not shape.tied and c.peak_phase == "optimizer"
    assert c.per_gpu_gib.stream_pool == pytest.approx(max(root, emb + layer, 2 * layer) / GIB, rel=1e-6)
    one = estimate(shape, w, parse_gpus("1xA100-80G"), "zero3").per_gpu_gib  # one rank gathers nothing
    assert one.stream_pool == 0
