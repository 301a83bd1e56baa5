"""What a LoRA block keeps for backward depends on which projections carry adapters: a frozen linear keeps no
input, so only the adapters keep theirs (plan/adapter_inputs.py `adapter_input_tensors`, `keeps_down_input`).
Measured with saved-tensor hooks on a transformers Llama block, for groups of targets, with and without peft's
fp32 input cast, with and without dropout (as a GPU runs it: a bool mask)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora, skip_adapter_input_casts
from shardfit.plan.activations import activation_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from shardfit.simulate.gpu_kernels import dropout_as_on_a_gpu
from shardfit.simulate.step import packed_positions
from shardfit.train.loss import CausalLMLoss
from tests.helpers import saved_tensor_bytes

VOCAB = 384
SHAPE = ModelShape("tiny-llama", 2, 256, 704, 8, 2, VOCAB, False, 32)


def _saved(layers: int, targets: list[str], casts: bool, dropout: float, autocast: bool = True) -> int:
    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = apply_lora(model, LoraSettings(rank=8, alpha=16, targets=[f"{t}_proj" for t in targets],
                                           dropout=dropout))
    if not casts:
        skip_adapter_input_casts(model)
    if not autocast:  # every weight and adapter in bf16, no autocast (torchtune's and litgpt's bf16-true)
        model.to(torch.bfloat16)
    module = CausalLMLoss(model, all_labelled=True)
    ids = torch.randint(0, VOCAB, (2, 256))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), dropout_as_on_a_gpu():
        return saved_tensor_bytes(module, lambda: module(ids, packed_positions(2, 256), ids))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("casts", [True, False])
@pytest.mark.parametrize("targets", [["q", "v"], ["q", "k", "v", "o"], ["gate", "up"], ["down"],
                                     ["q", "k", "v", "o", "gate", "up", "down"]])
def test_a_blocks_saved_inputs_follow_its_adapted_projections(targets: list[str], casts: bool,
                                                               dropout: float) -> None:
    """One block more (the third against the second: both downstream of an adapter, so every tensor on the way
    back is kept) saves what the planner counts for one block, within 3 %."""
    per_block = _saved(3, targets, casts, dropout) - _saved(2, targets, casts, dropout)
    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="none", lora_rank=8,
                 lora_targets=tuple(targets), lora_dropout=dropout, adapter_input_casts=casts)
    predicted = activation_bytes(SHAPE, w, 2) - activation_bytes(SHAPE, w, 1)
    assert predicted == pytest.approx(per_block, rel=0.03)


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("targets", [["q", "v"], ["q", "k", "v", "o", "gate", "up", "down"]])
def test_a_pure_bf16_blocks_saved_inputs(targets: list[str], dropout: float) -> None:
    """Without autocast, weights and adapters all bf16 (`pure_16bit`): the same rule, the dropped copy in bf16."""
    per_block = _saved(3, targets, True, dropout, autocast=False) - _saved(2, targets, True, dropout, autocast=False)
    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="none", lora_rank=8,
                 lora_targets=tuple(targets), lora_dropout=dropout, pure_16bit=True, tool_autocast=False)
    assert activation_bytes(SHAPE, w, 2) - activation_bytes(SHAPE, w, 1) == pytest.approx(per_block, rel=0.01)


def test_q_and_v_alone_keep_less_than_every_projection() -> None:
    """peft's default targets for Llama-style models (q and v): no MLP norm output, no down input."""
    every = Workload(method="lora", seq_len=256, micro_batch=2, grad_ckpt="none")
    qv = Workload(method="lora", seq_len=256, micro_batch=2, grad_ckpt="none", lora_targets=("q", "v"))
    tokens, h, m = 512, SHAPE.hidden, SHAPE.intermediate
    fewer = (activation_bytes(SHAPE, every, 1) - activation_bytes(SHAPE, qv, 1)) / tokens
    # peft's casts: o's, gate's, up's and k's copies (4 hidden), down's input (m), five adapters' rank-wide outputs
    assert fewer == 2 * (4 * h + m + 5 * 8)
