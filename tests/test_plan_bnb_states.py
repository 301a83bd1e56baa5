"""bitsandbytes' 8-bit AdamW keeps fp32 states for some tensors (plan/estimate.py `fp32_state_params`): each under
its `min_8bit_size` (4,096 elements), and under the HF Trainer every nn.Embedding's weight, which
Trainer.create_optimizer registers for 32-bit states. Counted here on a tiny real model's trainable tensors."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from shardfit.plan.estimate import state_bytes
from shardfit.plan.optimizer_states import BNB_MIN_8BIT_SIZE, fp32_state_params, optimizer_state_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

CONFIG = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}


def _model_and_shape() -> tuple[torch.nn.Module, object]:
    """A tiny Qwen2 (k/v projections 128 wide) and the plan's shape of it."""
    config = Qwen2Config(**CONFIG)
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), resolve_shape(str(folder))


@pytest.mark.parametrize("rank", [4, 8, 16])
def test_small_lora_matrices_keep_fp32_states(rank: int) -> None:
    """LoRA on every projection of the tiny model: the trainable tensors under min_8bit_size (B of k and v, and
    at rank 4 every A over the 512-wide input) are what the plan counts at 8 bytes, and the optimizer part grows
    by them."""
    model, shape = _model_and_shape()
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=names))
    trained = [p.numel() for p in peft_model.parameters() if p.requires_grad]
    small = sum(n for n in trained if n < BNB_MIN_8BIT_SIZE)
    w = Workload(method="lora", precision="bf16", lora_rank=rank, optimizer="adamw8bit")
    assert small > 0
    assert fp32_state_params(shape, w) == small
    assert state_bytes(shape, w)[2] == pytest.approx(
        (sum(trained) - small) * optimizer_state_bytes(w) + small * 8)


def test_the_hf_trainer_keeps_the_embedding_s_states_in_fp32() -> None:
    """A full fine-tune with a tool's bitsandbytes 8-bit `optim`: the embedding (tied here) has fp32 states, and so
    do the norms and q/k/v biases (512 and 128 wide); without the HF Trainer only those."""
    model, shape = _model_and_shape()
    small = sum(p.numel() for p in model.parameters() if p.numel() < BNB_MIN_8BIT_SIZE)
    embedding = model.get_input_embeddings().weight.numel()
    trainer = Workload(method="full", precision="bf16", optimizer="adamw8bit", bnb_optimizer=True)
    assert fp32_state_params(shape, trainer) == small + embedding
    assert fp32_state_params(shape, Workload(method="full", precision="bf16", optimizer="adamw8bit")) == small


def _lora_with_saved_embedding() -> tuple[torch.nn.Module, object]:
    """The tiny Qwen2 untied, LoRA on every projection and peft's trained copy of embed_tokens."""
    config = Qwen2Config(**{**CONFIG, "tie_word_embeddings": False})
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    torch.manual_seed(0)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=16, target_modules=names, modules_to_save=["embed_tokens"]))
    return model, resolve_shape(str(folder))


def test_the_hf_trainer_keeps_peft_s_embedding_copy_in_fp32() -> None:
    """LoRA with modules_to_save embed_tokens under the HF Trainer's 8-bit `optim`: peft's trained copy is an
    nn.Embedding, so the Trainer's 32-bit override covers it; without the Trainer only the small LoRA matrices."""
    model, shape = _lora_with_saved_embedding()
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad]
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    small = sum(n for n in trained if n < BNB_MIN_8BIT_SIZE)
    assert len(embeddings) == 1
    w = Workload(method="lora", precision="bf16", lora_rank=16, optimizer="adamw8bit", lora_saved=("embed",))
    assert fp32_state_params(shape, w) == small
    trainer = dataclasses.replace(w, bnb_optimizer=True)
    assert fp32_state_params(shape, trainer) == small + embeddings[0].numel()


def test_real_8bit_adamw_states_of_peft_s_embedding_copy() -> None:
    """bitsandbytes' AdamW8bit stepped on CPU with the Trainer's override on every nn.Embedding: the state bytes it
    holds are the plan's to the byte."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: its states are not measured")
    model, shape = _lora_with_saved_embedding()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.pid2config, manager.index2config, manager.module_weight_config_triple = {}, {}, []
    optimizer = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    model(input_ids=torch.randint(0, CONFIG["vocab_size"], (1, 8))).logits.float().sum().backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for k, t in state.items()
               if k in ("state1", "state2", "absmax1", "absmax2"))
    w = Workload(method="lora", precision="bf16", lora_rank=16, optimizer="adamw8bit", bnb_optimizer=True,
                 lora_saved=("embed",))
    assert state_bytes(shape, w)[2] == held


def test_torchao_s_8bit_adamw_keeps_its_own_full_width_tensors() -> None:
    """torchao's 8-bit AdamW (adamw_torch_8bit) keeps a tensor full-width when it is under 4,096 elements or not a
    multiple of its 256-element block, in the parameter's own dtype: LoRA r=13 over a 320-wide tiny Qwen2 (A is
    13 x 320 = 4,160 elements, 8-bit under bitsandbytes, full-width under torchao)."""
    config = Qwen2Config(**{**CONFIG, "hidden_size": 320, "num_attention_heads": 4, "num_key_value_heads": 2})
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    shape = resolve_shape(str(folder))
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=13, target_modules=names))
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    wide = sum(n for n in trained if n < BNB_MIN_8BIT_SIZE or n % 256)
    bnb = Workload(method="lora", precision="bf16", lora_rank=13, optimizer="adamw8bit")
    torchao = dataclasses.replace(bnb, torchao_optimizer=True, adapters_16bit=True)
    assert fp32_state_params(shape, bnb) < wide == fp32_state_params(shape, torchao)
    assert state_bytes(shape, torchao)[2] == pytest.approx((sum(trained) - wide) * optimizer_state_bytes(torchao)
                                                           + wide * 2 * 2)


def test_flat_parameters_have_no_small_tensor_or_embedding_override() -> None:
    """FSDP1 with flat parameters hands bitsandbytes one flat parameter per unit: no tensor under min_8bit_size and
    no embedding of its own for the Trainer's 32-bit override, so every trained weight has 8-bit states."""
    _, shape = _model_and_shape()
    trainer = Workload(method="full", precision="bf16", optimizer="adamw8bit", bnb_optimizer=True)
    assert fp32_state_params(shape, trainer) > 0
    flat = dataclasses.replace(trainer, flat_params=True)
    assert fp32_state_params(shape, flat) == 0
    assert state_bytes(shape, flat)[2] == pytest.approx(
        state_bytes(shape, dataclasses.replace(flat, bnb_optimizer=False))[2])
