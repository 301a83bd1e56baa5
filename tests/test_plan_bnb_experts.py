"""bitsandbytes QLoRA of a mixture: transformers 5's fused 3-D expert stacks are not nn.Linear layers, so its 4-bit
loading leaves them in the load dtype (integrations/bitsandbytes.py `replace_with_bnb_linear`); the plan stores
them in 16 bits there, and in NF4 where they are quantized (shardfit's torchao path, transformers 4's nn.Linear
per expert, axolotl's `quantize_moe_experts`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan import quant
from shardfit.plan.adapters import lora_expert_params
from shardfit.plan.estimate import estimate, expert_block_bytes, state_bytes
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

GIB = 2**30
BNB = Workload(method="qlora", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="full",
               quant_backend="bnb")


def _experts(shape_id: str) -> tuple[float, float]:
    """(16-bit, NF4) bytes of the whole model's routed expert stacks."""
    shape = resolve_shape(shape_id)
    stacks = [(r, c) for n, r, c in shape.stored_weights(True) if n.startswith("expert_")]
    bf16 = shape.moe_layers * sum(r * c * 2 for r, c in stacks)
    nf4 = shape.moe_layers * sum(quant.weight_bytes(r, c, 2, True) for r, c in stacks)
    return float(bf16), float(nf4)


@pytest.mark.parametrize("model", ["mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B", "openai/gpt-oss-20b"])
def test_bnb_keeps_fused_experts_in_16_bits(model: str) -> None:
    """Under transformers 5 bitsandbytes' weights exceed torchao's by the expert stacks' 16-bit less NF4 bytes
    (Mixtral-8x7B: 45 B routed weights, about 62 GiB more); the plan says so in a note."""
    shape = resolve_shape(model)
    bf16, nf4 = _experts(model)
    torchao = dataclasses.replace(BNB, quant_backend="torchao")
    gap = state_bytes(shape, BNB)[0] - state_bytes(shape, torchao)[0]
    assert gap == pytest.approx(bf16 - nf4, rel=1e-9)
    if model.startswith("mistralai"):
        assert gap / GIB > 60
    notes = make_plan(shape, BNB, parse_gpus("1xH200", 1, None), ("single",)).notes
    assert any(n.startswith("the routed experts stay bf16 under bitsandbytes") for n in notes)
    assert any("MXFP4" in n for n in notes) == (model == "openai/gpt-oss-20b")
    assert not any("routed experts stay" in n for n in make_plan(shape, torchao, parse_gpus("1xH200", 1, None),
                                                                   ("single",)).notes)


def test_transformers_4_experts_are_nn_linear_and_nf4() -> None:
    """transformers 4 builds an nn.Linear per Mixtral expert, which bitsandbytes replaces: NF4 as torchao's; gpt-oss's
    class is fused in every version, so its stacks stay 16-bit."""
    old = dataclasses.replace(BNB, fused_experts=False)
    mixtral = resolve_shape("mistralai/Mixtral-8x7B-v0.1")
    assert state_bytes(mixtral, old)[0] == state_bytes(mixtral, dataclasses.replace(old, quant_backend="torchao"))[0]
    oss = resolve_shape("openai/gpt-oss-20b")
    assert state_bytes(oss, old)[0] == state_bytes(oss, BNB)[0]


def test_bnb_experts_move_off_a_rank_in_16_bits() -> None:
    """Expert parallelism takes (N-1)/N of the experts as they are stored: their 16-bit stacks under bitsandbytes,
    not NF4 (and the expert adapters at fp32)."""
    shape, hw = resolve_shape("Qwen/Qwen3-30B-A3B"), parse_gpus("8xH100", 1, None)
    bf16, _ = _experts("Qwen/Qwen3-30B-A3B")
    ep = dataclasses.replace(BNB, expert_parallel=8)
    one, got = estimate(shape, BNB, hw, "ddp").per_gpu_gib, estimate(shape, ep, hw, "ddp").per_gpu_gib
    assert one.weights - got.weights == pytest.approx((bf16 + lora_expert_params(shape, BNB) * 4) * 7 / 8 / GIB,
                                                      rel=1e-6)
    row = estimate(shape, ep, hw, "zero3").per_gpu_gib
    assert min(row.weights, row.grads, row.optimizer, row.activations, row.logits, row.temporaries) >= 0


