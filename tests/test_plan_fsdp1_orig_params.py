"""FSDP1 with use_orig_params=True and LoRA (`fsdp1` without `flat_params`, as Lightning Fabric's FSDPStrategy
wraps a Block): one flat parameter holds a block's frozen weights and its adapters, so its gradient spans the whole
block (plan/fsdp1_grads.py `mixes_frozen_and_adapters`). A 2-rank gloo trace of torch's FullyShardedDataParallel
over a tiny untied Llama with peft's LoRA on q and v, its decoder blocks wrapped."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit import strategy as strategies
from shardfit.plan.estimate import per_rank, trainable_weight_bytes
from shardfit.plan.fsdp1_grads import block_flat_grad_bytes, fsdp1_backward_grad_bytes, mixes_frozen_and_adapters
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from tests.fsdp1_traces import trace

LAYERS = 3


def probe() -> dict:  # runs on each rank (tests/fsdp1_traces.py)
    import functools

    import torch
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    block0 = model.base_model.model.model.layers[0]
    frozen = sum(p.numel() for p in block0.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in block0.parameters() if p.requires_grad)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                     sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    blocks = [u._handle for u in FullyShardedDataParallel.fsdp_modules(model)
              if isinstance(u._fsdp_wrapped_module, LlamaDecoderLayer)]
    flat = blocks[0].flat_param
    numel = flat._unpadded_unsharded_size.numel()
    is_frozen = [not p.requires_grad for p in flat._params]
    flattens: list[dict] = []  # each block's flat gradient as split's backward makes it

    def gathered(handle) -> bool:
        return handle.flat_param._full_param_padded.untyped_storage().nbytes() > 0

    class Flattens(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and out.numel() == numel:
                parts = args[0]
                flattens.append({
                    "inputs": sum(t.nbytes for t in parts), "out": out.nbytes, "parts": len(parts),
                    # a frozen weight's share: a gradient its linear computed (non-zero), or zeros filled in
                    "frozen_real": [bool(t.abs().sum() > 0) for t, f in zip(parts, is_frozen, strict=False) if f],
                    "blocks": sum(gathered(h) for h in blocks), "root": gathered(model._handle)})
            return out

    ids = torch.randint(0, 512, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with Flattens():
        loss.backward()
    kept = [None if h.flat_param.grad is None else h.flat_param.grad.numel() for h in blocks]
    orig = [(p.requires_grad, p.grad is not None) for n, p in model.named_parameters() if ".layers.0." in n]
    return {"numel": numel, "frozen": frozen, "adapters": adapters, "params": len(is_frozen), "flattens": flattens,
            "kept": kept, "shard": flat._sharded_size.numel(), "root_grad": model._handle.flat_param.grad is not None,
            "orig": orig}


@pytest.mark.slow
def test_mixed_unit_flattens_the_frozen_weights_gradients_too() -> None:
    """A block unit of frozen weights and adapters computes a real gradient for every frozen weight, concatenates
    them with the adapters' into a flat gradient of the whole block (both alive, with two blocks and the root
    gathered), and keeps the shard of that whole flat gradient after backward; the frozen weights' own `.grad` is
    None, and the root (all frozen) has no gradient."""
    out = trace("orig_params")
    block = 4 * out["numel"]
    assert out["numel"] == out["frozen"] + out["adapters"] and out["adapters"] < out["frozen"] / 10
    assert len(out["flattens"]) == LAYERS
    for f in out["flattens"]:
        assert f["inputs"] == f["out"] == block and f["root"] and f["parts"] == out["params"]
        assert f["frozen_real"] and all(f["frozen_real"])
    assert max(f["blocks"] for f in out["flattens"]) == 2
    assert out["kept"] == [out["shard"]] * LAYERS and 2 * out["shard"] >= out["numel"]
    assert not out["root_grad"]
    assert all(has_grad == requires_grad for requires_grad, has_grad in out["orig"])


def _case(**keys) -> tuple:
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    w = Workload(method="lora", seq_len=512, micro_batch=1, grad_ckpt="full", precision="bf16", **keys)
    return shape, w, parse_gpus("2x24GB")


def test_mixed_unit_backward_holds_the_whole_blocks_gradient_twice() -> None:
    """LoRA under FSDP1 with use_orig_params=True holds a whole block's gradient twice at its backward's worst
    moment, frozen weights included (about 2 x 386 MiB for Llama 2 7B in bf16), where flat parameters
    (`flat_params`) and FSDP2 hold the adapters' gradients alone."""
    shape, w, hw = _case()
    s = strategies.get("zero3")
    mixed = dataclasses.replace(w, fsdp1=True, fsdp1_mixed_units=True)
    block = block_flat_grad_bytes(shape, mixed) / shape.layers
    assert mixes_frozen_and_adapters(mixed) and 380 * 2**20 < block < 400 * 2**20
    flat = dataclasses.replace(w, fsdp1=True, flat_params=True)
    adapters = trainable_weight_bytes(shape, w) / shape.layers
    assert fsdp1_backward_grad_bytes(shape, mixed, adapters) == pytest.approx(2 * block)
    assert per_rank(shape, mixed, hw, s).bwd_temp - per_rank(shape, flat, hw, s).bwd_temp == pytest.approx(
        2 * block - adapters)
    assert not mixes_frozen_and_adapters(dataclasses.replace(mixed, method="qlora"))


def test_fsdp1_alone_wraps_adapters_apart_as_the_trainer_tools_do() -> None:
    """`fsdp1` without `fsdp1_mixed_units` is FSDP1 as the tools on transformers' Trainer run LoRA: peft's
    fsdp_auto_wrap_policy makes every adapter matrix a unit of its own, so the blocks' units hold frozen weights only
    and the held gradients are the adapters' (a foreign job's `fsdp1` must not bring in the whole blocks')."""
    shape, w, hw = _case()
    s = strategies.get("zero3")
    trainer = dataclasses.replace(w, fsdp1=True)
    assert not mixes_frozen_and_adapters(trainer)
    assert per_rank(shape, trainer, hw, s).grads == pytest.approx(trainable_weight_bytes(shape, w) / hw.world)
    adapters = trainable_weight_bytes(shape, w) / shape.layers
    assert fsdp1_backward_grad_bytes(shape, trainer, adapters) == pytest.approx(adapters)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_mixed_unit_keeps_the_whole_blocks_gradient_shards(strategy: str) -> None:
    """After backward each rank keeps its shard of every block's whole flat gradient (the frozen weights' share
    too) until zero_grad: the blocks' bytes / N, not the adapters' gradients / N."""
    shape, w, hw = _case()
    s = strategies.get(strategy)
    mixed = dataclasses.replace(w, fsdp1=True, fsdp1_mixed_units=True)
    assert per_rank(shape, mixed, hw, s).grads == pytest.approx(block_flat_grad_bytes(shape, mixed) / hw.world)
    for other in (w, dataclasses.replace(mixed, flat_params=True)):
        assert per_rank(shape, other, hw, s).grads == pytest.approx(trainable_weight_bytes(shape, w) / hw.world)

