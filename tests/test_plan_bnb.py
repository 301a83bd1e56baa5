"""The planner's bitsandbytes terms: the QLoRA compute dtype and bitsandbytes' AdamW states."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardfit.cli.main import main
from shardfit.foreign.common import bitsandbytes_optimizer, optimizer_keys
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.adapters import lora_params
from shardfit.plan.backward_temps import dequantize_bytes
from shardfit.plan.estimate import state_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

SHAPE = resolve_shape("meta-llama/Llama-2-7b-hf")


@pytest.mark.parametrize(("precision", "frozen_fp32", "compute_fp32", "pure", "per_weight"), [
    ("bf16", False, False, False, 2), ("fp16", False, True, False, 2),  # autocast: a 16-bit gradient
    ("fp16", True, True, False, 2),
    ("fp32", True, False, False, 6),  # a 16-bit model made fp32 by prepare_model_for_kbit_training, no autocast
    ("bf16", False, True, True, 6), ("bf16", False, False, True, 2),  # pure bf16: the compute dtype decides
    ("fp32", False, False, False, 4)])  # loaded in fp32: no cast
def test_bnb_dequantized_weight_in_the_gradients_dtype(precision: str, frozen_fp32: bool, compute_fp32: bool,
                                                        pure: bool, per_weight: int) -> None:
    """bitsandbytes' MatMul4Bit.backward dequantizes the weight in the dtype the model was loaded in and casts it
    to the incoming gradient's dtype: 16-bit under autocast, else the layer's compute dtype (transformers'
    default: fp32). An fp32 gradient and a 16-bit model hold 6 bytes an element of the largest weight (measured
    on bitsandbytes 0.50.2's CPU backend: 6.0 without autocast, 2.1 under fp16 autocast)."""
    w = Workload(method="qlora", precision=precision, quant_backend="bnb", seq_len=1024, micro_batch=2,
                 frozen_fp32=frozen_fp32, bnb_compute_fp32=compute_fp32, pure_16bit=pure)
    largest = SHAPE.hidden * SHAPE.intermediate  # gate/up/down: 4096 x 11008
    # down_proj's input gradient: fp32 in the fp32 stream prepare_model_for_kbit_training makes, and in an fp32
    # compute dtype with or without autocast (bitsandbytes 0.50.2 CPU, MemTracker: 6.51 bytes per token x input
    # feature with a bf16 compute dtype, 8.51 with fp32, under bf16 autocast too)
    grad_input = w.tokens * SHAPE.intermediate * (4 if frozen_fp32 or precision == "fp32" or compute_fp32 else 2)
    assert dequantize_bytes(SHAPE, w) == largest * per_weight + grad_input


def test_bitsandbytes_32bit_adamw_keeps_fp32_states_of_16bit_adapters() -> None:
    """bitsandbytes' 32-bit AdamW (paged_adamw_32bit) allocates its two states in fp32 whatever the weight's dtype;
    torch's AdamW keeps them in the weight's own: 16-bit adapters (LLaMA-Factory's pure_bf16) need 8 bytes a
    weight of states under the first, 4 under the second. 8-bit states are a byte each and their blocks' absmax."""
    w = Workload(method="lora", adapters_16bit=True, lora_rank=16)
    t = lora_params(SHAPE, w)
    assert state_bytes(SHAPE, w)[2] == 4 * t
    assert state_bytes(SHAPE, replace(w, bnb_optimizer=True))[2] == 8 * t
    # 8-bit states: a byte each and an fp32 absmax per 256 elements of each (bitsandbytes' blockwise states)
    assert state_bytes(SHAPE, replace(w, bnb_optimizer=True, optimizer="adamw8bit"))[2] == 2 * t * (1 + 4 / 256)
    fp32_adapters = replace(w, adapters_16bit=False)
    assert state_bytes(SHAPE, replace(fp32_adapters, bnb_optimizer=True))[2] == state_bytes(SHAPE, fp32_adapters)[2]


def test_tools_bitsandbytes_optimizer_names(tmp_path) -> None:  # noqa: ANN001
    """The HF Trainer's bitsandbytes AdamW names (8-bit and paged) set `bnb_optimizer`, torch's do not; a
    LLaMA-Factory LoRA run in pure bf16 with paged_adamw_32bit plans fp32 states for its bf16 adapters."""
    assert all(bitsandbytes_optimizer(n) for n in ("paged_adamw_32bit", "PAGED_ADAMW_8BIT", "adamw_bnb_8bit",
                                                   "adamw_8bit"))
    assert not any(bitsandbytes_optimizer(n) for n in ("adamw_torch", "adamw_torch_fused", "adamw_hf"))
    assert optimizer_keys("paged_adamw_32bit", "4.56.0", [])["bnb_optimizer"]
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: sft\nfinetuning_type: lora\n"
                   "optim: paged_adamw_32bit\npure_bf16: true\ncutoff_len: 1024\nper_device_train_batch_size: 1\n")
    w = read_job("llamafactory", str(cfg), JobOptions()).workload
    assert w.adapters_16bit and w.bnb_optimizer
    assert state_bytes(SHAPE, w)[2] == 8 * lora_params(SHAPE, w)


def test_plan_flags_set_the_bitsandbytes_keys(capsys: pytest.CaptureFixture) -> None:
    """`plan --bnb-compute-fp32 --bnb-optimizer` plans bitsandbytes' fp32 compute dtype and fp32 AdamW states:
    16-bit adapters' optimizer column doubles."""
    args = ["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpus", "1xT4", "--method", "qlora", "--precision",
            "fp16", "--quant-backend", "bnb", "--adapters-16bit", "--seq", "512", "--batch", "1", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--bnb-compute-fp32", "--bnb-optimizer"]) == 0
    bnb = json.loads(capsys.readouterr().out)
    assert bnb["workload"]["bnb_compute_fp32"] and bnb["workload"]["bnb_optimizer"]
    single = [next(c for c in p["candidates"] if c["strategy"] == "single") for p in (plain, bnb)]
    assert single[1]["per_gpu_gib"]["optimizer"] == pytest.approx(2 * single[0]["per_gpu_gib"]["optimizer"],
                                                                 rel=0.01)


def test_bnb_flags_without_their_run_are_said(capsys: pytest.CaptureFixture) -> None:
    """`--bnb-compute-fp32` on a run bitsandbytes does not compute (LoRA, or QLoRA through torchao) exits 2 naming
    the flags that make it count; `--bnb-optimizer` with 8-bit AdamW plans as before, with a note."""
    args = ["plan", "--model", "meta-llama/Llama-2-7b-hf", "--gpus", "1xA100-80G", "--seq", "512", "--json"]
    for method in (["--method", "lora"], ["--method", "qlora"], ["--method", "qlora", "--quant-backend", "torchao"]):
        assert main([*args, *method, "--bnb-compute-fp32"]) == 2
        assert "--quant-backend bnb" in capsys.readouterr().err
    assert main([*args, "--method", "qlora", "--quant-backend", "bnb", "--bnb-compute-fp32"]) == 0
    capsys.readouterr()
    assert main([*args, "--method", "lora", "--optimizer", "adamw8bit", "--bnb-optimizer"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("--bnb-optimizer with 8-bit AdamW" in n for n in out["notes"])
