"""Memory terms of the planner that follow a source's recipe: torch.compile, pure 16-bit training, LoRA targets and
dropout, torchtune's chunked output loss, a loop that keeps its logits, FSDP1's no_sync() and litgpt's QLoRA
through Lightning's bitsandbytes plugin (plan/estimate.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardfit.plan import quant
from shardfit.plan.activations import block_activation_bytes_per_token, logits_bytes
from shardfit.plan.backward_temps import head_dequantize_bytes
from shardfit.plan.comms import param_bytes_16, param_bytes_stored
from shardfit.plan.estimate import (
    GIB,
    estimate,
    no_sync_grad_bytes,
    planned_shape,
    state_bytes,
    trainable_params,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.precision import trainable_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload, lora_targets_of

SHAPE = resolve_shape("meta-llama/Llama-3.1-8B")


def test_compile_saves_fewer_block_activations() -> None:
    """A compiled block keeps bf16 norm inputs instead of fp32 upcasts and recomputes the MLP activation:
    measured 2104 against 2576 bytes per token on a tiny Llama block (bench/compile_activations.py)."""
    w = Workload(method="full", pure_16bit=True, attention="flash")
    eager = block_activation_bytes_per_token(SHAPE, w)
    compiled = block_activation_bytes_per_token(SHAPE, replace(w, compile=True))
    h, mlp = SHAPE.hidden, SHAPE.intermediate  # Llama 3.1 8B: q is as wide as the hidden size
    # eager: fp32 norm upcasts and normalised values (12h), two bf16 norm outputs (4h), four MLP tensors;
    # compiled: bf16 norm inputs and fp32 rstd (4h + 8), norm outputs and attention output (6h), three MLP tensors
    assert eager - compiled == (12 * h + 4 * h) - (4 * h + 8 + 6 * h) + 2 * mlp


def test_pure_16bit_full_fine_tune_holds_eight_bytes_per_parameter() -> None:
    """bf16 weights, bf16 gradients and two bf16 AdamW moments; with fp32 masters 16 bytes."""
    p = SHAPE.params()
    assert sum(state_bytes(SHAPE, Workload(method="full", pure_16bit=True))) == 8 * p
    assert sum(state_bytes(SHAPE, Workload(method="full"))) == 16 * p


def test_lora_targets_and_dropout() -> None:
    """q,v adapters are a fraction of all-linear ones; with dropout each adapter keeps its dropped 16-bit input and
    bool mask instead of the 16-bit copy of its input peft's cast made (tests/test_plan_lora_targets.py)."""
    w = Workload(lora_rank=8)
    qv = replace(w, lora_targets=("q", "v"))
    q_out, kv_out = SHAPE.heads * SHAPE.hd, SHAPE.kv_heads * SHAPE.hd
    assert trainable_params(SHAPE, qv) == SHAPE.layers * 8 * (2 * SHAPE.hidden + q_out + kv_out)
    assert trainable_params(SHAPE, w) > 6 * trainable_params(SHAPE, qv)  # 20.9M against 3.4M
    dropped = block_activation_bytes_per_token(SHAPE, replace(qv, lora_dropout=0.1))
    assert dropped - block_activation_bytes_per_token(SHAPE, qv) == 2 * (2 + 1) * SHAPE.hidden - 2 * 2 * SHAPE.hidden


def test_chunked_output_loss_and_kept_logits() -> None:
    """torchtune's chunked loss: eager keeps fp32 log-softmax slices, compiled only the bf16 logits; a loop that
    keeps the model output adds its fp32 logits to every moment after the forward pass."""
    w = Workload(method="lora", pure_16bit=True, loss="chunked_output", seq_len=2048, micro_batch=2)
    elements = 2048 * 2 * SHAPE.vocab
    eager, compiled = logits_bytes(SHAPE, w), logits_bytes(SHAPE, replace(w, compile=True))
    assert eager - compiled == 4 * elements
    full = Workload(loss="full_shift", seq_len=1024)
    hw = parse_gpus("80GB")
    plain = estimate(SHAPE, full, hw, "single").per_gpu_gib
    kept = estimate(SHAPE, replace(full, keeps_logits=True), hw, "single").per_gpu_gib
    assert kept.total > plain.total


def test_config_lora_targets_map_to_planner_names() -> None:
    """A config's module names become the planner's; all-linear or unknown names count every projection."""
    assert lora_targets_of(["q_proj", "v_proj"]) == ("q", "v")
    assert lora_targets_of(["model.layers.0.self_attn.o_proj", "down_proj"]) == ("o", "down")
    assert lora_targets_of("all-linear") is None
    assert lora_targets_of(["c_attn"]) is None


