"""The planner's bf16 activations for the GPU check's speed runs (Qwen2.5-0.5B, seq 2048, micro_batch 4, no
checkpointing, bf16 autocast, rows of one example each): against what the training step keeps, traced on CPU, and
against the peak the H200 measured (bench/results/gpu_check_h200.json, a measured record; its rows' widths from
bench/results/gpu_check_h200_rows.json)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from shardfit.config import Config, LoraSettings
from shardfit.models.adapters import apply_lora, skip_adapter_input_casts
from shardfit.plan.activations import block_activation_bytes_per_token
from shardfit.plan.adapters import lora_params
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.precision import autocast_fp32_master, casts_fp32_trainables
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload, workload_of
from tests.helpers import saved_storage_bytes

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
SHAPE = resolve_shape("Qwen/Qwen2.5-0.5B")


def speed_run(method: str, seq_len: int = 2048) -> Workload:
    """The speed run's config as shardfit plans it (`workload_of`), its rows of one example each: SDPA without a
    mask, so the attention keeps what a flash kernel keeps (`attention: flash`)."""
    cfg = Config(model=SHAPE.id, method=method, precision="bf16", max_seq_len=seq_len, micro_batch=4,
                 grad_ckpt="none", lora=LoraSettings(rank=16, alpha=32))
    return replace(workload_of(cfg), attention="flash")


def _saved_bytes(method: str, layers: int, seq: int, rows: int = 2) -> int:
    """What autograd keeps for backward after one forward of the training module under bf16 autocast, as
    train/recipe.py runs it (LoRA: peft's input casts off), over rows of one example (no mask); weights excluded.
    Fake tensors: the saved tensors' storages are counted, nothing is computed."""
    config = Qwen2Config(hidden_size=SHAPE.hidden, intermediate_size=SHAPE.intermediate, num_hidden_layers=layers,
                         num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.kv_heads, vocab_size=1024,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=16, alpha=32))
        assert skip_adapter_input_casts(model) > 0

    def forward(module: torch.nn.Module) -> object:  # the batch's words, as data/loader.py gives them
        ids = torch.zeros(rows, seq, dtype=torch.long)
        return module(ids, torch.arange(seq).expand(rows, seq), ids, restarts=False)

    return saved_storage_bytes(model, forward,
                               torch.autocast("cpu", dtype=torch.bfloat16))


@pytest.mark.parametrize("method", ["lora", "full"])
def test_block_term_matches_the_traced_step(method: str) -> None:
    """One decoder block of the speed run's width: the planner's bytes (its saved tensors per token, and the
    16-bit casts autocast keeps of the block's fp32 weights: a full fine-tune's, LoRA's adapters) equal what
    autograd keeps, within 5 %. For LoRA the block keeps no 16-bit copies of the adapters' inputs: shardfit
    switches peft's fp32 cast off under autocast."""
    rows, seq = 2, 1024
    per_block = _saved_bytes(method, 2, seq, rows) - _saved_bytes(method, 1, seq, rows)
    w = speed_run(method, seq)
    casts = 2 * SHAPE.layer_params() if autocast_fp32_master(w, "single") else \
        2 * lora_params(SHAPE, w) / SHAPE.layers if casts_fp32_trainables(w, "single") else 0
    predicted = rows * seq * block_activation_bytes_per_token(SHAPE, w) + casts
    assert predicted == pytest.approx(per_block, rel=0.05)


def test_adapter_input_casts_are_four_hidden_copies_per_block() -> None:
    """With peft's cast (other tools' runs) a LoRA block keeps four more 16-bit hidden-size tensors."""
    w = speed_run("lora")
    with_casts = replace(w, adapter_input_casts=True)
    extra = block_activation_bytes_per_token(SHAPE, with_casts) - block_activation_bytes_per_token(SHAPE, w)
    assert extra == 4 * 2 * SHAPE.hidden


@pytest.mark.parametrize("method", ["full", "lora"])
def test_h200_speed_runs_within_the_plan(method: str) -> None:
    """The H200's peak allocated memory (measured record) against the plan's tensors: within 3 % at the width the
    micro-batches really had (the widest example, bench/results/gpu_check_h200_rows.json), and at the configured
    max_seq_len the plan is an upper bound within 10 %."""
    measured = json.loads((RESULTS / "gpu_check_h200.json").read_text())["speed"][method]["shardfit"]["memory"]
    widest = json.loads((RESULTS / "gpu_check_h200_rows.json").read_text())["runs"]["12_steps"]["widest"]
    h200 = parse_gpus("1xH200")

    def tensors(seq_len: int) -> float:
        b = estimate(SHAPE, speed_run(method, seq_len), h200, "single").per_gpu_gib
        return b.total - b.allocator_reserve - b.runtime_overhead

    assert measured["measured_gib"] / tensors(widest) == pytest.approx(1.0, abs=0.03)
    assert 0.9 <= measured["measured_gib"] / tensors(2048) <= 1.0
