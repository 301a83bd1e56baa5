"""QLoRA on a mixture as transformers 5 and peft 0.21 run it: bitsandbytes' 4-bit loading swaps nn.Linear modules
only, so the fused expert stacks stay unquantized, fp32 after prepare_model_for_kbit_training, and the grouped
experts run in fp32 under fp16 or bf16 autocast. The blocks' other linears are the Linear4bit stand-in of
tests/test_plan_qlora_stream.py, swapped in by transformers' own test (`type(module) is nn.Linear`)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM

from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.activations import block_activation_bytes_per_token, lora_expert_copy_bytes
from shardfit.plan.estimate import expert_block_bytes
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.precision import experts_stay_16bit
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.weight_bytes import linear_weight_bytes
from shardfit.plan.workload import Workload
from tests.families import tiny_text_config
from tests.helpers import freeze_block_linears
from tests.test_plan_moe_saved import _routing
from tests.test_plan_qlora_stream import FrozenLinear4bit

JOBS = Path(__file__).parent / "foreign_jobs"

RANK = 8
NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(family: str) -> object:
    """A tiny `family` config, 8 experts, top 2."""
    config = tiny_text_config(family)
    config.num_experts_per_tok = 2
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 8)
    config._attn_implementation = "eager" if family == "gpt-oss" else "sdpa"
    return config


def _qlora(family: str, compute: torch.dtype) -> torch.nn.Module:
    """The tiny model loaded in fp16 as transformers' bitsandbytes loading leaves it, prepared, with LoRA on the
    usual seven names (peft rewrites gate/up/down onto Qwen3-MoE's fused weights; gpt-oss's experts take none)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float16)
    for layer in model.model.layers:
        _routing(layer.mlp)

    def frozen(child: torch.nn.Linear) -> FrozenLinear4bit:
        layer = FrozenLinear4bit(child.in_features, child.out_features, bias=child.bias is not None)
        layer.compute_dtype = compute
        return layer
    freeze_block_linears(model, frozen)
    model.is_loaded_in_4bit = True
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules=NAMES, lora_dropout=0.0))


def _block_saved(family: str, compute: torch.dtype, autocast: torch.dtype | None, seq: int) -> int:
    """Bytes autograd keeps while the second block runs (weights, the merged expert weights' sources and rotary
    cos/sin left out; the merged weights themselves are counted: they do not grow with the tokens)."""
    model = _qlora(family, compute)
    block = model.base_model.model.model.layers[1]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}
    inside = [False]

    def shared(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        weights.update(t.untyped_storage().data_ptr() for t in kwargs.get("position_embeddings", ()))

    block.register_forward_pre_hook(shared, with_kwargs=True)
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 256, (1, seq))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
            model(input_ids=ids)
    return sum(kept.values())


def _shape_and_workload(family: str, precision: str) -> tuple:
    """The tiny model's shape and the QLoRA workload a transformers-5 reader plans for it."""
    folder = Path(tempfile.mkdtemp())
    _config(family).save_pretrained(folder)
    shape = resolve_shape(str(folder))
    moe = family != "gpt-oss"
    w = Workload(method="qlora", precision=precision, grad_ckpt="none", lora_rank=RANK, frozen_fp32=True,
                 quant_backend="bnb", attention="eager" if family == "gpt-oss" else "flash", seq_len=128,
                 lora_experts=moe, lora_rewritten=("gate_up", "down") if moe else None,
                 lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
    return shape, w


@pytest.mark.parametrize("family", ["Qwen3-MoE", "gpt-oss"])
@pytest.mark.parametrize(("compute", "autocast", "precision"), [
    (torch.float16, torch.float16, "fp16"),
    (torch.float32, None, "fp32")])
def test_qlora_mixture_block_runs_fp32_experts(family: str, compute: torch.dtype, autocast: torch.dtype | None,
                                               precision: str) -> None:
    """The block's growth from 64 to 128 tokens within 6 % of the plan's per token (Qwen3-MoE under fp16
    autocast was 20 % light, gpt-oss 31 %: their (token, expert) pairs are fp32; in fp32 Qwen3-MoE was 17 % heavy:
    peft's LoRA on a fused weight keeps no rank-wide tensor per token)."""
    measured = (_block_saved(family, compute, autocast, 128) - _block_saved(family, compute, autocast, 64)) / 64
    shape, w = _shape_and_workload(family, precision)
    assert block_activation_bytes_per_token(shape, w) == pytest.approx(measured, rel=0.06)


@pytest.mark.parametrize("family", ["Qwen3-MoE", "gpt-oss"])
def test_qlora_mixture_weights_as_loaded(family: str) -> None:
    """A mixture's routed experts as the prepared model holds them (fp32 stacks, not NF4), in the plan's block
    weights (`expert_block_bytes`, and the block's stored linears that FSDP gathers, `linear_weight_bytes`)."""
    block = _qlora(family, torch.float16).base_model.model.model.layers[1]
    stacks = sum(p.numel() * p.element_size() for n, p in block.named_parameters()
                 if ".experts." in n and "lora_" not in n and p.dim() == 3)
    shape, w = _shape_and_workload(family, "fp16")
    assert expert_block_bytes(shape, w) == pytest.approx(stacks, rel=0.01)
    assert linear_weight_bytes(shape, w) > stacks


@pytest.mark.parametrize(("model", "version", "dense"), [
    ("Qwen/Qwen3-30B-A3B", "5.0.0", True),
    ("Qwen/Qwen3-30B-A3B", "4.57.1", False),
    (None, "5.0.0", False)])
def test_a_tool_s_qlora_plans_fused_experts_unquantized(model: str | None, version: str, dense: bool) -> None:
    """An axolotl QLoRA job (load_in_4bit, prepare_model_for_kbit_training) of Qwen3-30B-A3B under transformers 5
    plans its experts unquantized and says so; under transformers 4 (an nn.Linear per expert) and on a dense model
    (the file's Llama 3.1 8B) they are NF4."""
    job = read_job("axolotl", str(JOBS / "axolotl/llama31_8b_qlora.yml"), JobOptions(model=model, transformers=version))
    shape = resolve_shape(job.model)
    assert experts_stay_16bit(shape, job.workload) is dense
    notes = make_plan(shape, job.workload, parse_gpus("1xH200", 1, None), ("single",)).notes
    assert any(n.startswith("the routed experts stay fp32") for n in notes) is dense


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_engines_that_cast_the_parameters_keep_16bit_expert_tensors(strategy: str) -> None:
    """FSDP and DeepSpeed hand the grouped matmuls 16-bit copies of the stacks peft upcast (a review measured
    FSDP2's `_grouped_mm` in bf16 on the CPU): the experts' saved tensors and LoRA's merged copy are 16-bit under
    them, as without the upcast; on one GPU or DDP the upcast keeps them fp32 (the time side reads the same rule)."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    w = Workload(method="qlora", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="none", quant_backend="bnb")
    up = dataclasses.replace(w, frozen_fp32=True)
    assert block_activation_bytes_per_token(shape, up, strategy) == block_activation_bytes_per_token(shape, w, strategy)
    assert lora_expert_copy_bytes(shape, up, strategy) == lora_expert_copy_bytes(shape, w, strategy)
    assert block_activation_bytes_per_token(shape, up, "ddp") > block_activation_bytes_per_token(shape, w, "ddp")
    assert lora_expert_copy_bytes(shape, up, "single") > lora_expert_copy_bytes(shape, w, "single")
