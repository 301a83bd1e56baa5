"""The time side of bitsandbytes QLoRA of a mixture: transformers 5's fused expert stacks stay unquantized under
bitsandbytes (plan/precision.py `experts_stay_16bit`, the rule the memory side reads), so a step dequantizes only
the attention's, the shared experts' and the dense blocks' weights, and the experts run as plain matmuls in their
dtype: fp32 where peft's prepare_model_for_kbit_training upcast them (`frozen_fp32`). Dense models, shardfit's
torchao QLoRA (it quantizes the stacks itself) and Llama 4 (its experts are an nn.Linear each under bitsandbytes)
dequantize every decoder linear as before (but the router, which no 4-bit loading replaces), an expert's own
linears per expert that gets tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardfit import strategy as strategies
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.cards import card_of
from shardfit.plan.comms import param_bytes_16, param_bytes_stored
from shardfit.plan.dequant import dequant_bytes, dequant_per_use, dequant_uses, experts_hit
from shardfit.plan.dispatch import DISPATCH_KERNEL_S, DISPATCH_VIEW_S, HOST_SYNC_S, host_dispatch_s
from shardfit.plan.flops import (
    expert_weight_grad_flops_per_token,
    fp32_expert_flops,
    lora_flops_per_token,
    step_flops_per_token,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.timing import micro_batch_work
from shardfit.plan.weight_bytes import stored_linear_bytes
from shardfit.plan.workload import Workload

BNB = Workload(method="qlora", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="full",
               quant_backend="bnb")
TORCHAO = dataclasses.replace(BNB, quant_backend="torchao")
MIXTURES = ["Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1"]
SINGLE = strategies.get("single")
FOREIGN = Path(__file__).parent / "foreign_jobs"


def _linears(shape: ModelShape, experts: bool) -> int:
    """The decoder's linear weights, counted from the blocks' named linears: the routed experts' alone
    (`experts`), or every other one but the router (an nn.Parameter, never 4-bit)."""
    return int(shape.over_blocks(lambda moe: sum(
        i * o for n, i, o in shape.named_linears(moe) if n.startswith("expert_") == experts and n != "router")))


def _all_but_router(shape: ModelShape) -> int:
    """Every decoder linear weight a QLoRA can store in 4 bits: all but the routers."""
    return _linears(shape, experts=False) + _linears(shape, experts=True)


def _dequantized(shape: ModelShape, w: Workload) -> float:
    """Weights dequantized per use, read back from the planned dequantization traffic."""
    return dequant_bytes(shape, w) / (dequant_uses(w) * dequant_per_use(w)[2])


@pytest.mark.parametrize("model", MIXTURES)
def test_bnb_mixture_dequantizes_only_its_4bit_weights(model: str) -> None:
    """bitsandbytes dequantizes attention weights, not the 16-bit routed expert stacks nor the router (never
    4-bit); torchao, which quantizes the stacks, dequantizes them too."""
    shape = resolve_shape(model)
    assert _dequantized(shape, BNB) == pytest.approx(_linears(shape, experts=False), rel=1e-12)
    assert _dequantized(shape, TORCHAO) == pytest.approx(_all_but_router(shape), rel=1e-12)
    # transformers 4 builds an nn.Linear per expert, which bitsandbytes quantizes: every linear again
    old = dataclasses.replace(BNB, fused_experts=False)
    assert _dequantized(shape, old) == pytest.approx(_all_but_router(shape), rel=1e-12)


@pytest.mark.parametrize(("model", "w"), [
    ("meta-llama/Llama-3.1-8B", BNB), ("meta-llama/Llama-3.1-8B", TORCHAO),
    ("Qwen/Qwen3-30B-A3B", TORCHAO), ("mistralai/Mixtral-8x7B-v0.1", dataclasses.replace(BNB, fused_experts=False)),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", BNB), ("Qwen/Qwen3-30B-A3B", BNB)])
def test_whole_dequantization_unless_bnb_leaves_the_stacks(model: str, w: Workload) -> None:
    """Every decoder linear but the router is dequantized for a dense model, shardfit's torchao QLoRA,
    transformers 4's experts and Llama 4 (unfused into an nn.Linear per expert for bitsandbytes); a fused mixture
    under bitsandbytes leaves out exactly its routed experts."""
    shape = resolve_shape(model)
    fused_bnb = shape.moe and w.bnb and w.fused_experts and not shape.every_expert
    expected = _linears(shape, experts=False) if fused_bnb else _all_but_router(shape)
    assert _dequantized(shape, w) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("model", MIXTURES)
def test_bnb_mixture_launches_attention_dequantizations_only(model: str) -> None:
    """The host launches bitsandbytes' dequantization kernels for a mixture's four attention weights per layer
    (no shared experts), not for the experts: where they are 4-bit (transformers 4, an nn.Linear per expert),
    each expert that gets tokens dequantizes its gate, up and down on its own, three per expert hit and use."""
    shape = resolve_shape(model)
    quantized = dataclasses.replace(BNB, fused_experts=False)
    dk, dv, _ = dequant_per_use(BNB)
    assert experts_hit(shape, BNB) == shape.experts  # 1,024 tokens at top-k reach every expert
    saved = shape.layers * 3 * shape.experts * dequant_uses(BNB) * (dk * DISPATCH_KERNEL_S + dv * DISPATCH_VIEW_S)
    assert host_dispatch_s(shape, quantized) - host_dispatch_s(shape, BNB) == pytest.approx(saved, rel=1e-9)


def test_llama4_bnb_launches_as_a_4bit_mixture() -> None:
    """Llama 4's experts are 4-bit under bitsandbytes, an MLP per expert as transformers unfuses them: each layer
    dequantizes its attention and shared expert (7 weights) and the gate, up and down of every one of its 16
    experts (every token runs through each), as a mixture whose experts are 4-bit (Qwen3 under transformers 4)
    dequantizes its attention and each expert hit."""
    shape = resolve_shape("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    qwen = resolve_shape("Qwen/Qwen3-30B-A3B")
    dk, dv, _ = dequant_per_use(BNB)
    per_weight = dequant_uses(BNB) * (dk * DISPATCH_KERNEL_S + dv * DISPATCH_VIEW_S)

    def per_layer(s: ModelShape, w: Workload) -> float:
        return (host_dispatch_s(s, w) - host_dispatch_s(s, dataclasses.replace(w, method="lora"))) / s.layers

    assert per_layer(shape, BNB) == pytest.approx((7 + 3 * 16) * per_weight, rel=1e-9)
    old = dataclasses.replace(BNB, fused_experts=False)
    assert per_layer(qwen, old) == pytest.approx((4 + 3 * 128) * per_weight, rel=1e-9)
    assert host_dispatch_s(qwen, BNB) < host_dispatch_s(qwen, old)


@pytest.mark.parametrize("model", MIXTURES)
def test_fp32_experts_run_at_the_fp32_rate(model: str) -> None:
    """peft's prepare_model_for_kbit_training upcasts bitsandbytes' 16-bit expert stacks to fp32, and transformers'
    grouped experts run in the weights' dtype: the top-k experts' forward, recomputation, input gradient and (LoRA
    folded into the stacks) weight gradient take the fp32 rate instead of the 16-bit one, both at the GEMM
    efficiency: only those matmuls change rate, not the step's other work that the training utilization holds.
    Nothing else in a micro-batch's compute changes with `frozen_fp32`."""
    shape = resolve_shape(model)
    card = card_of(parse_gpus("1xH100", 1, None))
    flops = _routed_flops_per_token(shape) * 4 * BNB.tokens
    extra = micro_batch_work(shape, UPCAST, card, SINGLE).compute - micro_batch_work(shape, BNB, card,
                                                                                        SINGLE).compute
    eff = card.matmul_eff
    assert extra == pytest.approx(flops / (card.dense_flops("fp32") * eff) - flops / (card.dense_flops("bf16") * eff),
                                  rel=1e-9)
    # without the upcast (16-bit experts) and for torchao's NF4 stacks, the experts stay at the 16-bit rate
    torchao = dataclasses.replace(TORCHAO, frozen_fp32=True)
    assert micro_batch_work(shape, torchao, card, SINGLE).compute == micro_batch_work(shape, TORCHAO, card,
                                                                                       SINGLE).compute


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_engines_that_cast_the_parameters_run_the_stacks_in_16_bits(strategy: str) -> None:
    """FSDP (accelerate's MixedPrecision(param_dtype=bf16), shardfit's FSDP2) and DeepSpeed hand the grouped matmul
    16-bit stacks whatever peft upcast (a review measured FSDP2 on the CPU: `_grouped_mm` in bf16): under them the
    upcast costs no fp32 matmuls, no fallback launches and no waits, as it does on one GPU."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    card = card_of(parse_gpus("1xH100", 1, None))
    s = strategies.get(strategy)
    assert micro_batch_work(shape, UPCAST, card, s).compute == micro_batch_work(shape, BNB, card, s).compute
    assert micro_batch_work(shape, UPCAST, card, s).host == micro_batch_work(shape, BNB, card, s).host
    assert micro_batch_work(shape, UPCAST, card, SINGLE).compute > micro_batch_work(shape, BNB, card, SINGLE).compute


@pytest.mark.parametrize("model", MIXTURES)
def test_fsdp_gathers_16bit_stacks_whole(model: str) -> None:
    """FSDP's all-gather carries the packed 4-bit weights, as the memory counts them stored (about 0.516 byte a
    weight), and the 16-bit expert stacks as they are."""
    shape = resolve_shape(model)
    experts = _linears(shape, experts=True)
    gap = param_bytes_16(shape, BNB) - param_bytes_16(shape, TORCHAO)
    nf4 = shape.over_blocks(lambda moe: stored_linear_bytes(shape, TORCHAO, moe, experts_only=True))
    assert gap == pytest.approx(experts * 2 - nf4, rel=1e-9)
    assert nf4 == pytest.approx(experts * (0.5 + 0.127 / 8), rel=0.01)


H200 = card_of(parse_gpus("1xH200", 1, None))
UPCAST = dataclasses.replace(BNB, frozen_fp32=True)


def _fp32_extra(shape: ModelShape, w: Workload) -> float:
    """What the fp32 expert stacks add to a micro-batch's compute (single GPU)."""
    return micro_batch_work(shape, w, H200, SINGLE).compute - \
        micro_batch_work(shape, dataclasses.replace(w, frozen_fp32=False), H200, SINGLE).compute