def test_fsdp1_no_sync_holds_unsharded_gradients_between_steps() -> None:
    """FSDP1's no_sync() keeps every flat parameter's unsharded gradient through the accumulating micro-batches:
    a full fine-tune in bf16-true holds 2 bytes per parameter of gradients on each rank, not 2/n; the optimizer
    step sees the shards alone; without accumulation, or on one device, nothing changes."""
    hw = parse_gpus("4xA100")
    w = Workload(method="full", pure_16bit=True, grad_accum=4, seq_len=512, micro_batch=4)
    synced = estimate(SHAPE, w, hw, "zero3").per_gpu_gib
    held = estimate(SHAPE, replace(w, fsdp1_no_sync=True), hw, "zero3")
    assert held.per_gpu_gib.grads * GIB == SHAPE.params() * 2
    assert held.per_gpu_gib.total - synced.total > 0.7 * SHAPE.params() * 2 / GIB
    assert no_sync_grad_bytes(SHAPE, replace(w, fsdp1_no_sync=True, grad_accum=1), "zero3") == 0
    assert no_sync_grad_bytes(SHAPE, replace(w, fsdp1_no_sync=True), "single") == 0
    # LoRA: with use_orig_params=True a block's one flat parameter, frozen weights included, gets the gradient;
    # adapters in flat parameters of their own (use_orig_params=False) hold only theirs.
    lora = Workload(method="lora", pure_16bit=True, grad_accum=4, fsdp1_no_sync=True)
    orig = no_sync_grad_bytes(SHAPE, lora, "zero3")
    assert orig > SHAPE.layers * SHAPE.layer_params() * 2
    assert no_sync_grad_bytes(SHAPE, replace(lora, flat_params=True), "zero3") == trainable_params(SHAPE, lora) * 2


def test_litgpt_qlora_head_and_scales() -> None:
    """litgpt's QLoRA through Lightning's BitsandbytesPrecision: an untied copy of a tied head (`untied_head`), the
    head in 4-bit, whose backward dequantizes it whole to fp16 and casts it to bf16 while every activation is
    saved (`bnb_precision`), and bitsandbytes' plain nf4 with an fp32 scale per 64 weights (`double_quant`)."""
    tied = resolve_shape("meta-llama/Llama-3.2-1B")
    assert tied.tied
    hw = parse_gpus("A10G")
    w = Workload(method="qlora", pure_16bit=True, seq_len=512, micro_batch=2, grad_ckpt="none", lora_rank=32,
                 lora_targets=("q", "v"), loss="full_shift16", attention="flash")
    head = tied.vocab * tied.hidden
    base = state_bytes(tied, w)[0]
    assert state_bytes(planned_shape(tied, replace(w, untied_head=True)), w)[0] - base == head * 2
    untied = replace(w, untied_head=True, bnb_precision=True)
    assert state_bytes(planned_shape(tied, untied), untied)[0] - base == pytest.approx(head * (0.5 + 0.127 / 8),
                                                                                       rel=0.01)
    assert head_dequantize_bytes(planned_shape(tied, untied), untied) == head * 4  # fp16, then its bf16 cast
    assert head_dequantize_bytes(tied, untied) == 0  # a tied head is the embedding: never quantized
    plain, with_head = estimate(tied, w, hw, "single"), estimate(tied, untied, hw, "single")
    assert with_head.peak_phase == "backward"
    assert with_head.per_gpu_gib.temporaries * GIB >= head * 4
    assert with_head.per_gpu_gib.total > plain.per_gpu_gib.total
    # plain nf4: 4-bit codes and an fp32 absmax per 64 weights, 0.5625 byte per weight
    assert quant.weight_bytes(4096, 4096, 2, double_quant=False) == 4096 * 4096 * 9 // 16
    single = state_bytes(tied, replace(w, double_quant=False))[0]
    assert single - base == pytest.approx(tied.layers * sum(i * o for i, o in tied.linear_shapes()) * (
        1 / 16 - 0.127 / 8), rel=0.02)


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("frozen_fp32", [False, True])
def test_qlora_gathers_and_offload_copies_move_the_weights_as_stored(double_quant: bool, frozen_fp32: bool) -> None:
    """What FSDP all-gathers of a QLoRA and what offload copies are the frozen weights as the memory counts them
    stored: the NF4 weights with their block scales as laid out (bitsandbytes' plain nf4: an fp32 scale per 64
    weights), the others in the compute dtype or, after peft's upcast, fp32 (the copy; the gather casts first)."""
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    w = Workload(method="qlora", seq_len=1024, micro_batch=1, grad_ckpt="full", quant_backend="bnb",
                 double_quant=double_quant, frozen_fp32=frozen_fp32)
    stored = state_bytes(shape, w)[0] - trainable_params(shape, w) * trainable_bytes(w)
    assert param_bytes_stored(shape, w) == pytest.approx(stored, rel=1e-12)
    as_16 = replace(w, frozen_fp32=False)
    assert param_bytes_16(shape, w) == pytest.approx(state_bytes(shape, as_16)[0] - trainable_params(shape, w) * 4,
                                                     rel=1e-12)
    if not double_quant:
        assert param_bytes_16(shape, w) > param_bytes_16(shape, replace(w, double_quant=True))


