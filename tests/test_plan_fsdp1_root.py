"""FSDP1's root unit holds an untied input embedding gathered once through backward (plan/estimate.py
`embedding_in_root`), and its backward holds the root and two blocks gathered (`fsdp1_backward_weight_bytes`): 2-rank
gloo traces of torch's FullyShardedDataParallel over a tiny untied Llama, its decoder blocks wrapped and the
embedding, norm and head in the root, as Lightning and accelerate wrap them (and with LoRA under flat parameters each
adapter a unit of its own, as peft and Answer.AI wrap them). A run that sets only `flat_params` is FSDP1 too
(`runs_fsdp1`)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest

from shardfit import strategy as strategies
from shardfit.plan.dispatch import ENGINE_HOST_S, by_checkpointing, engine_host_s
from shardfit.plan.estimate import compute_bytes, gathered_block_bytes, per_rank
from shardfit.plan.fsdp1_grads import fsdp1_backward_grad_bytes, mixes_frozen_and_adapters
from shardfit.plan.fsdp_buffers import fsdp1_backward_weight_bytes
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.weight_bytes import fsdp1_bnb_quant_state_bytes
from shardfit.plan.workload import Workload
from tests.fsdp1_traces import trace

VOCAB, HIDDEN, LAYERS = 4096, 64, 3


def probe_root() -> dict:  # runs on each rank (tests/fsdp1_traces.py)
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = FullyShardedDataParallel(LlamaForCausalLM(cfg), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
    root = model._handle.flat_param

    def gathered() -> tuple[int, int]:  # (bytes, address) of the root's unsharded flat parameter; 0 bytes if freed
        storage = root._full_param_padded.untyped_storage()
        return storage.nbytes(), storage.data_ptr()

    in_backward = []
    model._fsdp_wrapped_module.model.layers[0].register_full_backward_hook(lambda *_: in_backward.append(gathered()))
    ids = torch.randint(0, VOCAB, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    after_forward = gathered()
    loss.backward()
    return {"after_forward": after_forward, "in_backward": in_backward, "after_backward": gathered()[0],
            "root_params": root._unpadded_unsharded_size.numel()}


def probe_backward(lora: bool) -> dict:  # runs on each rank (tests/fsdp1_traces.py)
    import functools

    import torch
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp import _runtime_utils as runtime
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    blocks = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    policy = blocks
    if lora:  # peft's and Answer.AI's wrapping: every leaf whose weight trains is a unit of its own
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))

        def leaf(m: torch.nn.Module) -> bool:
            w = getattr(m, "weight", None)
            return not list(m.children()) and w is not None and w.requires_grad

        policy = functools.partial(_or_policy, policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=leaf), blocks])
    model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                     sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=False,
                                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    units = FullyShardedDataParallel.fsdp_modules(model)
    block_handles = [u._handle for u in units if isinstance(u._fsdp_wrapped_module, LlamaDecoderLayer)]
    root = model._handle

    def gathered(handle) -> bool:
        return handle.flat_param._full_param_padded.untyped_storage().nbytes() > 0

    seen: list[tuple[int, bool]] = []  # after each all-gather in backward: (blocks gathered, root gathered)
    unshard = runtime._unshard

    def traced(state, handle, *rest):
        unshard(state, handle, *rest)
        if in_backward:
            seen.append((sum(gathered(h) for h in block_handles), gathered(root)))

    in_backward = False
    ids = torch.randint(0, VOCAB, (1, 8))
    with mock.patch.object(runtime, "_unshard", traced):
        loss = model(input_ids=ids, labels=ids).loss
        in_backward = True
        loss.backward()
    return {"blocks": len(block_handles), "units": len(units), "seen": seen}


def probe_flat_grad() -> dict:  # runs on each rank (tests/fsdp1_traces.py)
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp import _runtime_utils as runtime
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = FullyShardedDataParallel(LlamaForCausalLM(cfg), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                     use_orig_params=False, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    blocks = [u._handle for u in FullyShardedDataParallel.fsdp_modules(model)
              if isinstance(u._fsdp_wrapped_module, LlamaDecoderLayer)]
    numel = blocks[0].flat_param._unpadded_unsharded_size.numel()
    flattens: list[dict] = []  # each block's flat gradient as split's backward makes it
    scatters: list[bool] = []  # whether each reduce-scatter reads the gradient itself (no padded copy)

    def gathered(handle) -> bool:
        return handle.flat_param._full_param_padded.untyped_storage().nbytes() > 0

    class Flattens(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and out.numel() == numel:
                flattens.append({"inputs": sum(t.nbytes for t in args[0]), "out": out.nbytes,
                                 "blocks": sum(gathered(h) for h in blocks), "root": gathered(model._handle)})
            return out

    tensors = runtime._get_reduce_scatter_tensors

    def traced(state, grad):
        padded, shard = tensors(state, grad)
        scatters.append(padded.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr())
        return padded, shard

    ids = torch.randint(0, VOCAB, (1, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with mock.patch.object(runtime, "_get_reduce_scatter_tensors", traced), Flattens():
        loss.backward()
    return {"block_bytes": 4 * numel, "flattens": flattens, "scatters": scatters}


# The full fine-tune's trace holds the claim the planner uses (root once, two blocks); LoRA's adapter units only
# add the order of their prefetch: heavy, to keep `make test` under its bound.
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_fsdp1_backward_holds_the_root_and_two_blocks(lora: bool) -> None:
    """Through backward FSDP1 holds the root gathered and at most two blocks at once, the current one and the one
    prefetched, also with LoRA's adapters as units of their own (where the block prefetches its own last adapter
    and the previous block is gathered from its first adapter, before the block is freed)."""
    out = trace("backward_lora" if lora else "backward_full")
    assert out["blocks"] == LAYERS and out["units"] == (1 + LAYERS * 15 if lora else 1 + LAYERS)
    assert out["seen"] and all(root for _, root in out["seen"])
    assert max(n for n, _ in out["seen"]) == 2


def _case(method: str = "full", **keys) -> tuple:
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    w = Workload(method=method, seq_len=512, micro_batch=1, grad_ckpt="full", precision="bf16", **keys)
    return shape, w, parse_gpus("2x24GB"), strategies.get("zero3")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_flat_params_runs_hold_the_embedding_in_the_root_in_forward(method: str) -> None:
    """A run that sets only `flat_params` (Answer.AI's, PEFT's) is FSDP1: its root keeps the untied embedding
    gathered after forward, as one that sets `fsdp1` does; FSDP2 frees it."""
    shape, w, hw, s = _case(method)
    emb = shape.vocab * shape.hidden * compute_bytes(w)
    fsdp2 = per_rank(shape, w, hw, s).fwd_temp
    for keys in ({"fsdp1": True}, {"flat_params": True}):
        assert per_rank(shape, dataclasses.replace(w, **keys), hw, s).fwd_temp == pytest.approx(fsdp2 + emb)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_fsdp1_backward_counts_the_root_once_and_two_blocks(method: str) -> None:
    """FSDP1's backward (`fsdp1` or `flat_params`) holds the root's flat parameter once and two blocks gathered,
    beside one block's unsharded gradients: the head and final norm not a second time, as FSDP2's count of a full
    fine-tune has them (and bitsandbytes' quant states, whole on every rank, in neither block). LoRA under
    `fsdp1_mixed_units` (use_orig_params=True) holds its whole block's flat gradient twice instead
    (test_plan_fsdp1_orig_params.py)."""
    keys = {"quant_backend": "bnb"} if method == "qlora" else {}
    shape, w, hw, s = _case(method, **keys)
    low = compute_bytes(w)
    root = (shape.embed_params() + shape.hidden) * low
    head = root - shape.vocab * shape.hidden * low
    fsdp2 = per_rank(shape, w, hw, s).bwd_temp
    if method != "full":  # FSDP2's frozen root is gathered once (its head), beside three blocks
        fsdp2 += root - (gathered_block_bytes(shape, w) - fsdp1_bnb_quant_state_bytes(shape, w))
    for fsdp1 in ({"fsdp1": True}, {"flat_params": True}):
        w1 = dataclasses.replace(w, **fsdp1)
        states = 2 * fsdp1_bnb_quant_state_bytes(shape, w1)  # bitsandbytes' quant states are never gathered
        flat_grad = shape.layer_params() * low if method == "full" else 0  # the flattened gradient's copy
        assert not mixes_frozen_and_adapters(w1)  # that layout is its own key (test_plan_fsdp1_orig_params.py)
        assert per_rank(shape, w1, hw, s).bwd_temp == pytest.approx(fsdp2 - head - states + flat_grad)


def test_flat_params_runs_pay_fsdp1s_host_time_per_block() -> None:
    """The host's cost per block of FSDP1's hooks applies to a run that sets only `flat_params`."""
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    w = Workload(method="lora", flat_params=True, grad_ckpt="full")
    want = shape.layers * by_checkpointing(w, lambda ckpt: ENGINE_HOST_S["fsdp1"][("lora", ckpt)])
    assert engine_host_s(shape, w, strategies.get("zero3")) == pytest.approx(want)
    assert engine_host_s(shape, dataclasses.replace(w, flat_params=False), strategies.get("zero3")) < want


@pytest.mark.slow
def test_fsdp1_root_holds_the_embedding_once_through_backward() -> None:
    """After forward the root's flat parameter (embedding, final norm, head) is still gathered, stays so, in the
    same buffer, through the blocks' backward and is freed after it: one copy, never gathered again (FSDP2 frees
    the embedding's unit after forward and gathers it again for its gradient: one copy in backward either way,
    what the planner counts)."""
    out = trace("root")
    size, address = out["after_forward"]
    assert out["root_params"] == 2 * VOCAB * HIDDEN + HIDDEN and size >= 4 * out["root_params"]
    assert out["in_backward"] == [[size, address]] and out["after_backward"] == 0


@pytest.mark.slow
def test_fsdp1_flattens_a_blocks_gradient_beside_its_weights_gradients() -> None:
    """At the end of each block's backward FSDP1 concatenates its weights' gradients into the flat gradient: both
    are alive then, a block's gradients twice, with the block and the one it prefetched and the root gathered; the
    reduce-scatter then reads that flat gradient in place (what `fsdp1_backward_grad_bytes` counts)."""
    out = trace("flatgrad")
    block = out["block_bytes"]
    assert len(out["flattens"]) == LAYERS
    assert all(f["inputs"] == f["out"] == block and f["root"] for f in out["flattens"])
    assert max(f["blocks"] for f in out["flattens"]) == 2
    assert len(out["scatters"]) == LAYERS + 1 and all(out["scatters"])


@pytest.mark.parametrize("wrapping", [{"fsdp1": True}, {"flat_params": True}])
def test_fsdp1_full_fine_tune_backward_holds_a_blocks_gradient_twice(wrapping: dict) -> None:
    """A full fine-tune under FSDP1 holds one block's unsharded gradients twice at its backward's worst moment (the
    weights' gradients and the flat one split's backward makes of them); LoRA under flat parameters does not (each
    adapter matrix is a unit of its own), nor FSDP2."""
    shape, w, hw, s = _case("full")
    grads = shape.layer_params() * compute_bytes(w)
    w1 = dataclasses.replace(w, **wrapping)
    lone = dataclasses.replace(w, method="lora", flat_params=True)
    assert per_rank(shape, w1, hw, s).bwd_temp == pytest.approx(
        fsdp1_backward_weight_bytes(*_root_and_block(shape, w1)) + 2 * grads)
    assert fsdp1_backward_grad_bytes(shape, w1, grads) == 2 * grads
    assert fsdp1_backward_grad_bytes(shape, w, grads) == grads
    assert fsdp1_backward_grad_bytes(shape, lone, grads) == grads


def test_fsdp1_shard_grad_op_flattens_a_blocks_gradient_too() -> None:
    """Under SHARD_GRAD_OP (zero2) FSDP1 still runs a unit through split's views of its flat parameter, so its
    backward holds a full fine-tune's block gradient twice as under FULL_SHARD; FSDP2's zero2 once. Both hold the
    whole model gathered beside it (`per_rank`'s zero2: every unit's copy kept from its forward to its backward), and
    the root unit's (head and final norm's) unsharded gradient."""
    shape, w, hw, _ = _case("full")
    s = strategies.get("zero2")
    low = compute_bytes(w)
    grads = shape.layer_params() * low
    held = shape.params() * low + (shape.vocab + 1) * shape.hidden * low
    assert per_rank(shape, w, hw, s).bwd_temp == pytest.approx(held + grads)
    assert per_rank(shape, dataclasses.replace(w, fsdp1=True), hw, s).bwd_temp == pytest.approx(held + 2 * grads)


def _root_and_block(shape, w: Workload) -> tuple[float, float]:
    """The root unit's and one block's gathered bytes of a full fine-tune."""
    low = compute_bytes(w)
    return (shape.embed_params() + shape.hidden) * low, shape.layer_params() * low

