"""FLOPs per token of one micro-batch, and what float8 changes of them (plan/timing.py runs them at the card's
rate).

Compute, per token, from the layer widths (the matmuls' 2 FLOPs per multiply-add):
- forward: every linear layer of a block (a mixture of experts: its top-k experts), attention's two matmuls over
  the attended positions (half the sequence on average for a causal kernel that skips masked blocks, the whole
  sequence where a dense mask is applied), LoRA's A and B, and the head;
- backward: the input gradient of every layer that backward passes through (as much as the forward), the weight
  gradient only of trainable weights (LoRA skips it for the frozen base); flash attention's backward recomputes
  the scores, 2.5 times its forward (Dao, FlashAttention-2, sec. 3.1.2); backward stops below the first trainable
  layer (a `freeze` run of the last blocks does not reach the first ones);
- recomputation: full checkpointing runs each block's forward again; selective checkpointing only the matmuls whose
  outputs it does not keep (every other one, models/checkpointing.py), and eager attention's two (bmm, not kept).

Under `float8: true` the converted linear layers run at the card's FP8 rate, plus torchao's casts to FP8
(`float8_s`). The routed experts bitsandbytes leaves unquantized and peft upcasts to fp32 run at the card's fp32
rate (`fp32_experts_s`).
"""

from __future__ import annotations

from shardfit import method as methods
from shardfit.plan.adapters import adapts
from shardfit.plan.attention_layout import CHUNK, WINDOW
from shardfit.plan.cards import Card
from shardfit.plan.model_shape import DELTA_CHUNK, BlockGroup
from shardfit.plan.precision import experts_run_fp32
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

FLASH_BWD = 2.5  # FlashAttention-2's backward: 5 matmuls against the forward's 2


def linear_flops_per_token(shape: ModelShape) -> tuple[float, float]:
    """(forward FLOPs of one block's linear layers, their parameter count) per token, active experts only."""
    # the mean block: mixtures and dense blocks in their shares, and the shared blocks Zamba's hybrid blocks run
    params = (shape.over_blocks(shape.active_linear_params) + shape.shared_active) / shape.layers
    return 2.0 * params, float(params)


def attended_positions(w: Workload, shape: ModelShape | None = None) -> float:
    """Masked attention: the key positions one query's QK^T and PV run over in the kernel `w` runs, at the most,
    averaged over the blocks of `shape` (None: every block attends to the whole causal prefix).

    A kernel that takes the examples' boundaries (flash-attention 2's variable lengths from the position restarts,
    flex attention's block mask built on the host from them, models/masks.py; SDPA's causal kernel over a row without
    a mask) skips the blocks above the diagonal and across examples: half of seq_len on average for rows of one
    full-length example, whether the row is one example or, under `static_shape`, micro_batch of them side by side.
    The same kernels skip what lies outside a sliding window or an attention chunk (flash-attention's window_size,
    the window's or chunk's block mask under flex), so a windowed block's query runs over at most its window
    (`_within`). A dense mask (SDPA over packed or padded rows: its memory-efficient kernel, the one that takes an
    arbitrary mask on a GPU; eager attention) is applied to scores computed over the whole square of the row: every
    query runs over the row's `row_len`, seq_len, or micro_batch x seq_len under `static_shape`, micro_batch times
    the attention of separate rows (why resolve/defaults.py turns static_shape on only with a boundary kernel)."""
    whole = float(w.row_len) if w.attention != "flash" else w.seq_len / 2
    groups = softmax_groups(shape, w) if shape is not None else []
    blocks = sum(n for n, _ in groups)
    return sum(n * p for n, p in groups) / blocks if blocks else whole


