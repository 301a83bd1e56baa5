"""QLoRA's dequantization: every 4-bit linear weight is dequantized in every use (forward, backward, and again
where checkpointing recomputes the block), memory-bound traffic that the runs behind the training utilization did
not do, and kernels the host launches (`DEQUANT`, per backend: torchao's eager ops or bitsandbytes' fused kernel).
Only what is stored in 4 bits is dequantized: the routed expert stacks bitsandbytes leaves in 16 bits
(plan/precision.py `experts_stay_16bit`, the rule the memory side reads) are multiplied as they are."""

from __future__ import annotations

from shardfit.plan.model_shape import Block
from shardfit.plan.precision import experts_stay_16bit, stored_nf4
from shardfit.plan.quant import experts_per_slice, scaler_block_size
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

# QLoRA: one dequantization of a 4-bit weight for one matmul, per backend: (kernels, views, bytes read + written per
# weight). torchao's NF4Tensor (shardfit's QLoRA) dequantizes in eager PyTorch ops, the nibbles as int64 indices into
# the code book: counted by bench/dequant_traffic.py (a TorchDispatchMode over F.linear on a 4096 x 4096 NF4 weight,
# torch 2.13, torchao 0.18; bench/results/dequant_traffic.json). bitsandbytes' dequantize_4bit (kDequantizeBlockwise,
# csrc/kernels.cu) reads the packed codes (0.5 byte) and writes the weight in its 16-bit dtype (2 bytes) in one
# kernel, after two small ones that dequantize the double-quantized block scales (8-bit absmax and its offset add:
# 5 bytes per block of 64 weights); Lightning's BitsandbytesPrecision (`bnb_precision`) writes fp16 and casts it to
# bf16, one more kernel reading 2 bytes and writing 2 (plan/estimate.py `bnb_dequantize_bytes`).
DEQUANT: dict[str, tuple[int, int, float]] = {"torchao": (15, 11, 39.11), "bnb": (3, 1, 2.5 + 5 / 64)}
BNB_CAST = (1, 0, 4.0)
# The 4-bit weights of the decoder layer the host's counts were taken on (plan/dispatch.py LAYER_OPS, Llama's): q, k,
# v, o, gate, up, down, each dequantized by its own kernels.
LAYER_WEIGHTS = 7


def quantized_linear_params(shape: ModelShape, w: Workload) -> int:
    """The decoder's linear weights a QLoRA stores in 4 bits (plan/precision.py `stored_nf4`, the rule the memory
    side reads): every one but the router and the routed expert stacks bitsandbytes leaves in 16 bits."""
    return int(shape.over_blocks(lambda moe: sum(i * o for n, i, o in shape.named_linears(moe)
                                                 if stored_nf4(n, shape, w))))


# The nn.Linear layers of one routed expert where each expert is its own MLP (transformers 4's Qwen3MoeMLP,
# Llama 4's Llama4TextMLP, litgpt's LLaMAMLP): gate, up and down.
EXPERT_LINEARS = 3


def experts_are_linears(shape: ModelShape, w: Workload) -> bool:
    """Whether a QLoRA's routed experts are each their own linear layers, quantized and dequantized one by one:
    transformers 4's mixtures (an MLP module per expert, `fused_experts` False), whatever the backend; under
    bitsandbytes also Llama 4's experts, which transformers unfuses into an MLP per expert for it
    (quantizers/base.py MODULES_TO_PATCH_FOR_QUANTIZATION, SequentialLlama4TextExperts), and Lightning's plugin
    over litgpt's mixtures (`bnb_precision`: an nn.Linear per expert). Fused stacks, 16-bit (`experts_stay_16bit`)
    or quantized whole (shardfit's torchao path, axolotl's `quantize_fused_experts`), are one weight each."""
    if not shape.moe:
        return False
    if w.bnb and (w.bnb_precision or shape.every_expert):
        return True
    return not (w.fused_experts or shape.experts_always_fused)


def experts_each_linear(shape: ModelShape, w: Workload) -> bool:
    """Whether bitsandbytes QLoRA quantizes every routed expert as its own Linear4bit layers, each dequantized by
    its own kernels in every use (`experts_are_linears` under bitsandbytes)."""
    return w.bnb and experts_are_linears(shape, w)


