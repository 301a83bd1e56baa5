"""What a block's backward allocates besides the activations it saved, where the method or the model makes it:
QLoRA's dequantization of a 4-bit weight (torchao's, bitsandbytes', a 4-bit LM head's) with the input gradient made
beside it, and a routed expert stack's whole weight gradient. `estimate.step_candidates` adds them to the engine's
own temporaries at the moments they happen."""

from __future__ import annotations

from shardfit import strategy as strategies
from shardfit.plan import experts, quant
from shardfit.plan.dequant import experts_are_linears
from shardfit.plan.flops import expert_weight_grad_stacks
from shardfit.plan.precision import compute_bytes, expert_matmul_bytes, experts_stay_16bit, runs_autocast
from shardfit.plan.shapes import ModelShape
from shardfit.plan.weight_bytes import bnb_dequantize_bytes, nf4_weights, quantized_head
from shardfit.plan.workload import Workload


def dequantize_bytes(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """QLoRA in backward: the most one layer's dequantization holds (plan/quant.py), over the NF4 weights of a
    block, with the gradient of that layer's input its LoRA branch has already made (autograd runs the adapter's
    backward first: it was recorded after the base matmul). Each linear layer dequantizes its weight for its matmul
    in forward and again in backward, one at a time."""
    if w.method != "qlora":
        return 0.0
    each = experts_are_linears(shape, w)
    # (in, out, the expert stack's [experts, rows, cols] where the weight is one)
    weights: list[tuple[int, int, tuple[int, int, int] | None]] = []
    for name, r, c in nf4_weights(shape, w):
        if not name.startswith("expert_"):
            weights.append((c, r, None))
        elif each:  # experts that are linear layers of their own: one expert's weight, gate and up apart (litgpt's
            # LLaMAMLP under Lightning's plugin, whose every linear is NF4, has fc_1 and fc_2 as transformers 4 has
            # gate and up)
            weights.append((c, r // (shape.experts * (2 if name == "expert_gate_up" else 1)), None))
        else:  # a fused stack, dequantized a slice at a time into its whole value (models/quantize_experts.py)
            weights.append((c, r, (shape.experts, r // shape.experts, c)))
    weights = [(i, o, stack) for i, o, stack in weights if quant.quantizable(o, i)]
    if not weights:
        return 0.0
    tokens = w.tokens
    grad_input = compute_bytes(w)
    if w.bnb and not w.bnb_precision and (w.bnb_compute_fp32 or (w.frozen_fp32 and runs_autocast(w, strategy))):
        # The fp32 stream's input gradient; or an fp32 compute dtype's: Linear4bit casts its input to the compute
        # dtype, so the input's gradient is made in fp32 (autograd casts it to the input's dtype, under autocast
        # too) before `.to()`'s backward casts it back: an fp32 copy beside the 16-bit one (measured with
        # MemTracker on bitsandbytes 0.50.2's CPU backend: +2 bytes per token x input feature).
        grad_input = 4

    def held(i: int, o: int, stack: tuple[int, int, int] | None) -> float:
        if w.bnb_precision:
            return bnb_dequantize_bytes(i * o, w)
        if w.bnb:  # bitsandbytes' one kernel writes the weight, no index tensors
            return float(i * o * bnb_dequantized_bytes(w, strategy))
        if stack is not None:
            return float(quant.stack_dequantize_peak_bytes(stack, compute_bytes(w)))
        return float(quant.dequantize_peak_bytes(i * o, compute_bytes(w)))

    return max(held(i, o, stack) + tokens * i * grad_input for i, o, stack in weights)


def expert_weight_grad_bytes(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """The largest routed expert stack's weight gradient, made whole in the block's backward while its saved
    tensors are still alive, for the stacks that compute one (`expert_weight_grad_stacks`), in the dtype their
    matmul runs in: LoRA folded into a stack (peft's `_LoraFactorsProxy`: `baddbmm(W, lhs, rhs)` requires grad, so
    the grouped matmul's backward returns the merged stack's full gradient before the baddbmm's backward turns it
    into A's and B's; a hook on a CPU grouped_mm over a merged stack sees the stack's shape and dtype), and the
    compiled fallback's `zeros_like(weight)` (transformers 5.23 integrations/moe.py l.247), dropped for a frozen
    stack once the op returns. Under expert parallelism a rank's stacks hold its 1/N of the experts. 0 where no
    stack computes one."""
    names = expert_weight_grad_stacks(shape, w, strategy)
    if not names:
        return 0.0
    largest = max(i * o for n, i, o in shape.named_linears(True) if n in names)
    stored = expert_matmul_bytes(w, strategy) if experts_stay_16bit(shape, w) else compute_bytes(w)
    s = strategies.get(strategy)
    local = shape.experts // (w.expert_parallel if experts.applies(w, shape, s.engine, s.offload) else 1)
    return float(local * largest * stored)


def bnb_dequantized_bytes(w: Workload, strategy: str = "single") -> int:
    """Bytes per element one bitsandbytes Linear4bit holds in backward while it multiplies the incoming gradient by
    its dequantized weight: MatMul4Bit.backward (bitsandbytes/autograd/_functions.py, 0.42 to 0.50) computes
    `F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)`, and dequantize_4bit writes quant_state.dtype, the dtype
    the model was loaded in (16-bit, or fp32 for an fp32 run without prepare_model_for_kbit_training). The
    gradient has the dtype of the forward's output: under autocast the 16-bit one; without autocast the layer's
    compute dtype, which transformers always passes (BitsAndBytesConfig's bnb_4bit_compute_dtype, fp32 by default,
    `bnb_compute_fp32`, else the run's precision; Linear4bit's `compute_type_is_set` then keeps it whatever the
    input's dtype). A cast to
    another dtype exists beside the weight it is made from: 2 + 4 bytes when an fp32 gradient meets a 16-bit
    weight. Measured with MemTracker on bitsandbytes 0.50.2's CPU backend (fp32 compute dtype: 6.0 bytes without
    autocast, 2.1 under fp16 autocast). Before 0.50 the forward dequantized the same way (to the compute dtype)
    instead of running a fused kernel."""
    loaded = 4 if w.precision == "fp32" and not w.frozen_fp32 else 2
    grad = 4 if w.bnb_compute_fp32 and not runs_autocast(w, strategy) else compute_bytes(w)
    return loaded + (grad if grad != loaded else 0)


def head_dequantize_bytes(shape: ModelShape, w: Workload) -> float:
    """A 4-bit LM head (`quantized_head`) in backward: the gradient of the head's input needs the whole head
    dequantized (MatMul4Bit.backward), while every block's activations are still saved; 0 otherwise."""
    return bnb_dequantize_bytes(shape.vocab * shape.hidden, w) if quantized_head(shape, w) else 0.0
