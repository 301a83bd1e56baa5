"""DeepSpeed with bf16 or fp16 casts every floating-point parameter to that dtype when it wraps the model
(runtime/engine.py `_cast_module_mixed_precision`), so what peft's prepare_model_for_kbit_training upcast to fp32
(the routed expert stacks bitsandbytes leaves unquantized, norms, embedding) is 16-bit again: the plan's
DeepSpeed memory and a DeepSpeed job's workload hold no `frozen_fp32` there (plan/deepspeed.py
`as_deepspeed_runs`)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.deepspeed import ZeroSettings, as_deepspeed_runs, estimate_deepspeed, zero_memory
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

JOBS = Path(__file__).parent / "foreign_jobs"
QLORA = Workload(method="qlora", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="full",
                 quant_backend="bnb", frozen_fp32=True)


def test_deepspeed_s_cast_leaves_peft_s_fp32_experts_16bit() -> None:
    """A tiny Qwen3-MoE (fused 3-D expert stacks, as bitsandbytes leaves them) upcast by peft, then through
    DeepSpeed's own cast for bf16: every parameter is bf16 again, the experts' stacks included."""
    engine = pytest.importorskip("deepspeed.runtime.engine", reason="DeepSpeed is not installed: its cast is not run")
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            vocab_size=128)
    model = prepare_model_for_kbit_training(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16),
                                            use_gradient_checkpointing=False)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.float32 for p in experts)  # peft's upcast, as the plan's fp32 rule
    holder = type("Holder", (), {})()
    holder.module = model
    engine.DeepSpeedEngine._cast_module_mixed_precision(holder, torch.bfloat16, None, False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_memory_holds_the_experts_in_16_bits(stage: int) -> None:
    """Qwen3-30B-A3B bitsandbytes QLoRA on 8 ranks: with bf16 the upcast leaves no trace in the model DeepSpeed
    holds (an fp32 run has nothing to cast: its weights were fp32 already)."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    z = ZeroSettings(stage=stage)
    hw = parse_gpus("8xA100-80G")
    kept = estimate_deepspeed(shape, QLORA, hw, z).per_gpu_gib.weights
    assert kept == estimate_deepspeed(shape, dataclasses.replace(QLORA, frozen_fp32=False), hw, z).per_gpu_gib.weights
    assert zero_memory(shape, as_deepspeed_runs(QLORA), 8, z) == \
        zero_memory(shape, dataclasses.replace(QLORA, frozen_fp32=False), 8, z)
    fp32 = dataclasses.replace(QLORA, precision="fp32")
    assert as_deepspeed_runs(fp32) == fp32


def test_an_axolotl_qlora_under_deepspeed_plans_16bit_frozen_weights() -> None:
    """axolotl's QLoRA of Qwen3-30B-A3B with a ZeRO-2 JSON: the job's workload (which the time model reads too)
    has no fp32 frozen weights, and a note says why; without the JSON peft's upcast stays."""
    folder = Path(tempfile.mkdtemp())
    shutil.copy(JOBS / "deepspeed" / "ds_z2.json", folder / "ds_z2.json")
    text = (JOBS / "axolotl" / "llama31_8b_qlora.yml").read_text().replace("meta-llama/Llama-3.1-8B",
                                                                          "Qwen/Qwen3-30B-A3B")
    (folder / "plain.yml").write_text(text)
    (folder / "job.yml").write_text(text + "deepspeed: ds_z2.json\n")
    plain = read_job("axolotl", str(folder / "plain.yml"), JobOptions())
    job = read_job("axolotl", str(folder / "job.yml"), JobOptions())
    assert plain.workload.frozen_fp32 and job.engine == "deepspeed"
    assert not job.workload.frozen_fp32
    assert any("_cast_module_mixed_precision" in n for n in job.notes)


def test_a_long_row_without_checkpointing_peaks_inside_the_body_under_deepspeed_too() -> None:
    """A small-vocabulary Qwen2 LoRA on one 8192-token row without checkpointing: the body's own forward peak (its
    mask, the last block at its down projection) outweighs the loss under DeepSpeed as under FSDP, so the
    ZeRO-3 plan peaks there (plan/activations.py `forward_activation_bytes`, phase body)."""
    from shardfit.plan.activations import forward_activation_bytes
    from shardfit.plan.config_shape import shape_from_config

    shape = shape_from_config({"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256,
                               "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 512, "tie_word_embeddings": False}, "tiny-qwen2")
    w = Workload(method="lora", precision="bf16", seq_len=8192, micro_batch=1, grad_ckpt="none")
    body = forward_activation_bytes(shape, as_deepspeed_runs(w), shape.layers, "zero3", "body")
    assert body > forward_activation_bytes(shape, as_deepspeed_runs(w), shape.layers, "zero3")
    c = estimate_deepspeed(shape, w, parse_gpus("1xA100-80G"), ZeroSettings(stage=3))
    assert c.peak_phase == "forward" and c.per_gpu_gib.activations == pytest.approx(body / 2**30, rel=1e-3)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_counts_the_images_as_the_other_engines_do(stage: int) -> None:
    """Qwen2-VL-7B LoRA with four 448x448 images a row under ZeRO-2/3: the pixels and the frozen tower's outputs are
    held through the step under DeepSpeed too (plan/activations.py `image_activation_bytes`), so its activations grow
    by exactly that much over the same job without images."""
    from shardfit.plan.activations import image_activation_bytes

    shape = resolve_shape("Qwen/Qwen2-VL-7B-Instruct")
    text = Workload(method="lora", precision="bf16", seq_len=4096, micro_batch=1, grad_ckpt="full")
    images = dataclasses.replace(text, images=4, image_rows=32, image_cols=32)
    strategy = "zero3" if stage == 3 else "zero2"
    media = image_activation_bytes(shape, as_deepspeed_runs(images), strategy)
    assert media > 2**20
    hw, z = parse_gpus("8xA100-80G"), ZeroSettings(stage=stage)
    without, with_images = (estimate_deepspeed(shape, job, hw, z).per_gpu_gib for job in (text, images))
    assert with_images.activations - without.activations == pytest.approx(media / 2**30, abs=0.006)