def test_tf32_runs_the_fp32_experts_at_the_tf32_rate() -> None:
    """A job that turns TF32 on (its `tf32`, or `torch_compile` with bf16 as transformers' TrainingArguments does)
    runs the fp32 stacks' matmuls on the TF32 tensor cores: far less extra time than at plain fp32; an explicit
    `tf32: false` wins over compile."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    plain = _fp32_extra(shape, UPCAST)
    tf32 = _fp32_extra(shape, dataclasses.replace(UPCAST, tf32=True))
    assert 0 < tf32 < plain / 5
    compiled = dataclasses.replace(UPCAST, compile=True)
    assert compiled.fp32_matmuls_tf32 and not dataclasses.replace(compiled, tf32=False).fp32_matmuls_tf32
    assert not dataclasses.replace(compiled, precision="fp16").fp32_matmuls_tf32


@pytest.mark.parametrize("tool", ["axolotl", "hf"])
def test_a_jobs_tf32_key_reaches_the_workload(tool: str, tmp_path: Path) -> None:
    """The job's `tf32` sets the workload's (it was read and dropped as having no effect)."""
    if tool == "axolotl":
        text = (FOREIGN / "axolotl" / "llama31_8b_qlora.yml").read_text()
        on, off = tmp_path / "on.yml", tmp_path / "off.yml"
        on.write_text(text.replace("tf32: false", "tf32: true"))
        off.write_text(text)
    else:
        on, off = tmp_path / "on.sh", tmp_path / "off.sh"
        cmd = "python train.py --model_name_or_path Qwen/Qwen3-30B-A3B --load_in_4bit --use_peft --bf16 True"
        on.write_text(cmd + " --tf32 True\n")
        off.write_text(cmd + "\n")
    assert read_job(tool, str(on), JobOptions()).workload.fp32_matmuls_tf32
    assert not read_job(tool, str(off), JobOptions()).workload.fp32_matmuls_tf32


def _routed_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token of the routed experts' matmuls, over every mixture layer, from the shape's widths."""
    return shape.moe_layers * sum(2.0 * i * o * shape.top_k / shape.experts
                                  for n, i, o in shape.named_linears(True) if n.startswith("expert_"))