def torchao_expert_stacks(shape: ModelShape, w: Workload) -> bool:
    """Whether a QLoRA stores the routed experts as fused NF4 stacks that models/quantize_experts.py dequantizes a
    slice of experts at a time (shardfit's torchao path over transformers 5's fused experts)."""
    return w.method == "qlora" and shape.moe and not w.bnb and not experts_are_linears(shape, w) \
        and not experts_stay_16bit(shape, w)


def stack_slices(shape: ModelShape, rows: int, cols: int) -> int:
    """Dequantizations of one NF4 expert stack stored as [rows, cols] (all experts' rows): one per slice
    (plan/quant.py `experts_per_slice`). Each slice's copy into the stack's value is one kernel more, 1 in 16 of
    the slice's own, left out."""
    per = experts_per_slice((shape.experts, rows // shape.experts, cols), scaler_block_size(rows * cols))
    return shape.experts // per


def experts_hit(shape: ModelShape, w: Workload) -> int:
    """Routed experts of one block that get tokens in a micro-batch, at most: every (token, expert) pair a
    different expert, up to all of them (a few thousand tokens at top-8 reach every one of 128)."""
    return min(shape.experts, w.tokens * shape.routed_per_token)


def dequantized_weights_per_layer(shape: ModelShape, w: Workload) -> float:
    """4-bit weights the host dispatches a dequantization for in the mean decoder layer: LAYER_WEIGHTS, except in
    two cases counted from the shape's blocks. Where the routed experts stay 16-bit (`experts_stay_16bit`): each
    block's own 4-bit linears (`stored_nf4`: attention's or DeltaNet's projections, a shared expert's MLP and gate,
    a dense block's MLP), each one weight (the routed experts and the router none). Where every expert is its own
    Linear4bit layers (`experts_each_linear`): those linears and EXPERT_LINEARS per expert that gets tokens
    (`experts_hit`), each dequantized on its own. Where the experts are torchao NF4 stacks
    (`torchao_expert_stacks`): those linears and each stack's slices (`stack_slices`)."""
    each = experts_each_linear(shape, w)
    sliced = torchao_expert_stacks(shape, w)
    if not (each or sliced or experts_stay_16bit(shape, w)):
        return float(LAYER_WEIGHTS)
    hit = experts_hit(shape, w) if each else 0

    def per_block(moe: Block) -> float:
        own = sum(stored_nf4(n, shape, w) for n, _, _ in shape.named_linears(moe) if not n.startswith("expert_"))
        routed = any(n.startswith("expert_") for n, _, _ in shape.named_linears(moe))
        if routed and sliced:
            return float(own + sum(stack_slices(shape, r, c) for n, r, c in shape.stored_weights(moe)
                                   if n.startswith("expert_")))
        return float(own + (EXPERT_LINEARS * hit if routed else 0))

    return shape.over_blocks(per_block) / shape.layers


def dequant_per_use(w: Workload) -> tuple[float, float, float]:
    """(kernels, views, bytes per weight) of one dequantization of a 4-bit weight for one matmul under `w`'s
    backend (`DEQUANT`); zeros when nothing is 4-bit."""
    if w.method != "qlora":
        return 0.0, 0.0, 0.0
    if not w.bnb:
        return tuple(float(x) for x in DEQUANT["torchao"])
    k, v, b = DEQUANT["bnb"]
    if w.bnb_precision and w.precision != "fp16":
        k, v, b = k + BNB_CAST[0], v + BNB_CAST[1], b + BNB_CAST[2]
    return float(k), float(v), float(b)


def dequant_uses(w: Workload) -> float:
    """Dequantizations of each 4-bit weight per micro-batch: forward and backward (the gradient of the input needs
    the weight), and the recomputed forward under full checkpointing (selective: half its matmuls)."""
    return 2.0 + {"full": 1.0, "selective": 0.5}.get(w.grad_ckpt, 0.0)


def dequant_bytes(shape: ModelShape, w: Workload) -> float:
    """Per micro-batch: the bytes every 4-bit linear weight's dequantizations move (`dequant_per_use`,
    `quantized_linear_params`), as memory-bound traffic; the same per weight whatever the tokens, so it weighs most
    on short micro-batches."""
    return dequant_uses(w) * quantized_linear_params(shape, w) * dequant_per_use(w)[2]
