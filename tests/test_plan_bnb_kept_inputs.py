"""bitsandbytes before 0.43.2: each 4-bit linear keeps its input until its backward.

MatMul4Bit.forward set `ctx.tensors = (A, B)` (bitsandbytes/autograd/_functions.py, 0.42.0, the version litgpt
pinned through 2024) although its backward reads only B, and only where the input needs a gradient
(`any(ctx.needs_input_grad[:2])`); bitsandbytes PR #1270 (0.43.2) stopped keeping A. bitsandbytes is not installed
in the project's environment, so the blocks' frozen linears are a stand-in that keeps its input as that MatMul4Bit
did: through save_for_backward, so that the saved-tensor hooks see it (the tensor lives exactly as long as in
ctx.tensors: until the node's backward frees it). The model runs as litgpt runs QLoRA under Lightning's
BitsandbytesPrecision: weights and adapters in bf16 with no autocast, the embedding and norms frozen, so the first
block's q/k/v input needs no gradient."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from shardfit.plan.activations import block_activation_bytes_per_token, bnb_kept_input_bytes_per_token
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from tests.helpers import freeze_block_linears

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, RANK = 256, 704, 8, 2, 32, 512, 8
SHAPE = ModelShape("tiny-bnb-kept", 2, HIDDEN, MLP, HEADS, KV_HEADS, VOCAB, False, HEAD_DIM)
ALL = ("q", "k", "v", "o", "gate", "up", "down")


class _Matmul4bitStandIn(torch.autograd.Function):
    """A frozen matmul that keeps its frozen weight, and its input where `keep` (bitsandbytes before 0.43.2) and the
    input needs a gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, keep: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.weight = weight
        if keep and any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x)
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        return grad @ ctx.weight.to(grad.dtype), None, None


class FrozenLinear4bit(torch.nn.Linear):
    """A Linear4bit's autograd without its packing."""

    keep = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Matmul4bitStandIn.apply(x, self.weight, self.keep)


def _model(keep: bool, targets: tuple[str, ...], dropout: float, attention: str) -> torch.nn.Module:
    """A two-block bf16 Llama with 4-bit-like frozen linears and bf16 LoRA adapters on `targets`."""
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, tie_word_embeddings=False,
                         attn_implementation=attention)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    def frozen(child: torch.nn.Linear) -> FrozenLinear4bit:
        layer = FrozenLinear4bit(child.in_features, child.out_features, bias=False, dtype=torch.bfloat16)
        layer.keep = keep
        return layer
    freeze_block_linears(model, frozen)
    model.requires_grad_(False)
    modules = [f"{t}_proj" for t in targets]
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules=modules, lora_dropout=dropout),
                          autocast_adapter_dtype=False)


def _blocks_saved(keep: bool, targets: tuple[str, ...], dropout: float, attention: str, seq: int) -> int:
    """Bytes autograd keeps while the blocks run, every block's (their weights, the rotary cos/sin and the mask
    that every block reads left out)."""
    model = _model(keep, targets, dropout, attention)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}
    inside = [False]

    def shared(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        weights.update(t.untyped_storage().data_ptr() for t in kwargs.get("position_embeddings", ()))
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            weights.add(kwargs["attention_mask"].untyped_storage().data_ptr())

    for block in model.base_model.model.model.layers:
        block.register_forward_pre_hook(shared, with_kwargs=True)
        block.input_layernorm.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.mlp.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, VOCAB, (1, seq))).logits.float().square().mean()
    return sum(kept.values())


def _kept_per_token(targets: tuple[str, ...], dropout: float, attention: str) -> float:
    """What keeping the inputs adds to the model's blocks per token, from two sequence lengths."""
    def grown(keep: bool) -> float:
        return (_blocks_saved(keep, targets, dropout, attention, 128) -
                _blocks_saved(keep, targets, dropout, attention, 64)) / 64
    return grown(True) - grown(False)


def _workload(targets: tuple[str, ...], dropout: float, attention: str) -> Workload:
    return Workload(method="qlora", precision="bf16", pure_16bit=True, bnb_precision=True, bnb_keeps_inputs=True,
                    grad_ckpt="none", lora_rank=RANK, lora_targets=targets, lora_dropout=dropout,
                    attention=attention, seq_len=128)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("targets", [("q", "v"), ALL, ("down",)])
def test_kept_inputs_match_the_blocks(targets: tuple[str, ...], dropout: float, attention: str) -> None:
    """The bytes the kept inputs add are the inputs nothing else keeps and that need a gradient: none where every
    input is read undropped by an adapter; the two norms' outputs and down's input where dropout gives the
    adapters copies of their own (or no adapter reads them); eager attention's output copy where o has no
    undropped adapter; in the first block none upstream of its first adapter. Exact per token, over both blocks."""
    measured = _kept_per_token(targets, dropout, attention)
    planned = bnb_kept_input_bytes_per_token(SHAPE, _workload(targets, dropout, attention)) * SHAPE.layers
    assert planned == pytest.approx(measured, abs=1.0)


def test_the_block_counts_the_kept_inputs() -> None:
    """The block's saved bytes hold the kept inputs where bitsandbytes before 0.43.2 ran Lightning's plugin
    (`bnb_keeps_inputs`): of the second block, the two norms' outputs and down's input; of the first, whose q/k/v
    input needs no gradient, the MLP's two. Not under the plugin with a bitsandbytes of today (the key's
    default), nor transformers' bitsandbytes QLoRA, nor LoRA."""
    w = _workload(("q", "v"), 0.05, "sdpa")
    kept = bnb_kept_input_bytes_per_token(SHAPE, w)
    assert kept == 2 * ((2 * HIDDEN + MLP) + (HIDDEN + MLP)) / 2
    current = replace(w, bnb_keeps_inputs=False)
    assert bnb_kept_input_bytes_per_token(SHAPE, current) == 0
    hf = replace(w, bnb_precision=False, quant_backend="bnb")
    assert bnb_kept_input_bytes_per_token(SHAPE, hf) == 0
    assert bnb_kept_input_bytes_per_token(SHAPE, replace(w, method="lora")) == 0
    assert block_activation_bytes_per_token(SHAPE, w) - block_activation_bytes_per_token(SHAPE, current) == kept
