"""The planner's count of DeepSeek's latent attention against what autograd saves in the real transformers block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from shardfit.models.build import build_model
from shardfit.plan.activations import activation_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.simulate.gpu_kernels import sdpa_as_on_a_gpu
from shardfit.simulate.step import packed_positions, workload_config
from tests.families import tiny_text_config
from tests.helpers import saved_storage_bytes

# Two sets of widths, q/k heads wider than v heads as in DeepSeek-V3 (its q latent absent in the second); latents
# wide enough that the estimate without their count misses by more than the tolerance.
WIDTHS = {
    "narrow": dict(hidden_size=64, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=8,
                   v_head_dim=8),
    "wide": dict(hidden_size=128, num_attention_heads=8, q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24,
                 v_head_dim=16),
}


def _saved_bytes(folder: Path, w: Workload) -> int:
    """Bytes of the unique storages autograd keeps after one forward of the training module (weights excluded),
    on fake tensors, with attention run as a GPU runs it."""
    model = build_model(workload_config(w, str(folder)), "single", weights=False,
                        config=AutoConfig.from_pretrained(folder))
    def forward(module: torch.nn.Module) -> object:
        ids = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)
        return module(ids, packed_positions(w.micro_batch, w.seq_len), ids)

    return saved_storage_bytes(model, forward,
                               torch.autocast("cpu", dtype=torch.bfloat16), sdpa_as_on_a_gpu())


def _dense_block(family: str, widths: dict, w: Workload, tmp: Path) -> tuple[float, float]:
    """(measured, estimated) bytes per token of one dense block of `family` at `widths`: the difference between a
    2-block and a 1-block model."""
    saved, predicted = {}, {}
    for layers in (1, 2):
        config = tiny_text_config(family)
        for key, value in {**widths, "num_hidden_layers": layers, "first_k_dense_replace": layers}.items():
            setattr(config, key, value)
        folder = tmp / f"{family}-{layers}"
        config.save_pretrained(folder)
        saved[layers] = _saved_bytes(folder, w)
        predicted[layers] = activation_bytes(resolve_shape(str(folder)), w, layers)
    return (saved[2] - saved[1]) / w.tokens, (predicted[2] - predicted[1]) / w.tokens


def _workload(method: str) -> Workload:
    return Workload(method=method, precision="bf16", seq_len=128, micro_batch=2, grad_ckpt="none", lora_rank=8,
                    attention="sdpa")


@pytest.mark.parametrize("widths", list(WIDTHS))
def test_latent_attention_block_matches_saved_tensors(tmp_path: Path, widths: str) -> None:
    """A full fine-tune's dense DeepSeek-V3 block (latent attention, its MLP) saves what the estimate counts per
    token, within 3%, at two sets of widths."""
    sizes = {**WIDTHS[widths], "num_key_value_heads": WIDTHS[widths]["num_attention_heads"]}
    measured, predicted = _dense_block("DeepSeek-V3", sizes, _workload("full"), tmp_path)
    assert predicted == pytest.approx(measured, rel=0.03)


def test_latent_attention_lora_matches_llama_attention_difference(tmp_path: Path) -> None:
    """LoRA: what latent attention saves beyond Llama's attention of the same heads (GLM-4.5's block at the same
    sizes, its dense MLP the same) is what the estimate adds for it, within 3% of the block. The comparison is
    relative because the Llama block's own LoRA count is high by about a fifth at these tiny widths, equally for
    both (tests/test_plan_activations.py checks it at real ones)."""
    w = _workload("lora")
    mla, mla_predicted = _dense_block("DeepSeek-V3", {**WIDTHS["narrow"], "num_key_value_heads": 4}, w, tmp_path)
    llama, llama_predicted = _dense_block("GLM-4.5", {"hidden_size": 64, "num_attention_heads": 4,
                                                      "num_key_value_heads": 4, "head_dim": 16}, w, tmp_path)
    assert mla_predicted - llama_predicted == pytest.approx(mla - llama, abs=0.03 * mla)