@pytest.mark.parametrize(("version", "extra", "nf4"), [("5.2", "", False), ("4.57", "", True),
                                                       ("5.2", "quantize_moe_experts: true\n", True)])
def test_tools_plan_experts_as_their_transformers_loads_them(tmp_path: Path, version: str, extra: str,
                                                             nf4: bool) -> None:
    """An axolotl QLoRA job of Qwen3-30B-A3B: under transformers 5 experts bitsandbytes leaves alone, which
    prepare_model_for_kbit_training (axolotl's QLoRA, `frozen_fp32`) upcasts to fp32, unless `quantize_moe_experts`
    quantizes them on load; NF4 under transformers 4."""
    text = ("base_model: Qwen/Qwen3-30B-A3B\nadapter: qlora\nload_in_4bit: true\nlora_target_modules: [q_proj]\n"
            "sequence_len: 4096\nbf16: true\ngradient_checkpointing: true\n" + extra)
    path = tmp_path / "moe.yml"
    path.write_text(text)
    w = read_job("axolotl", str(path), JobOptions(transformers=version)).workload
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    bf16, low = _experts("Qwen/Qwen3-30B-A3B")
    gap = state_bytes(shape, w)[0] - state_bytes(shape, dataclasses.replace(w, quant_backend="torchao"))[0]
    assert w.frozen_fp32 is not nf4  # axolotl's cast back leaves fp32 only on the unquantized experts
    assert gap == pytest.approx(0.0 if nf4 else 2 * bf16 - low, abs=1.0)


def test_a_negative_part_is_an_internal_error_naming_it() -> None:
    """A part below zero (two paths counting the same bytes differently) raises PlannerBug naming the strategy and
    the part: an exception, which `python -O` keeps, not an assertion."""
    from shardfit.errors import PlannerBug
    from shardfit.plan.estimate import Breakdown, add_runtime_overhead
    with pytest.raises(PlannerBug, match="plan of ddp has -1.000 GiB of optimizer"):
        add_runtime_overhead(Breakdown(weights=4.0, optimizer=-1.0), parse_gpus("8xH100", 1, None), "ddp")


def test_prepare_model_for_kbit_training_upcasts_the_16bit_experts() -> None:
    """peft's prepare_model_for_kbit_training (`frozen_fp32`) casts every 16-bit parameter but Params4bit to fp32:
    the fused expert stacks bitsandbytes left alone then take 4 bytes a weight, and the note says fp32."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    fp32 = dataclasses.replace(BNB, frozen_fp32=True)
    bf16, _ = _experts("Qwen/Qwen3-30B-A3B")
    gap = state_bytes(shape, fp32)[0] - state_bytes(shape, dataclasses.replace(fp32, quantize_fused_experts=True))[0]
    _, nf4 = _experts("Qwen/Qwen3-30B-A3B")
    assert gap == pytest.approx(2 * bf16 - nf4, rel=1e-9)
    notes = make_plan(shape, fp32, parse_gpus("1xH200", 1, None), ("single",)).notes
    assert any(n.startswith("the routed experts stay fp32") for n in notes)


def test_bnb_quantizes_llama_4_s_experts_unfused_first() -> None:
    """transformers swaps Llama 4's fused Llama4TextExperts for an nn.Linear per expert before a bitsandbytes
    load (quantizers/base.py MODULES_TO_PATCH_FOR_QUANTIZATION), so its experts are NF4 as torchao's, with no note."""
    shape = resolve_shape("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    fp32 = dataclasses.replace(BNB, frozen_fp32=True)
    torchao = dataclasses.replace(fp32, quant_backend="torchao")
    assert expert_block_bytes(shape, fp32) == expert_block_bytes(shape, torchao)
    notes = make_plan(shape, fp32, parse_gpus("8xH200", 1, None), ("ddp",)).notes
    assert not any("routed experts stay" in n for n in notes)
