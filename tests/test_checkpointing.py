"""Activation checkpointing of decoder blocks: full and selective compute the same gradients as none; selective
recomputes only the matmuls it did not keep."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from shardfit.models.checkpointing import enable_hf_checkpointing

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def _backward(arch: str, mode: str, layers: int = 2) -> tuple[int, dict[str, torch.Tensor]]:
    """Matmuls run by backward (the recomputation included) and the gradients, for one step of a tiny model."""

    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if mode != "none":
        enable_hf_checkpointing(model, selective=mode == "selective")
    model.train()
    ids = torch.randint(0, 256, (2, 32))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_selective_recomputes_every_other_matmul(arch: str) -> None:
    """A block runs seven matmuls (q, k, v, o, gate, up, down; Qwen2's q/k/v with a bias). Full checkpointing
    recomputes six in backward (torch stops the recomputation once it has what backward needs, before down),
    selective only the three it did not keep (k, o, up); the gradients are the same in all three modes."""
    counts, grads = {}, {}
    for mode in ("none", "selective", "full"):
        counts[mode], grads[mode] = _backward(arch, mode)
    layers = 2
    assert counts["full"] - counts["none"] == 6 * layers
    assert counts["selective"] - counts["none"] == 3 * layers
    for mode in ("selective", "full"):
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
