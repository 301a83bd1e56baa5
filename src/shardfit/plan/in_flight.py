"""What a block holds while it runs beyond what it saves for backward: the tensors its forward code keeps in
variables (the block's input, the residual after attention, the MLP's input) and its down projection's inputs and
outputs, alive until the projection returns. They count at the moment a block peaks: the last block's forward,
while the body still holds its mask, and the block checkpointing recomputes in backward.

Read from the fake-tensor step's live tensors at its peak (plan --simulate over tiny Llama and Qwen2 blocks,
tests/test_simulate.py `test_peak_inside_the_body_agrees_with_simulate`)."""

from __future__ import annotations

from shardfit.plan.adapters import adapted_shapes, adapts
from shardfit.plan.precision import casts_trainable_inputs, compute_bytes, linear_output_bytes, residual_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload


def _dense_softmax_blocks(shape: ModelShape) -> bool:
    """Whether every block is a dense softmax-attention block with a separate MLP, the only kind whose transients
    were read from the fake-tensor step (not mixtures, latent attention, Mamba, Gated DeltaNet, a single-part
    block)."""
    return not (shape.moe_layers or shape.mla is not None or shape.linear_layers or shape.mamba_mixers or
                shape.single_part)


def adapter_input_cast_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The fp32 copy of the widest adapted input (down_proj's, the MLP's width) peft makes where it casts each fp32
    adapter's input to fp32 (`adapter_input_casts` under autocast): alive until the adapter's forward returns
    (peft/tuners/lora/layer.py `Linear.forward`: `x = self._cast_input_dtype(x, lora_A.weight.dtype)`; autocast
    keeps only its 16-bit cast). Traced with MemTracker on an HF-style step (tests/test_plan_long_lora.py). 0
    otherwise."""
    if not (w.trains_adapters and casts_trainable_inputs(w, strategy)):
        return 0.0
    return 4.0 * max((i for i, _ in adapted_shapes(shape, w)), default=0)


def down_projection_bytes_per_token(shape: ModelShape, w: Workload, strategy: str, recomputed: bool) -> float:
    """What a dense softmax-attention block holds at its down projection beyond its saved tensors, per token.

    - in forward, the residual after attention, held for the block's last add, and the block's input, held by
      the decoder's loop: each a tensor of its own unless the residual stream is fp32, where the norms' upcasts
      are those very tensors and are saved anyway (a recomputed block's input is the checkpoint's kept one, and
      the fake-tensor step's recomputation peaks with no residual beside the tensors it saves);
    - the MLP's input (the second norm's output, read by gate and up, in the residual stream's dtype), unless a
      trainable matmul saves it as it is: gate's and up's where autocast makes no 16-bit copy of their input
      (`casts_trainable_inputs` off: a full fine-tune's 16-bit weights, adapters that read the base layer's input,
      counted among the block's saved tensors);
    - the product of the activation and up, down's input, where peft's cast copy is what down's adapter saves
      instead, and that fp32 copy itself (`adapter_input_cast_bytes_per_token`);
    - down's output, and for an adapted down (forward: the adapter runs to its end) the adapter's output and its
      scaled copy.
    A recomputed block (non-reentrant checkpointing stops once it has recomputed every saved tensor) peaks at
    peft's cast, before the adapter's matmuls; its input is the checkpoint's kept one. A recomputed block without
    that cast (a full fine-tune) was not seen to peak at its down projection: nothing is counted for it. Blocks of
    other kinds (mixtures, latent attention, Mamba, Gated DeltaNet, a single-part block) count peft's fp32 copy
    alone: their transients are not modelled."""
    cast = adapter_input_cast_bytes_per_token(shape, w, strategy)
    if not _dense_softmax_blocks(shape) or (recomputed and not cast):
        return cast
    a, r, h = compute_bytes(w), residual_bytes(w, strategy), shape.hidden
    held = 0 if r == 4 or recomputed else 2 * r * h
    # A recomputed block's stays in the compute dtype: in an fp32 stream its fp32 MLP input is alive too, but the
    # recomputed block's first norm then counts the checkpoint's kept input a second time (its upcast is that
    # tensor), and the fake-tensor step agrees with the two left as they are (frozen fp32, full: 0.5% over).
    mlp_input = ((a if recomputed else r) * h) if casts_trainable_inputs(w, strategy) else 0
    product = a * shape.intermediate if cast and adapts("down", w) else 0
    outputs = a * h * (3 if adapts("down", w) and w.trains_adapters and not recomputed else 1)
    return held + mlp_input + product + cast + outputs


def down_backward_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What a dense block's backward holds at its down projection beyond its saved tensors, per token (0 where
    this moment is not modelled): the block's worst backward moment, with its gate, act and up still saved.

    Three gradients as wide as the MLP at once: with an adapted down, the base layer's gradient of down's input,
    the adapter's (after peft's fp32 copy of it is cast back) and their sum (autograd's input buffer adds the two
    for the mul that made the product); otherwise (a full fine-tune, an unadapted down) the gradient of down's
    input and, from it, those of act and up, made together by the product's mul. Each in the dtype of the
    tensors they are gradients of (`linear_output_bytes`). Beside them the gradient of the residual stream
    flowing into the block, one tensor in the residual stream's dtype (the block's output gradient, which its last
    add hands to the MLP and to the residual path alike). Down's input itself is gone by then (its last reader,
    the adapter's A or the trainable weight, has made its gradients): `activation_bytes` takes it off the saved
    tensors at this moment.

    Read from the fake-tensor step's live tensors at its peak (tiny Llama/Qwen2 blocks, checkpointed or not,
    LoRA without peft's input cast and full fine-tunes: tests/test_simulate.py
    `test_down_projection_backward_agrees_with_simulate`). Blocks of other kinds (mixtures, latent attention,
    Mamba, Gated DeltaNet, a single-part block) and two-matrix MLPs: not modelled (0)."""
    if not _dense_softmax_blocks(shape) or shape.two_matrix:
        return 0.0
    return 3 * linear_output_bytes(w, strategy) * shape.intermediate + residual_bytes(w, strategy) * shape.hidden


def held_mask_bytes(w: Workload, strategy: str, in_body: bool = False) -> float:
    """The mask transformers builds once per forward ([batch, seq, seq]: bool for SDPA, additive in the residual
    dtype for eager; one row of micro_batch x seq_len under static_shape). The body holds it until it returns
    (`in_body`: a moment inside the body's forward), and checkpointed blocks keep it as an input until their
    backward; without checkpointing it is gone once the body returns (SDPA's per-block copies are counted with the
    blocks)."""
    if (w.grad_ckpt == "none" and not in_body) or w.attention == "flash" or w.sequence_parallel > 1:
        return 0.0  # Ulysses: a mask per block
    rows = 1 if w.static_shape else w.rows
    return rows * w.row_len**2 * (1 if w.attention == "sdpa" else residual_bytes(w, strategy))


def all_to_all_bytes(shape: ModelShape, w: Workload) -> float:
    """Sequence parallelism's all-to-all buffers, one block's at a time: the send and receive copies of q, k and v
    (k/v repeated to every head where the SP size does not divide them), counted at the forward's peak."""
    n = w.sequence_parallel
    if n == 1:
        return 0.0
    q = shape.heads * shape.hd
    kv = shape.kv_heads * shape.hd if shape.kv_heads % n == 0 else q
    return 2.0 * w.tokens * compute_bytes(w) * (q + 2 * kv)
