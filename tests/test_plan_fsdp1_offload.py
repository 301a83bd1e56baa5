"""FSDP1 (`runs_fsdp1`) under CPU offload and with bitsandbytes' QLoRA: what stays on the GPU that FSDP2's layout
does not keep (plan/estimate.py `fsdp1_offload_grad_shard_bytes`, `fsdp1_bnb_quant_state_bytes`), and the staged
shards FSDP2's offload keeps that FSDP1 does not (`offload_staging_bytes`). The torch side is
a 2-rank gloo trace of FullyShardedDataParallel with CPUOffload(offload_params=True) over a tiny Llama: a CPU has
no memory to pin and no stream to synchronize, so the probe turns those two calls into no-ops; every other line of
FSDP1's offload path runs as on a GPU."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest

from shardfit import strategy as strategies
from shardfit.plan.estimate import (
    GIB,
    offload_staging_bytes,
    per_rank,
    state_bytes,
    step_moments,
    trainable_bytes,
    trainable_params,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.weight_bytes import fsdp1_bnb_quant_state_bytes, nf4_linear_bytes
from shardfit.plan.workload import Workload
from tests.fsdp1_traces import trace

LAYERS = 3


def probe() -> dict:  # runs on each rank (tests/fsdp1_traces.py)
    import torch

    # A CPU has no page-locked memory to ask for, and the final callback's wait on the stream has nothing to wait
    # for: CPU work has already run.
    with mock.patch.object(torch.Tensor, "pin_memory", lambda self, *a, **k: self), \
            mock.patch.object(torch.cpu.Stream, "synchronize", lambda self: None, create=True):
        return _offload_findings()


def _offload_findings() -> dict:
    """What FSDP1's offload keeps through a tiny Llama's backward (a CPU with pinning and the stream's wait off)."""
    import torch
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # A tensor kept on a module beside its weight, as bitsandbytes' Linear4bit keeps its quant state
    scales = torch.ones(16)
    model.model.layers[0].mlp.down_proj.quant_state_absmax = scales
    params0 = sum(p.numel() for p in model.model.layers[0].parameters())
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                     cpu_offload=CPUOffload(offload_params=True), use_orig_params=False)
    layers = model._fsdp_wrapped_module.model.layers

    def shards() -> list[bool]:  # which blocks' reduce-scattered gradient shards FSDP1 still holds
        return [getattr(b._handle.flat_param, "_saved_grad_shard", None) is not None for b in layers]

    in_block0 = []
    layers[0]._fsdp_wrapped_module.register_full_backward_hook(lambda *_: in_block0.append(shards()))
    ids = torch.randint(0, 512, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    flat0 = layers[0]._handle.flat_param
    kept = layers[0]._fsdp_wrapped_module.mlp.down_proj.quant_state_absmax
    return {"in_block0": in_block0, "after": shards(),
            "grad_on_host": all(b._handle.flat_param.grad is b._handle.flat_param._cpu_grad for b in layers),
            "flat0_unsharded": flat0._unpadded_unsharded_size.numel(), "params0": params0,
            "scales_kept": kept is scales}


@pytest.mark.slow
def test_fsdp1_offload_holds_gradient_shards_until_backward_ends() -> None:
    """While block 0 (the last) runs its backward, blocks 1 and 2 have reduce-scattered their gradients and still
    hold the shards (`_saved_grad_shard`); after backward's final callback none does and `.grad` is the host copy.
    A plain tensor kept on a module is no part of the block's flat parameter and stays where it was."""
    out = trace("offload")
    assert out["in_block0"] == [[False] + [True] * (LAYERS - 1)]
    assert out["after"] == [False] * LAYERS and out["grad_on_host"]
    assert out["flat0_unsharded"] == out["params0"] and out["scales_kept"]


def _case(strategy: str, **keys) -> tuple:
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    w = Workload(seq_len=512, micro_batch=1, grad_ckpt="full", precision="bf16", **keys)
    return shape, w, parse_gpus("2x24GB"), strategies.get(strategy)


def test_fsdp1_offload_end_of_backward_holds_every_shard_but_the_roots() -> None:
    """A full fine-tune under FSDP1 offload holds every block's gradient shard at the embedding's gradient (the
    root's, with the embedding, norm and head, comes after it); FSDP2's offload holds none there."""
    shape, w, hw, s = _case("zero3_offload", method="full", flat_params=True)
    r = per_rank(shape, w, hw, s)
    root = shape.embed_params() + shape.hidden
    want = (trainable_params(shape, w) - root) * trainable_bytes(w) / 2
    assert r.held_grad_shards == pytest.approx(want)
    moments = step_moments(shape, w, "zero3_offload", r)
    assert moments["backward"].grads == pytest.approx(want)  # 12 GiB of fp32 shards: the end of backward peaks
    assert moments["forward"].grads == moments["optimizer"].grads == 0.0  # on the host by the optimizer step
    r2 = per_rank(shape, dataclasses.replace(w, flat_params=False), hw, s)
    assert r2.held_grad_shards == 0.0 and r.bwd_temp < r2.bwd_temp  # FSDP2's one fp32 shard in flight instead


def test_fsdp1_bnb_quant_states_stay_whole_on_every_rank() -> None:
    """bitsandbytes' QLoRA under FSDP1: each rank holds the codes' shard and every quant state whole, also under
    CPU offload; torchao's QLoRA (FSDP2) shards both."""
    shape, w, hw, s = _case("zero3", method="qlora", quant_backend="bnb", flat_params=True)
    states = fsdp1_bnb_quant_state_bytes(shape, w, whole_model=True)
    codes = nf4_linear_bytes(shape, w) - states
    assert 0 < states < codes / 20  # an 8-bit scale per 64 weights and its factors, against 4 bits per weight
    weights, _, _ = state_bytes(shape, w)
    assert per_rank(shape, w, hw, s).weights == pytest.approx((weights - states) / 2 + states)
    offload = per_rank(shape, w, hw, strategies.get("zero3_offload"))
    assert offload.weights == pytest.approx(states) and offload.weights > 0.05 * GIB
    fsdp2 = dataclasses.replace(w, flat_params=False)
    assert fsdp1_bnb_quant_state_bytes(shape, fsdp2, whole_model=True) == 0.0
    assert per_rank(shape, fsdp2, hw, s).weights == pytest.approx(weights / 2)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_fsdp1_offload_holds_no_staged_shard(method: str) -> None:
    """FSDP1 under CPU offload copies a unit's shard to the GPU in its pre-unshard and drops it once the unit is
    gathered, before it computes: neither its forward nor its backward holds FSDP2's two staged shards (nor
    FSDP2's one gradient shard in flight: FSDP1 holds them all, `held_grad_shards`)."""
    keys = {"quant_backend": "bnb"} if method == "qlora" else {}
    shape, w, hw, off = _case("zero3_offload", method=method, **keys)
    on = strategies.get("zero3")
    staging = offload_staging_bytes(shape, w, hw.world)[0]
    assert staging > 0 and offload_staging_bytes(shape, dataclasses.replace(w, fsdp1=True), hw.world) == (0, 0)
    for fsdp1 in ({"fsdp1": True}, {"flat_params": True}):
        w1 = dataclasses.replace(w, **fsdp1)
        assert per_rank(shape, w1, hw, off).fwd_temp == pytest.approx(per_rank(shape, w1, hw, on).fwd_temp)
        assert per_rank(shape, w1, hw, off).bwd_temp == pytest.approx(per_rank(shape, w1, hw, on).bwd_temp)
    assert per_rank(shape, w, hw, off).fwd_temp == pytest.approx(per_rank(shape, w, hw, on).fwd_temp + staging)

