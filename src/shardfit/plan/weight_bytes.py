"""The bytes a model's weights take as stored: its linear layers (16-bit, 8-bit or NF4 with their quant states),
its head, one block's, and what bitsandbytes dequantizes or keeps outside the parameters. The memory model
(plan/estimate.py), communication (plan/comms.py) and DeepSpeed's path read them."""

from __future__ import annotations

from shardfit.plan import quant
from shardfit.plan.precision import (
    compute_bytes,
    experts_stay_16bit,
    frozen_weight_bytes,
    stored_nf4,
)
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload


def stored_linear_bytes(shape: ModelShape, w: Workload, moe: bool | None = None, experts_only: bool = False) -> float:
    """What one decoder block's linear weights (with `experts_only`, its routed experts alone) take as stored:
    QLoRA's NF4 (4-bit codes, 8-bit block scales, factors per group of scales: 0.5 byte + ~0.127 bit per weight,
    the QLoRA paper's double quantization, exactly as plan/quant.py lays it out; without `double_quant` an fp32
    scale per 64 weights) for each linear weight and each fused expert stack, except the router (never quantized)
    and expert stacks bitsandbytes leaves alone (`experts_stay_16bit`), which stay in the compute precision, fp32
    after peft's prepare_model_for_kbit_training (`frozen_fp32`, `frozen_weight_bytes`); else the compute
    precision. Under Lightning's BitsandbytesPrecision (`bnb_precision`) every linear layer, one per expert as it
    counts them. A model loaded in fp32 (`loaded_fp32`) stores its dense linears in fp32."""
    low = 4 if w.loaded_fp32 else compute_bytes(w)
    keep16 = experts_stay_16bit(shape, w)
    total = 0.0
    for name, r, c in _stored_rows(shape, w, moe):
        expert = name.startswith("expert_")
        if experts_only and not expert:
            continue
        # peft's prepare_model_for_kbit_training (`frozen_fp32`) casts every 16-bit parameter that is not a
        # Params4bit to fp32 (peft/utils/other.py): the router, and the experts bitsandbytes left alone
        qlora = w.method == "qlora" and not w.bnb_precision
        dense = frozen_weight_bytes(w) if qlora and (expert and keep16 or name == "router") else low
        total += _nf4_bytes(r, c, w) if stored_nf4(name, shape, w) else r * c * dense
    return total


def _stored_rows(shape: ModelShape, w: Workload, moe: bool | None) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of one block's linear weights as they are stored: one per linear layer (every expert's
    own under Lightning's BitsandbytesPrecision, `bnb_precision`, and without QLoRA), else QLoRA's stored weights
    (ModelShape.stored_weights: a fused expert stack as one)."""
    if w.bnb_precision or w.method != "qlora":
        return [(n, o, i) for n, i, o in shape.named_linears(moe)]
    return shape.stored_weights(moe)


def _nf4_bytes(rows: int, cols: int, w: Workload) -> int:
    """One weight QLoRA stores in NF4, as stored (plan/quant.py `weight_bytes`, with or without `double_quant`)."""
    return quant.weight_bytes(rows, cols, compute_bytes(w), w.double_quant)


def nf4_linear_bytes(shape: ModelShape, w: Workload) -> float:
    """The decoder's linear weights QLoRA stores in NF4 (plan/precision.py `stored_nf4`), as stored: the 4-bit
    part of `stored_linear_bytes` over every block, what FSDP all-gathers and offload copies of them
    (plan/comms.py); 0 without QLoRA."""
    return shape.over_blocks(lambda moe: float(sum(_nf4_bytes(r, c, w) for n, r, c in _stored_rows(shape, w, moe)
                                                   if stored_nf4(n, shape, w))))


def nf4_weights(shape: ModelShape, w: Workload) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of the largest block's weights QLoRA stores in NF4 (plan/precision.py `stored_nf4`, the
    rule `stored_linear_bytes` reads): every stored weight but the router and the expert stacks bitsandbytes leaves
    alone."""
    return [(n, r, c) for n, r, c in shape.stored_weights() if stored_nf4(n, shape, w)]