@pytest.mark.parametrize("model", MIXTURES)
def test_lora_on_fused_experts_adds_their_weight_gradient(model: str) -> None:
    """peft folds LoRA into the fused stack (W + B A requires grad), so backward runs a full-size weight-gradient
    grouped matmul per stack besides the input gradient (a tiny Qwen3-MoE's backward: twice the forward's
    grouped_mm FLOPs): four fp32 passes with full checkpointing, not three, and one more 16-bit-rate pass in the
    step's FLOPs; transformers 4's nn.Linear experts take LoRA as dense layers do."""
    shape = resolve_shape(model)
    routed = _routed_flops_per_token(shape) * BNB.tokens
    bare = dataclasses.replace(UPCAST, lora_experts=False)
    assert fp32_expert_flops(shape, UPCAST) == pytest.approx(4 * routed, rel=1e-9)
    assert fp32_expert_flops(shape, bare) == pytest.approx(3 * routed, rel=1e-9)
    lora = (lora_flops_per_token(shape, UPCAST) - lora_flops_per_token(shape, bare)) * BNB.tokens
    step = (step_flops_per_token(shape, UPCAST) - step_flops_per_token(shape, bare)) * BNB.tokens
    assert step == pytest.approx(4 * shape.layers * lora + routed, rel=1e-9)  # forward, recompute, 2 in backward
    old = dataclasses.replace(UPCAST, fused_experts=False, frozen_fp32=False)
    assert expert_weight_grad_flops_per_token(shape, old) == 0.0


