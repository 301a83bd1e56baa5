"""A Gated DeltaNet hybrid (Qwen3.5's text model, tiny) trains with LoRA on one CPU process, and its plan counts the
adapters the run saves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers import read_jsonl, run_here, save_with_tokenizer, train_here, write_config


@pytest.mark.slow
def test_tiny_qwen3_5_trains_two_lora_steps(tmp_path: Path, tokenizer_dir: Path, small_data: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_5_text", num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=True)
    model = save_with_tokenizer(AutoModelForCausalLM.from_config(config), tmp_path / "model", tokenizer_dir)
    cfg = write_config(tmp_path / "run.yaml", model=str(model), data=str(small_data), output_dir=str(tmp_path / "run"),
                       method="lora", precision="fp32", max_seq_len=128, micro_batch=2, log_steps=1, save_steps=100,
                       eval_steps=100, max_steps=2, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, resume="never",
                       lr=1e-2)
    train_here(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics), metrics
    saved = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert any(".linear_attn.in_proj_qkv.lora_A" in k for k in saved), sorted(saved)[:8]
    code, out, err = run_here(capsys, "plan", "--model", str(model), "--gpus", "1x80GB", "--method", "lora",
                              "--lora-rank", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["trainable_params"] == sum(t.numel() for t in saved.values())


def _tiny_hybrid(tmp_path: Path, tokenizer_dir: Path) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_5_text", num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=True, layer_types=["linear_attention", "full_attention"])
    return save_with_tokenizer(AutoModelForCausalLM.from_config(config), tmp_path / "model", tokenizer_dir)


def test_a_recurrent_models_rows_stay_unpacked(tmp_path: Path, tokenizer_dir: Path, small_data: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    """A Gated DeltaNet block's state runs along the whole row, past the packed-row mask: packing two examples into
    one row changes the second one's loss (shown on the model itself), so a recurrent model trains on unpacked rows
    whatever `packing` says, and the start line says why; the run's config keeps the user's setting."""
    from shardfit.plan.attention_layout import carries_state

    model_dir = _tiny_hybrid(tmp_path, tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert carries_state(model.config)
    assert not carries_state(AutoConfig.for_model("llama", num_hidden_layers=2))
    first, second = torch.randint(3, 400, (1, 12)), torch.randint(3, 400, (1, 12))
    with torch.no_grad():
        alone = model(second).logits
        # Packed after `first` with its positions restarted: attention cannot see `first`, the recurrent state can.
        packed = model(torch.cat([first, second], 1), position_ids=torch.cat([torch.arange(12)] * 2)[None]).logits
    assert not torch.allclose(alone, packed[:, 12:], atol=1e-4)
    cfg = write_config(tmp_path / "run.yaml", model=str(model_dir), data=str(small_data),
                       output_dir=str(tmp_path / "run"), method="lora", precision="fp32", max_seq_len=128,
                       micro_batch=4, max_steps=1, lora={"rank": 4, "alpha": 8}, resume="never", packing=True,
                       save_steps=100, eval_steps=100)
    train_here(cfg)
    out = capsys.readouterr().out
    assert "unpacked: recurrent blocks would carry one example's state into the next" in out, out[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["packing"] is False