def linear_weight_bytes(shape: ModelShape, w: Workload, moe: bool | None = None) -> float:
    """One decoder block's linear weights as stored (`stored_linear_bytes`)."""
    return stored_linear_bytes(shape, w, moe)


def quantized_head(shape: ModelShape, w: Workload) -> bool:
    """Whether QLoRA stores the LM head in 4-bit: under Lightning's BitsandbytesPrecision every nn.Linear is
    replaced by a bitsandbytes Linear4bit, the head included (lightning/fabric/plugins/precision/bitsandbytes.py
    `module_init_context`, 2.3.0), when the head is a layer of its own (untied)."""
    return w.method == "qlora" and w.bnb_precision and not shape.tied


def head_weight_bytes(shape: ModelShape, w: Workload) -> float:
    """The 4-bit LM head as stored (`quantized_head`)."""
    return float(_nf4_bytes(shape.vocab, shape.hidden, w))


def bnb_dequantize_bytes(numel: int, w: Workload) -> float:
    """What bitsandbytes holds while one Linear4bit weight is dequantized for a matmul under Lightning's
    BitsandbytesPrecision: the plugin quantizes from an fp16 copy (`_Linear4bit.quantize`: weight.to(torch.half)),
    so dequantize_4bit writes the whole weight in fp16 (its quant_state's dtype), and MatMul4Bit casts it to the
    input's dtype before the matmul, forward and backward (bitsandbytes/autograd/_functions.py `MatMul4Bit`,
    0.42.0: F.dequantize_4bit(B, quant_state).to(A.dtype)); the fp16 copy is freed once the cast exists. No index
    tensors: bitsandbytes dequantizes in one CUDA kernel."""
    low = compute_bytes(w)
    return float(numel * (2 + (low if w.precision != "fp16" else 0)))


def fsdp1_bnb_quant_state_bytes(shape: ModelShape, w: Workload, moe: bool | None = None,
                                whole_model: bool = False) -> float:
    """What bitsandbytes' QLoRA keeps outside its parameters under FSDP1 (`runs_fsdp1`, `bnb`): the quant state of
    every 4-bit weight (its block scales and their factors: all of `_nf4_bytes` but the codes, n/2 bytes), of one
    decoder block of kind `moe`, or with `whole_model` of every block and a 4-bit head (`quantized_head`); 0
    otherwise.

    A Linear4bit keeps its weight's quant state on the module as well (bitsandbytes/nn/modules.py, 0.43 on:
    `fix_4bit_weight_quant_state_from_module`, "the quant state got lost when the parameter got converted. This
    happens for example for fsdp ... we can recover the state here"): a QuantState of tensors, no nn.Parameter.
    FSDP1 flattens, shards, all-gathers and offloads a unit's parameters alone (torch/distributed/fsdp/
    _init_utils.py `_get_orig_params`; _flat_param.py `flat_param_to`, `_local_shard`), so every rank keeps every
    layer's quant state whole on its GPU, CPU offload or not, and a unit's all-gather carries the codes alone."""
    if not (w.runs_fsdp1 and w.bnb):
        return 0.0

    def block(kind: bool | None) -> float:
        return float(sum(_nf4_bytes(r, c, w) - (r * c + 1) // 2 for n, r, c in _stored_rows(shape, w, kind)
                         if stored_nf4(n, shape, w) and quant.quantizable(r, c)))
    if not whole_model:
        return block(moe)
    head = head_weight_bytes(shape, w) - (shape.vocab * shape.hidden + 1) // 2 if quantized_head(shape, w) else 0
    return shape.over_blocks(block) + head


def block_weight_bytes(shape: ModelShape, w: Workload) -> float:
    """One decoder block's frozen weights as stored (its linear layers and its two norms): what FSDP all-gathers
    for it."""
    return linear_weight_bytes(shape, w) + 2 * shape.hidden * compute_bytes(w)