@pytest.mark.parametrize("method", ["lora", "freeze", "full"])
def test_offload_copies_every_method_s_weights_as_stored(method: str) -> None:
    """Offload copies the model's weights in the dtype they are stored in, as the memory counts them: under
    `frozen_fp32` a LoRA's frozen embeddings, norms and head in fp32 (two bytes more each than in bf16, the
    decoder's linear weights unchanged), a freeze run's trained blocks as fp32 masters, a full fine-tune's masters
    in 16 bits under `pure_16bit`; the gather still moves 16 bits."""
    shape = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    w = Workload(method=method, seq_len=1024, micro_batch=1, grad_ckpt="full")
    adapters = trainable_params(shape, w) * trainable_bytes(w) if w.trains_adapters else 0
    assert param_bytes_stored(shape, w) == pytest.approx(state_bytes(shape, w)[0] - adapters, rel=1e-12)
    if method == "full":
        pure = replace(w, pure_16bit=True)
        assert param_bytes_stored(shape, pure) == pytest.approx(shape.params() * 2, rel=1e-12)
        return
    upcast = replace(w, frozen_fp32=True)
    frozen = shape.params() - shape.decoder_linear_params() - (trainable_params(shape, w) if method == "freeze"
                                                                else 0)
    gap = param_bytes_stored(shape, upcast) - param_bytes_stored(shape, w)
    assert gap == pytest.approx(frozen * 2, rel=1e-9)
    assert param_bytes_16(shape, upcast) == param_bytes_16(shape, w)
    if method == "freeze":  # the trained blocks are fp32, two bytes more than the 16-bit frozen ones
        assert param_bytes_stored(shape, w) == pytest.approx(
            shape.params() * 2 + trainable_params(shape, w) * 2, rel=1e-9)


@pytest.mark.parametrize(("dtype", "frozen_fp32", "precision", "copy_bytes"), [
    ("loaded", False, "bf16", 2),  # peft deep-copies the bf16 module (HF Trainer, TRL, axolotl)
    ("loaded", True, "bf16", 4),  # ... upcast to fp32 by prepare_model_for_kbit_training before the copy
    ("trainable", False, "bf16", 4),  # LLaMA-Factory casts every trainable weight to fp32 after wrapping
    ("fp16_upcast", False, "bf16", 2),  # ms-swift leaves a bf16 copy as it is
    ("fp16_upcast", False, "fp16", 4),  # ... and casts an fp16 one to fp32
])
def test_peft_trained_copies_count_in_the_dtype_the_tool_leaves(dtype: str, frozen_fp32: bool, precision: str,
                                                                copy_bytes: int) -> None:
    """peft's modules_to_save copy (ModulesToSaveWrapper: a deepcopy of the module) keeps the dtype the module had
    when peft wrapped it; its weight, gradient and torch AdamW's two states are in that dtype, while the adapters
    beside it are fp32 (cast_adapter_dtype upcasts only the adapters' own layers)."""
    shape = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    w = Workload(method="lora", precision=precision, seq_len=1024, frozen_fp32=frozen_fp32)
    saved = replace(w, lora_saved=("embed", "head"), lora_saved_dtype=dtype)
    copies = 2 * shape.vocab * shape.hidden
    without, with_copies = state_bytes(shape, w), state_bytes(shape, saved)
    assert with_copies[0] - without[0] == pytest.approx(copies * copy_bytes, rel=1e-12)
    assert with_copies[1] - without[1] == pytest.approx(copies * copy_bytes, rel=1e-12)
    assert with_copies[2] - without[2] == pytest.approx(copies * 2 * copy_bytes, rel=1e-12)
    # offload and DeepSpeed count the model's own weights without the copies, whatever their dtype
    assert param_bytes_stored(shape, saved) == pytest.approx(param_bytes_stored(shape, w), rel=1e-12)