@pytest.mark.parametrize("model", MIXTURES)
def test_fp32_grouped_matmuls_launch_an_mm_per_expert_and_wait(model: str) -> None:
    """fp32 stacks miss torch's CUTLASS grouped matmul; its fallback reads the offsets back to the host (a wait)
    and launches one mm per expert: per mixture layer, two stacks times four passes (forward, recomputation, input
    and, LoRA folded, weight gradient)."""
    shape = resolve_shape(model)
    calls = shape.moe_layers * 2 * 4
    more = host_dispatch_s(shape, UPCAST) - host_dispatch_s(shape, BNB)
    assert more == pytest.approx(calls * shape.experts * DISPATCH_KERNEL_S, rel=1e-9)
    stall = micro_batch_work(shape, UPCAST, H200, SINGLE).stall - micro_batch_work(shape, BNB, H200, SINGLE).stall
    assert stall == pytest.approx(calls * HOST_SYNC_S, rel=1e-9)


@pytest.mark.parametrize("model", MIXTURES)
def test_offload_copies_the_upcast_weights_at_fp32(model: str) -> None:
    """Offload stores the shards as loaded: under `frozen_fp32` every weight that is not 4-bit (the expert stacks
    among them) is fp32, two bytes more each than in bf16, though FSDP still gathers them in 16 bits."""
    shape = resolve_shape(model)
    gap = param_bytes_stored(shape, UPCAST) - param_bytes_stored(shape, BNB)
    assert gap == pytest.approx((shape.params() - _linears(shape, experts=False)) * 2, rel=1e-9)
    assert gap > _linears(shape, experts=True) * 2
    assert param_bytes_16(shape, UPCAST) == param_bytes_16(shape, BNB)


@pytest.mark.parametrize(("model", "per_layer"), [
    # MLA's q_a, q_b, kv_a, kv_b, o and the shared expert's gate, up, down (the dense blocks: the same 8)
    ("deepseek-ai/DeepSeek-V3", 8.0),
    # three DeltaNet blocks (qkvz, ba, out) to one attention block (q, k, v, o), each with the shared expert's
    # gate, up, down and its gate: (3 * 7 + 8) / 4
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 7.25),
    ("Qwen/Qwen3-30B-A3B", 4.0)])
def test_shared_expert_mixture_launches_its_own_dequantizations(model: str, per_layer: float) -> None:
    """Under bitsandbytes a mixture's layer dequantizes the 4-bit linears it has, counted from its shape (not the
    measured Llama layer's 7): its attention (or DeltaNet) projections and its shared expert's."""
    shape = resolve_shape(model)
    dk, dv, _ = dequant_per_use(BNB)
    launched = host_dispatch_s(shape, BNB) - host_dispatch_s(shape, dataclasses.replace(BNB, method="lora"))
    per_use = dk * DISPATCH_KERNEL_S + dv * DISPATCH_VIEW_S
    assert launched == pytest.approx(shape.layers * per_layer * dequant_uses(BNB) * per_use, rel=1e-9)


@pytest.mark.parametrize("model", MIXTURES)
def test_reference_forward_runs_the_fp32_experts_too(model: str) -> None:
    """DPO's reference forward inside every micro-batch (adapters switched off) multiplies by the same fp32 stacks:
    one more forward of the top-k experts at the fp32 rate, and one more fallback call per stack and layer, beside
    the training pass's four."""
    shape = resolve_shape(model)
    dpo = dataclasses.replace(UPCAST, objective="dpo", precompute_reference=False)
    assert dpo.reference == "adapters_off"
    flops = _routed_flops_per_token(shape) * (4 + 1) * dpo.tokens
    eff = H200.matmul_eff
    work = micro_batch_work(shape, dpo, H200, SINGLE)
    bf16 = micro_batch_work(shape, dataclasses.replace(dpo, frozen_fp32=False), H200, SINGLE)
    assert work.compute - bf16.compute == pytest.approx(
        flops / (H200.dense_flops("fp32") * eff) - flops / (H200.dense_flops("bf16") * eff), rel=1e-9)
    assert work.stall - bf16.stall == pytest.approx(shape.moe_layers * 2 * (4 + 1) * HOST_SYNC_S, rel=1e-9)
