"""Attention that normalizes q and k (Qwen3, Qwen3-VL, Qwen3-Omni, GLM-4.5): the planner knows it from the catalog
and from config.json, counts its weights and the fp32 tensors its norms keep for backward (measured against
saved-tensor hooks in tests/test_plan_activations.py), and builds the catalog's compact Qwen3 ids as Qwen3."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardfit.plan.activations import block_activation_bytes_per_token
from shardfit.plan.shapes import hf_config, resolve_shape
from shardfit.plan.workload import Workload

NORMALIZED = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-VL-8B-Instruct",
              "Qwen/Qwen3-VL-30B-A3B-Instruct", "Qwen/Qwen3-Omni-30B-A3B-Instruct", "zai-org/GLM-4.5")
PLAIN = ("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B", "zai-org/GLM-4.5-Air")


@pytest.mark.parametrize("model", NORMALIZED + PLAIN)
def test_the_shape_says_whether_q_and_k_are_normalized(model: str) -> None:
    """Two per-head norms of the head's width a block where the model has them (GLM-4.5 by its `use_qk_norm`, which
    GLM-4.5-Air leaves off), none elsewhere."""
    shape = resolve_shape(model)
    assert shape.qk_norm == (2 * shape.hd if model in NORMALIZED else 0)


def test_normalized_q_and_k_cost_their_fp32_inputs() -> None:
    """Per token and block, the norms keep fp32 copies of q and k (LoRA), and their 16-bit outputs where the norm
    weights train (a full fine-tune): on Qwen3-8B 20 KiB and 30 KiB a block more than the same block without them."""
    shape = resolve_shape("Qwen/Qwen3-8B")
    plain = dataclasses.replace(shape, qk_norm=0)
    q_kv = (shape.heads + shape.kv_heads) * shape.hd
    for method, per_element in (("lora", 4), ("full", 6)):
        w = Workload(method=method, precision="bf16", seq_len=4096, attention="flash")
        extra = block_activation_bytes_per_token(shape, w) - block_activation_bytes_per_token(plain, w)
        assert extra == per_element * q_kv


def test_a_compact_qwen3_id_builds_as_qwen3_with_the_counted_weights() -> None:
    """`--simulate` builds a catalog id without a config.json from hf_config: a compact Qwen3 entry is a Qwen3 (q/k
    norms, no q/k/v biases), not a Qwen2, and its weights are the ones the planner counts."""
    shape = resolve_shape("Qwen/Qwen3-0.6B")
    config = hf_config(shape)
    assert config.model_type == "qwen3"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == shape.params()