def softmax_groups(shape: ModelShape, w: Workload) -> list[tuple[int, float]]:
    """(blocks, `attended_positions` of each) for every group of `shape`'s blocks that runs softmax attention (not
    its Gated DeltaNet and other recurrent blocks), each kind within its own span under flash: a window's or a
    chunk's (`_within`; the whole prefix for a flash class that passes no window, `flash_unwindowed`), the rest the
    whole causal prefix. A sparse block's keys are the whole prefix under every kernel: transformers' DSA classes
    support neither flash nor flex attention and apply the indexer's top-k as a dense mask over the whole row (only
    a kernel that takes the picks, FlashMLA's, which shardfit never loads, would run over the top-k alone); its
    indexer is `indexer_flops_per_token`'s. A group's span under 2 is unknown: the whole prefix. Without
    `attention_groups` (a catalog entry) `sliding_layers` blocks of the model's softmax blocks attend within
    `sliding_window`, a window or (`attention_chunked`) a chunk."""
    groups = shape.attention_groups
    if not groups and shape.sliding_layers > 0 and shape.sliding_window >= 2:
        groups = (BlockGroup(min(shape.sliding_layers, shape.layers - shape.linear_layers),
                             CHUNK if shape.attention_chunked else WINDOW, shape.sliding_window),)
    whole = float(w.row_len) if w.attention != "flash" else w.seq_len / 2
    full = shape.layers - shape.linear_layers - sum(g.blocks for g in groups)
    out = [(full, whole)] if full > 0 else []
    for g in groups:
        if g.attention == "none":
            continue
        inside = w.attention == "flash" and g.span >= 2 and \
            (g.attention == CHUNK or g.attention == WINDOW and not shape.flash_unwindowed)
        out.append((g.blocks, _within(g.span, w.seq_len, chunked=g.attention == CHUNK) if inside else whole))
    return out


def _within(size: int, seq: int, *, chunked: bool) -> float:
    """The mean number of earlier positions (itself included, to the causal kernel's seq/2 at the limit) a query of
    a `seq`-token example attends to inside a sliding window of `size` tokens, or inside its own `size`-token chunk
    (Llama 4's chunked attention: the chunks tile the sequence and never look back past their start)."""
    if seq <= size:
        return seq / 2
    if chunked:
        full, rest = divmod(seq, size)
        return (full * size * size / 2 + rest * rest / 2) / seq
    return size - size * size / (2 * seq)  # the first `size` positions fill the window, the rest see all of it


def attention_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs per token of the mean block's token mixing outside its projections, the part backward passes
    through: a softmax-attention block's QK^T and PV over its own `attended_positions` (`softmax_groups`), a Gated
    DeltaNet block's chunked delta rule (`delta_rule_flops_per_token`), another recurrent block's state update
    (plan/token_mixers.py), neither with a term that grows with the sequence."""
    softmax = sum(n * p for n, p in softmax_groups(shape, w)) * 4.0 * shape.heads * shape.hd
    linear = shape.linear_layers * delta_rule_flops_per_token(shape) if shape.linear_layers else 0.0
    recurrent = sum(g.blocks * g.recurrence for g in shape.attention_groups)
    return (softmax + linear + recurrent) / shape.layers


def indexer_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs per token of the mean block's sparse-attention indexer (DeepSeek-V3.2, GLM-DSA, dots3_note):
    its heads' scores against every key of the row (transformers' torch indexer scores the whole row, then masks
    it; the sum over its heads, 1/width of that, is left out), under torch.no_grad: no backward pass, only full
    checkpointing's recomputation."""
    return sum(g.blocks * 2.0 * g.index * float(w.row_len) for g in shape.attention_groups) / shape.layers


def delta_rule_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token of one Gated DeltaNet block's token mixing (fla's chunk_gated_delta_rule where it is
    installed, or transformers' torch fallback, which does the same products as a loop over the chunks: its
    host cost, chunk by chunk, is `delta_rule_chunk_ops`'s). Per value head
    (the key heads are repeated to the value heads), 2 FLOPs per multiply-add: inside a `DELTA_CHUNK`-token chunk
    three products of C x dk (K K^T, the WY transform's decayed keys, the queries' scores against the chunk's keys)
    and two of C x dv (the transform's values, the scores times the corrected values); across chunks three of
    dk x dv against the running state (the keys' and the queries' products with it, its update). The chunk's
    triangular solve (C^2 / 3 per token, under 2 % of the rest at C = 64, dk = dv = 128) is left out; the
    depthwise convolution over q, k and v adds its kernel's width per channel. The backward is counted at the
    forward's FLASH_BWD like softmax attention's (fla's backward recomputes the chunk's products, then takes the
    gradients of each)."""
    c, dk, dv = DELTA_CHUNK, shape.linear_k_dim, shape.linear_v_dim
    per_head = 2 * c * (3 * dk + 2 * dv) + 6 * dk * dv
    conv = 2 * shape.linear_conv * (2 * shape.linear_k_heads * dk + shape.linear_v_heads * dv)
    return float(shape.linear_v_heads * per_head + conv)


def lora_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs of one block's LoRA A and B (active experts only)."""
    if not w.trains_adapters:
        return 0.0

    def per_block(moe: bool) -> float:
        flops = 0.0
        for name, i, o in shape.named_linears(moe):
            if adapts(name, w):  # a token runs its top-k experts' adapters only
                flops += 2 * w.lora_rank * (i + o) / (shape.experts / shape.top_k if name.startswith("expert_") else 1)
        return flops

    return shape.over_blocks(per_block) / shape.layers


def compiled_expert_fallback(shape: ModelShape, w: Workload, strategy: str = "single") -> bool:
    """Whether the fp32 expert stacks (`experts_run_fp32`) run transformers' own fallback op: under torch.compile
    `_can_use_grouped_mm` refuses every stack that is not bf16 (transformers 5.23 integrations/moe.py l.323,
    `is_torchdynamo_compiling() and weight.dtype != torch.bfloat16`), so `_grouped_mm` calls the custom op
    `transformers::grouped_mm_fallback` (l.383): a loop of torch.mm per expert after one `offs.tolist()`."""
    return w.compile and experts_run_fp32(shape, w, strategy)


def expert_weight_grad_stacks(shape: ModelShape, w: Workload, strategy: str = "single") -> tuple[str, ...]:
    """The routed expert stacks whose backward computes their full weight gradient, the one rule the FLOPs, the
    host's launches and the backward's temporary read: those LoRA folds into (peft's ParamWrapper,
    `target_parameters`: the grouped matmul multiplies by W + B A, which requires grad), and every stack of the
    compiled fallback (`compiled_expert_fallback`), whose registered backward `_grouped_mm_fallback_bwd`
    (integrations/moe.py l.236-256) makes `zeros_like(weight)` and an mm into it per expert beside the input
    gradient's, with no `needs_input_grad` check: a frozen stack's gradient is computed, then dropped. None where no
    adapter sits on a fused stack (transformers 4's nn.Linear per expert takes LoRA as a dense layer does)."""
    if not shape.moe:  # a dense MLP is named as one expert's stacks here, but it is plain nn.Linear layers
        return ()
    stacks = tuple(dict.fromkeys(n for n, _, _ in shape.named_linears(True) if n.startswith("expert_")))
    if compiled_expert_fallback(shape, w, strategy):
        return stacks
    if not w.trains_adapters or not (w.fused_experts or shape.experts_always_fused):
        return ()
    return tuple(n for n in stacks if adapts(n, w))


def expert_weight_grad_flops_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """Forward FLOPs per token (of the mean block) of the routed expert stacks whose backward computes their
    weight gradient (`expert_weight_grad_stacks`): one more matmul as large as the forward in each backward (a
    tiny Qwen3-MoE with LoRA folded into its stacks, under autocast: backward's grouped_mm FLOPs twice the
    forward's)."""
    names = expert_weight_grad_stacks(shape, w, strategy)
    if not names:
        return 0.0

    def per_block(moe: bool) -> float:
        share = shape.routed_per_token / shape.experts
        return sum(2.0 * i * o * share for n, i, o in shape.named_linears(moe) if n in names) if moe else 0.0

    return shape.over_blocks(per_block) / shape.layers


def backward_layers(shape: ModelShape, w: Workload) -> int:
    """The decoder blocks backward passes through: every one, or under `freeze` those from the top down to the
    lowest that trains (backward stops below it)."""
    return shape.layers - min(w.trained_blocks(shape.layers)) if w.method == "freeze" else shape.layers


def step_flops_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """Forward + backward + recomputation FLOPs per token of one micro-batch under `strategy`."""
    lin, _ = linear_flops_per_token(shape)
    attn = attention_flops_per_token(shape, w)
    lora = lora_flops_per_token(shape, w)
    head = 2.0 * shape.hidden * shape.vocab
    index = indexer_flops_per_token(shape, w)
    block_fwd = lin + attn + lora + index
    weights_train = w.method == "full"
    lin_bwd = lin * (2 if weights_train else 1)
    attn_bwd = attn * (FLASH_BWD if w.attention != "eager" else 2)
    block_bwd = lin_bwd + attn_bwd + 2 * lora + expert_weight_grad_flops_per_token(shape, w, strategy)
    if w.grad_ckpt == "full":
        recompute = block_fwd
    elif w.grad_ckpt == "selective":
        # every other mm/addmm; eager attention's QK^T and PV are bmm, which the policy does not keep (it keeps the
        # SDPA and flash kernels' outputs), so eager recomputes both
        recompute = (lin + lora) / 2 + (attn if w.attention == "eager" else 0.0)
    else:
        recompute = 0.0
    layers_bwd = backward_layers(shape, w)
    head_bwd = head * (2 if weights_train else 1)
    return shape.layers * block_fwd + head + layers_bwd * (block_bwd + recompute) + head_bwd


def reference_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs per token of the reference model: every block's linear layers and attention (no adapters: they
    are switched off) and the head. No backward and no recomputation: it runs without gradients."""
    lin, _ = linear_flops_per_token(shape)
    return shape.layers * (lin + attention_flops_per_token(shape, w) + indexer_flops_per_token(shape, w)) + \
        2.0 * shape.hidden * shape.vocab
# What torchao's dynamic scaling moves per element of each tensor it casts to FP8 (float8_utils.py tensor_to_amax,
# float8_training_tensor.py _ToFloat8ConstrFunc). Compiled, inductor fuses the cast: the bf16 tensor read once for
# its absolute maximum and once more to cast it, the FP8 copy written (2 + 2 + 1 bytes). Eager, each step is its own
# kernel: abs (2 read, 2 written), max (2 read), the upcast to fp32 (2 + 4), the multiply by the scale (4 + 4), the
# clamp to FP8's range (4 + 4), the cast to FP8 (4 + 1): 33 bytes.
FP8_CAST_BYTES = {"compiled": 5, "eager": 33}


FP8_MULTIPLE = 16  # parallel/float8.py: both dims of a converted weight are multiples of 16


def float8_linears(shape: ModelShape, moe: bool) -> list[tuple[str, int, int]]:
    """(name, in, out) of a block's linear layers that `float8: true` converts (parallel/float8.py `convertible`):
    attention, dense and shared-expert MLPs whose dims are multiples of 16; not the router, nor the routed experts
    (fused weights, not nn.Linear modules)."""
    return [(n, i, o) for n, i, o in shape.named_linears(moe)
            if n != "router" and not n.startswith("expert_") and i % FP8_MULTIPLE == 0 and o % FP8_MULTIPLE == 0]


def _linear_passes(w: Workload, shape: ModelShape) -> tuple[float, float]:
    """(forward passes, backward passes) over every block's linear layers in one micro-batch, as
    `step_flops_per_token` counts them: each block's forward plus its recomputation, and the backward of the
    blocks it reaches (a frozen weight's backward is its input gradient alone: one matmul, a trained one's two)."""
    recompute = {"full": 1.0, "selective": 0.5}.get(w.grad_ckpt, 0.0)
    layers_bwd = backward_layers(shape, w)
    return shape.layers + layers_bwd * recompute, layers_bwd * (2 if w.method == "full" else 1)


def _float8_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token of one block's converted layers (the mean block's, for a model mixing layer kinds)."""
    return shape.over_blocks(lambda moe: sum(2.0 * i * o for _, i, o in float8_linears(shape, moe))) / shape.layers


def float8_applies(w: Workload) -> bool:
    """Whether the run converts layers to FP8: `float8: true` with 16-bit weights and bf16 compute, which check and
    train require (check/config_rules.py float8_rules)."""
    return w.float8 and not methods.get(w.method).quantized and w.precision == "bf16"


def float8_flops(shape: ModelShape, w: Workload) -> float:
    """FLOPs per micro-batch of the matmuls that run in FP8 under `float8: true` (0 without it): the converted
    linear layers' forward, recomputation and backward. torchao's backward computes the weight gradient of every
    converted layer, a frozen one's too (LoRA's base layers: computed and dropped), so two matmuls each."""
    if not float8_applies(w):
        return 0.0
    fwd, _ = _linear_passes(w, shape)
    return _float8_per_token(shape) * (fwd + 2 * backward_layers(shape, w)) * w.tokens


def float8_replaced_flops(shape: ModelShape, w: Workload) -> float:
    """FLOPs per micro-batch of the 16-bit matmuls the FP8 ones replace: what the run without float8 computes of
    those layers (a frozen weight's backward there is its input gradient alone)."""
    if not float8_applies(w):
        return 0.0
    fwd, bwd = _linear_passes(w, shape)
    return _float8_per_token(shape) * (fwd + bwd) * w.tokens


def float8_cast_bytes(shape: ModelShape, w: Workload) -> float:
    """Bytes per micro-batch of torchao's casts to FP8 (`FP8_CAST_BYTES` per element, fused when compiled): each
    converted matmul's input and weight at every forward (recomputation included); at every backward, frozen weight
    or not, its output gradient twice (one layout per gradient matmul) and its weight and input again (torchao
    saves them in bf16)."""
    if not float8_applies(w):
        return 0.0
    fwd, _ = _linear_passes(w, shape)
    bwd = backward_layers(shape, w)
    t = w.tokens

    def forward(moe: bool) -> float:
        return sum(t * i + i * o for _, i, o in float8_linears(shape, moe))

    def backward(moe: bool) -> float:
        return sum(2 * t * o + i * o + t * i for _, i, o in float8_linears(shape, moe))

    mean = 1 / shape.layers
    per = FP8_CAST_BYTES["compiled" if w.compile else "eager"]
    return per * (fwd * shape.over_blocks(forward) * mean + bwd * shape.over_blocks(backward) * mean)


def float8_s(shape: ModelShape, w: Workload, card: Card, eff: float) -> float:
    """Seconds per micro-batch `float8: true` adds (a negative number: it saves them): the converted matmuls at
    the card's FP8 rate instead of the 16-bit ones they replace at its 16-bit rate (both at efficiency `eff`; the
    frozen weights' gradients are new work), and the casts at its memory bandwidth. A card without an FP8 rate (a
    CPU, emulating) keeps the 16-bit rate and pays the casts."""
    flops = float8_flops(shape, w)
    if flops == 0.0:
        return 0.0
    dense = card.dense_flops(w.precision)
    fp8 = card.fp8_flops or dense
    return flops / (fp8 * eff) - float8_replaced_flops(shape, w) / (dense * eff) + \
        float8_cast_bytes(shape, w) / card.hbm


def fp32_expert_flops(shape: ModelShape, w: Workload, strategy: str = "single", *, forward_only: bool = False) -> float:
    """FLOPs per micro-batch of the routed experts' matmuls that run in fp32 in a 16-bit run (0 elsewhere): the
    stacks bitsandbytes leaves unquantized (`experts_stay_16bit`) where peft's prepare_model_for_kbit_training
    upcast them (`frozen_weight_bytes` 4). transformers' grouped experts cast their input to the weights' dtype
    (integrations/moe.py `_grouped_mm`, 5.x) and autocast does not cover grouped_mm, so the top-k experts' forward,
    its recomputation and the frozen weights' input gradient are fp32 matmuls, and so is the weight gradient of
    the stacks that compute one (`expert_weight_grad_stacks`: LoRA folded in, or every stack of the compiled
    fallback); `forward_only`: one forward (a reference's).
    None under `strategy` where the engine gathers the parameters in 16 bits (FSDP, DeepSpeed): the stacks reach
    the grouped matmul in bf16 there (plan/precision.py `experts_run_fp32`, the rule memory reads too)."""
    if not experts_run_fp32(shape, w, strategy):
        return 0.0

    def routed(moe: bool) -> float:  # a token's top-k experts
        share = shape.routed_per_token / shape.experts
        return sum(2.0 * i * o * share for n, i, o in shape.named_linears(moe) if n.startswith("expert_"))

    fwd, bwd = (float(shape.layers), 0.0) if forward_only else _linear_passes(w, shape)
    folded = 0.0 if forward_only else backward_layers(shape, w) * expert_weight_grad_flops_per_token(shape, w, strategy)
    return (shape.over_blocks(lambda moe: routed(moe) if moe else 0.0) / shape.layers * (fwd + bwd) + folded) * \
        w.tokens


def fp32_experts_s(shape: ModelShape, w: Workload, card: Card, eff: float, strategy: str = "single", *,
                   forward_only: bool = False) -> float:
    """The fp32-experts term: seconds per micro-batch the routed experts' fp32 matmuls (`fp32_expert_flops`) take
    beyond what the 16-bit rate counted for them, both at efficiency `eff`. At the card's plain fp32 rate: the
    tools that run bitsandbytes QLoRA (the HF Trainer and those built on it) leave torch's default, no TF32; at
    its TF32 rate where the job turns TF32 on (`Workload.fp32_matmuls_tf32`: its `tf32`, or `torch_compile`).
    Under compile transformers routes fp32 stacks to its own loop of torch.mm (integrations/moe.py), which TF32
    covers as it covers torch's grouped_mm fallback."""
    flops = fp32_expert_flops(shape, w, strategy, forward_only=forward_only)
    if flops == 0.0:
        return 0.0
    return flops / (card.fp32_matmul_flops(w.fp32_matmuls_tf32) * eff) - flops / (card.dense_flops(w.precision) * eff)


def fp32_grouped_mm_calls(shape: ModelShape, w: Workload, strategy: str = "single", *,
                          forward_only: bool = False) -> float:
    """Grouped-matmul calls per micro-batch over the fp32 expert stacks (`fp32_expert_flops`; 0 where there are
    none), each reading its group offsets back to the host once: one per stack and pass (forward, recomputation,
    input gradient), and in eager one more for each weight gradient (`expert_weight_grad_stacks`); the compiled
    fallback's backward is one op for both gradients (`compiled_expert_fallback`). `forward_only`: one forward (a
    reference's). None of them takes torch's CUTLASS kernel (bf16 only, GroupedBlas.cpp `_grouped_mm_cuda`): its
    fallback (GroupedMMUtils.h), like transformers' loop under compile, copies the group offsets to the host and
    runs one mm per expert (`fp32_expert_mms`)."""
    if fp32_expert_flops(shape, w, strategy, forward_only=forward_only) == 0.0:
        return 0.0
    stacks = len({n for n, _, _ in shape.named_linears(True) if n.startswith("expert_")})
    moe = shape.moe_layers / shape.layers
    if forward_only:
        return moe * shape.layers * stacks
    grads = 0 if compiled_expert_fallback(shape, w, strategy) else len(expert_weight_grad_stacks(shape, w, strategy))
    fwd, bwd = _linear_passes(w, shape)
    return moe * (fwd * stacks + bwd * (stacks + grads))


def fp32_expert_mms(shape: ModelShape, w: Workload, strategy: str = "single", *, forward_only: bool = False) -> float:
    """The mm kernels per micro-batch the fp32 expert stacks' fallbacks launch (plan/dispatch.py), one per expert
    for each input or output and each weight gradient (`expert_weight_grad_stacks`): torch's fallback one per
    expert per call, the compiled fallback's backward two per expert in its one call (integrations/moe.py
    l.252-253)."""
    if fp32_expert_flops(shape, w, strategy, forward_only=forward_only) == 0.0:
        return 0.0
    if forward_only:
        return fp32_grouped_mm_calls(shape, w, strategy, forward_only=True) * shape.experts
    stacks = len({n for n, _, _ in shape.named_linears(True) if n.startswith("expert_")})
    fwd, bwd = _linear_passes(w, shape)
    grads = len(expert_weight_grad_stacks(shape, w, strategy))
    return shape.moe_layers / shape.layers * (fwd * stacks + bwd * (stacks + grads)) * shape.experts
