"""What a training step keeps for backward, per token and per rank: each block's saved activations by kind (softmax
attention, Mamba, Gated DeltaNet, latent attention, MLP, mixture of experts, LoRA's adapters), what checkpointed
blocks keep, the body at the loss and in backward, the loss's own buffers, and the media towers'.

Counted from transformers' blocks with saved-tensor hooks (tests/helpers.py `saved_tensor_bytes`); each function
says what it was checked against. plan/estimate.py adds these to the model states at each of the step's peaks."""

from __future__ import annotations

from shardfit import strategy as strategies
from shardfit.config.support import LOSS_CHUNK_MAX_ROWS
from shardfit.plan.adapter_inputs import adapter_input_tensors, dense_adapters, keeps_down_input
from shardfit.plan.adapters import adapts, lora_params, rank_of
from shardfit.plan.eager_scores import (
    eager_peak_bytes_per_token,
    eager_saved_bytes_per_token,
)
from shardfit.plan.in_flight import (
    all_to_all_bytes,
    down_projection_bytes_per_token,
    held_mask_bytes,
)
from shardfit.plan.media import vision_activation_bytes
from shardfit.plan.model_shape import ATTENTION, DELTA_CHUNK, MAMBA, MOE, Block
from shardfit.plan.precision import (
    autocast_fp32_master,
    casts_fp32_trainables,
    casts_trainable_inputs,
    compute_bytes,
    expert_matmul_bytes,
    experts_stay_16bit,
    linear_output_bytes,
    residual_bytes,
    runs_autocast,
    trainable_bytes,
)
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import FULL_LOSSES, LORA_TARGETS, Workload

# transformers' own causal-LM loss (what the HF Trainer, LLaMA-Factory, axolotl and TRL run) over every position.
# In backward: the saved fp32 log-softmax, its incoming gradient and the gradient it produces, all fp32 (the 16-bit
# logits are gone: the Trainer drops the model output before backward). Measured per logit element with MemTracker
# on a real step (tests/test_plan.py): 12.0 bytes. At the end of the forward pass the 16-bit logits, their fp32
# upcast and the log-softmax are alive at once; transformers 4.46-4.48 also copied the shifted fp32 logits
# (`loss: full_shift`; from 4.49 the labels are shifted instead).
FULL_LOSS_BYTES = 12


# torchtune's CEWithChunkedOutputLoss splits the sequence into this many slices (its `num_output_chunks`).
OUTPUT_CHUNKS = 8


def block_activation_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single",
                                     linear: bool | None = None, part: Block | None = None) -> float:
    """What autograd saves per token in one decoder block without checkpointing: the mean over the decoder's
    blocks, or in a Gated DeltaNet hybrid one kind's (`linear`: True for a Gated DeltaNet block, False for a
    softmax-attention block).

    Counted from transformers' Llama/Qwen2 blocks with saved-tensor hooks (tests/test_plan.py measures it):
    RMSNorm upcasts its input to fp32 and keeps it (and, when the norm weight trains, the normalised value in the
    residual stream's dtype); about six hidden-size 16-bit tensors under autocast (norm casts and outputs, the
    attention output reshaped for o_proj); q after RoPE, k, v and the attention output, plus fp32 log-sum-exp per
    head (k/v repeated to every head and the mask as a bias when SDPA runs with a mask); four MLP tensors (gate,
    up, act, product); LoRA's rank-sized A outputs for the seven projections. Without autocast (FSDP's 16-bit
    parameters), with 16-bit adapters, or with fp32 adapters whose input peft does not cast to fp32 first
    (`adapter_input_casts` off, shardfit's own runs), four of the six hidden-size tensors are not made: they are
    autocast's casts (of the fp32 residual stream in a full fine-tune, of peft's fp32 adapter inputs back to 16
    bits for LoRA). Measured on the speed run of bench/results/gpu_check_h200.json (Qwen2.5-0.5B, LoRA r16): those
    four casts were 1.2 GiB of the plan that the H200 never allocated.

    Under torch.compile (`compile`) the block saves what inductor's min-cut partitioner keeps, measured on a
    transformers Llama block compiled with AOTAutograd's inductor partitioner (bench/compile_activations.py): each
    norm's input in the residual dtype and its fp32 reciprocal RMS (the fp32 upcast and the normalised value are
    recomputed in backward), the two norm outputs and the attention output (the matmuls' inputs), the attention
    kernel's tensors as in eager, and three MLP tensors (gate, up, their product: the activation is recomputed).

    LoRA: each adapter keeps its rank-sized A output; with dropout also its dropped-out input (in the adapters'
    dtype where peft casts the input to it, else in the input's own) and the dropout's bool mask, as wide as the
    adapted layer's input.

    A `single_part` model's block (Nemotron-H) is one part under one norm (`part_activation_bytes_per_token`): the
    mean of its kinds, or (`part`) one kind's."""
    if shape.single_part:
        if part is not None:
            return part_activation_bytes_per_token(shape, w, strategy, part)
        shared = shape.shared_uses * shared_block_bytes_per_token(shape, w, strategy)
        return (shape.over_blocks(lambda kind: part_activation_bytes_per_token(shape, w, strategy, kind)) + shared) / \
            shape.layers
    a = compute_bytes(w)
    hidden_16 = 6 if casts_trainable_inputs(w, strategy) else 2
    if dense_adapters(shape, w):
        hidden_16 = adapter_input_tensors(w, strategy)
    elif hidden_16 == 6 and w.method != "full" and shape.moe_layers and not shape.every_expert:
        # Two of the four casts are of the dense MLP's input, for its gate and up adapters: a mixture's block with
        # grouped experts has no such MLP (they read the gathered copy `moe_saved_bytes_per_token` counts, in the
        # weights' dtype), so it makes two. Llama 4's experts are batched matmuls autocast casts the input of.
        hidden_16 -= 2 * shape.moe_layers / shape.layers
    h, q = shape.hidden, shape.heads * shape.hd
    mlp = shape.mean_active_mlp_width()
    lora = lora_saved_bytes_per_token(shape, w, strategy)
    norms = 2 * 4 * h + (2 * residual_bytes(w, strategy) * h if w.method == "full" else 0)
    attn = softmax_attention_bytes_per_token(shape, w, strategy)
    if shape.mamba_mixers:  # the mean block, or (`part`) a block with a Mamba mixer or one with attention alone
        mixed = paired_mamba_bytes_per_token(shape, w, strategy)
        attn = (mixed if part.mamba else attn) if part is not None else \
            (shape.mamba_mixers * mixed + (shape.layers - shape.mamba_mixers) * attn) / shape.layers
    if shape.linear_layers and linear is None:  # the mean block: Gated DeltaNet blocks keep the delta rule's
        softmax = shape.layers - shape.linear_layers
        attn = (softmax * attn + shape.linear_layers * deltanet_saved_bytes_per_token(shape, w)) / shape.layers
    elif shape.linear_layers and linear:
        attn = deltanet_saved_bytes_per_token(shape, w)
    kept = bnb_kept_input_bytes_per_token(shape, w)
    if w.compile:
        return 2 * residual_bytes(w, strategy) * h + 2 * 4 + a * (2 * h + q) + attn + 3 * a * mlp + lora + kept
    return norms + hidden_16 * a * h + attn + latent_attention_bytes_per_token(shape, w, strategy) + \
        mlp_activation_bytes_per_token(shape, w, strategy) + lora + kept


def bnb_kept_input_bytes_per_token(shape: ModelShape, w: Workload) -> float:
    """What a dense softmax-attention block's bitsandbytes 4-bit linears keep per token beyond what the block saves
    anyway, where MatMul4Bit keeps each linear's input until its backward (`Workload.bnb_keeps_inputs`, under
    Lightning's plugin): the inputs no other op of the block keeps, in the compute dtype, over the model's blocks
    (the mean block, as the block's other terms).
    - q/k/v's input (the attention norm's output) and gate/up's (the MLP norm's): an adapter of one of them keeps
      that very tensor where it reads it undropped and uncast (`lora_dropout` 0, adapters in the compute dtype);
      else a hidden-size tensor each;
    - o's input: the attention kernel's output, which SDPA and flash attention keep for their backward (the
      reshape is a view); eager attention's transposed copy is a tensor of its own (unless o's adapter keeps it);
    - down's input (the product of the activation and up), an MLP width wide: the product's own backward keeps
      its two factors, not it (unless down's adapter keeps it).
    MatMul4Bit keeps its input only where that input needs a gradient (`any(ctx.needs_input_grad[:2])`; its 4-bit
    weight never does). In the first block nothing upstream of the first adapted layer trains (the embedding and
    the norms are frozen under QLoRA), so that block keeps none of those inputs: q/k/v's always, and o's, gate/up's
    and down's too where no earlier layer of the block is adapted.
    Measured with saved-tensor hooks on a transformers Llama whose frozen linears keep their input as MatMul4Bit
    does (tests/test_plan_bnb_kept_inputs.py). 0 where the linears keep nothing, and for blocks of other kinds
    (mixtures, latent attention, Mamba, Gated DeltaNet), whose 4-bit inputs are not modelled."""
    if not (w.bnb_keeps_inputs and w.method == "qlora" and w.bnb_precision) or shape.moe_layers or \
            shape.mla is not None or shape.linear_layers or shape.mamba_mixers or shape.single_part:
        return 0.0
    a = compute_bytes(w)
    uncast = w.lora_dropout == 0 and trainable_bytes(w) == a
    h, q = shape.hidden, shape.heads * shape.hd
    mlp_in = ("up",) if shape.two_matrix else ("gate", "up")
    # In block order: the layers that read each input, and what keeping it costs per token (0 where an undropped
    # adapter of one of them keeps that tensor anyway).
    groups = ((("q", "k", "v"), h), (("o",), q if w.attention == "eager" else 0), (mlp_in, h),
              (("down",), shape.intermediate))
    every, first, upstream_trains = 0.0, 0.0, False
    for names, width in groups:
        kept = 0 if uncast and any(adapts(n, w) for n in names) else width
        every += kept
        first += kept if upstream_trains else 0
        upstream_trains = upstream_trains or any(adapts(n, w) for n in names)
    return a * ((shape.layers - 1) * every + first) / shape.layers


def lora_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str, kind: Block | None = None) -> float:
    """What a block's adapters save per token (`block_activation_bytes_per_token`): of the largest kind of block,
    or of `kind`."""
    if not w.trains_adapters:
        return 0.0
    a = compute_bytes(w)
    # LoRA on a fused expert weight (peft's ParamWrapper) adds B A to the weight itself: no per-token rank-wide
    # tensor (`lora_expert_copy_bytes` counts the merged weight it keeps instead).
    adapted = [(i, o) for name, i, o in shape.named_linears(kind)
               if adapts(name, w) and not name.startswith("expert_")]
    lora = len(adapted) * a * w.lora_rank
    if w.lora_dropout > 0:
        # Under autocast the adapter's matmul keeps a 16-bit input whether peft cast it to fp32 first (autocast
        # casts the dropped fp32 copy back) or not; without autocast, the dropped copy in the adapter's dtype.
        dropped = a if runs_autocast(w, strategy) and (dense_adapters(shape, w) or not w.adapter_input_casts) \
            else trainable_bytes(w)
        lora += sum((dropped + 1) * i for i, _ in adapted)
    return lora


# Where each linear layer of Zamba's shared block reads its input (`shared_block_bytes_per_token`): the input norm's
# output over the hidden state and the embedding, the kernel's output, the MLP norm's output, the MLP's activation,
# Zamba2's adapter's rank-wide middle, the shared block's output (the hybrid block's own linear).
_SHARED_SOURCES = {"q": "in", "k": "in", "v": "in", "o": "kernel", "linear_gate_up": "ff", "gate": "ff", "up": "ff",
                   "down": "act", "linear_hybrid": "out"}
# The sources that are fp32 in a full fine-tune under autocast (norms over fp32 weights, the fp32 residual):
# autocast casts them to 16 bits for each linear layer that reads them, a copy each.
_FP32_SOURCES = ("in", "ff", "out")


def shared_block_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What one use of Zamba's or Zamba2's shared transformer block (plan/shared_blocks.py) saves per token in a
    hybrid block, for an attention input A wide (the hidden state and the embedding side by side), an MLP m wide
    and Zamba2's adapters of rank r:
    - its two norms' fp32 upcasts and reciprocal RMS; where the norm weights train, their normalised values (the
      input norm's in the residual dtype, the MLP norm's, over the attention's 16-bit output, in 16 bits);
    - the attention kernel's tensors (`softmax_attention_bytes_per_token`: eager's S x S scores, or SDPA's and
      flash's q, k, v, output and log-sum-exp), and the MLP's gate/up output and the activation's input;
    - each linear layer's input: where nothing casts, each input tensor once (q/k/v's, gate/up's and the adapter's,
      down's, the adapter's middle, the hybrid linear's; o_proj's is the kernel's output); under autocast a full
      fine-tune's fp32 inputs (the norms' outputs, the shared block's output) once per layer that reads them, and
      peft's fp32 adapters a 16-bit copy of every adapted layer's input (the frozen base layers keep none);
    - LoRA's rank-wide A outputs, and with dropout its dropped-out input and mask, per adapted layer.
    Counted with saved-tensor hooks on tiny Zamba2 and Zamba models (tests/test_plan_mamba_hybrid.py): full and
    LoRA, with and without autocast, flash and eager attention; 0 for a block without a shared block."""
    if not shape.shared_uses:
        return 0.0
    linears = list(dict.fromkeys(shape.shared_linears))  # one use's layers (each use holds the same)
    widths = {name: (i, o) for name, i, o in linears}
    a, h = compute_bytes(w), shape.hidden
    attention_in = widths["q"][0]
    m = widths["down"][0]
    full = w.method == "full"
    norms = 4 * (attention_in + h) + 2 * 4 + ((residual_bytes(w, strategy) * attention_in + a * h) if full else 0)
    inner = softmax_attention_bytes_per_token(shape, w, strategy) + 3 * a * m
    casts = casts_trainable_inputs(w, strategy)
    saved: dict[str, float] = {}
    copies = 0.0
    for name, i, _ in linears:
        source = _SHARED_SOURCES.get(name) or ("ff" if i == h else "rank")  # Zamba2's adapter: in, then middle
        reads = full or adapts(name, w)
        if not reads or source == "kernel" and not (casts and not full):
            continue
        if casts and (not full or source in _FP32_SOURCES):
            copies += a * i
        else:
            saved[source] = a * i
    lora = 0.0
    if w.trains_adapters:
        adapted = [(n, i) for n, i, _ in linears if adapts(n, w)]
        lora = sum(a * rank_of(n, w) for n, _ in adapted)
        if w.lora_dropout > 0:
            dropped = a if runs_autocast(w, strategy) and not w.adapter_input_casts else trainable_bytes(w)
            lora += sum((dropped + 1) * i for _, i in adapted)
    return norms + inner + sum(saved.values()) + copies + lora


def part_activation_bytes_per_token(shape: ModelShape, w: Workload, strategy: str, kind: Block) -> float:
    """What a `single_part` block of `kind` saves per token: its one norm's (half a paired block's norms and
    16-bit hidden-size tensors), then its part's alone: softmax attention's kernel tensors, a Mamba-2 mixer's
    (`mamba_saved_bytes_per_token`), a two-matrix MLP's two tensors (up's output and its activation), or a
    mixture's (`moe_saved_bytes_per_token`); and its adapters'. Checked with saved-tensor hooks on transformers'
    NemotronHBlock of each kind (tests/test_nemotron_h.py)."""
    a, h = compute_bytes(w), shape.hidden
    hidden_16 = 3 if casts_trainable_inputs(w, strategy) else 1
    if kind.part == MOE and hidden_16 == 3 and w.method == "full":
        # A full fine-tune's mixture under autocast: the 16-bit casts of its fp32 input that the shared expert's
        # matmuls (one a matrix that reads it) and the latent projection make; the router's is its own count.
        hidden_16 = (0 if not shape.shared_intermediate else 1 if shape.two_matrix else 2) + \
            (1 if shape.moe_latent else 0)
    # NemotronHRMSNorm multiplies its weight in fp32: where the weight trains, the product keeps the fp32 value.
    norm = 4 * h + 4 + (4 * h if w.method == "full" else 0)
    if kind.part == ATTENTION:  # and o_proj's input, the kernel's output reshaped
        mixed = softmax_attention_bytes_per_token(shape, w, strategy) + a * shape.heads * shape.hd
    elif kind.part == MAMBA:
        mixed = mamba_saved_bytes_per_token(shape, w, strategy)
    elif kind.part == MOE:
        mixed = moe_saved_bytes_per_token(shape, w, strategy)
    else:
        mixed = 2 * a * shape.intermediate
    return norm + hidden_16 * a * h + mixed + lora_saved_bytes_per_token(shape, w, strategy, kind)


def mamba_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What a Mamba-2 mixer (transformers' NemotronHMamba2Mixer) saves per token as transformers runs it without
    the mamba_ssm and causal_conv1d kernels: its reference PyTorch chunked scan, which computes in fp32 whatever the
    weights' dtype. Counted with saved-tensor hooks on a tiny block (tests/test_nemotron_h.py), for H heads of P
    channels (I = H P), a state of N, G groups, chunks of L tokens and the C = I + 2 G N channels of the
    convolution, in bytes:
    - `2 a C`: the convolution's input and output over x, B and C in the compute dtype;
    - `16 H L`: per head and chunk four fp32 L x L matrices (the segment sums, their exponent, the scores and
      their product with the decays);
    - `20 H N`: B and C repeated to the heads, in fp32, for the chunk's and the states' products;
    - `32 I`: x in fp32 over the sequence and three times in chunks, and the gated norm's fp32 input, gate,
      product and normalised value;
    - `8 H N P / L`: the chunks' states and the states passed between them (fp32);
    - `2 a H + 20 H + 4 G`: dt in the compute dtype and fp32, its decays and cumulative sums, the norm's groups;
    - `a I`: out_proj's input, where its weight trains (a full fine-tune: LoRA leaves out_proj without an adapter,
      plan/adapters.py `adapts`, so its frozen matmul keeps no input).
    Under autocast the scan's einsums keep 16-bit copies of their inputs where the fp32 scan kept fp32 ones: B
    and C repeated to the heads (`5 H N` values), four of the L x L matrices (`4 H L`), x in chunks (`I`) and the
    states passed between chunks (`H N P / L`), 2 bytes a value fewer each (saved-tensor hooks on tiny Bamba,
    Granite 4.0 and Falcon-H1 blocks, LoRA and full, tests/test_plan_mamba_hybrid.py).
    `mamba_ssm` (`w.mamba_scan`): its fused mamba_split_conv1d_scan_combined, which transformers calls in training
    with the gated norm and out_proj inside, keeps by its autograd function's design in_proj's output (z, x, B, C
    and dt), the scan's output before the norm, and the norm's fp32 reciprocal RMS per group; its backward
    recomputes the chunks. Not measured here (mamba_ssm needs a GPU): a count from the kernel's design.

    A mixer without the gated norm (Falcon-H1 unless `mamba_rms_norm`: ModelShape `mamba_gated_norm` off) gates
    the scan's output by silu(z) alone, which keeps z in 16 bits and the fp32 product (`6 I`) where the norm kept
    `20 I + 4 G` (hooks on Falcon-H1's and Bamba's tiny mixers)."""
    a, heads, state = compute_bytes(w), shape.mamba_heads, shape.mamba_state
    norm = 4 * shape.mamba_groups if shape.mamba_gated_norm else 0
    if w.mamba_scan == "mamba_ssm":
        return a * (2 * shape.mamba_inner + shape.mamba_conv_channels + heads) + norm
    inner, chunk = shape.mamba_inner, max(shape.mamba_chunk, 1)
    # Where the mixer's own weights train (a full fine-tune), x in fp32 for D's gradient, the gated norm's
    # product with its weight, dt once more, and out_proj's input.
    trained = 8 * inner + 4 * heads + a * inner if w.method == "full" else 0
    gate = 32 * inner if shape.mamba_gated_norm else 18 * inner
    states = heads * state * shape.mamba_head_dim / chunk
    # The einsums' inputs autocast casts to 16 bits (the fp32 scan keeps them in fp32).
    cast = (4 - a) * (5 * heads * state + 4 * heads * chunk + inner + states) if runs_autocast(w, strategy) else 0
    if cast and not shape.mamba_gated_norm:
        cast -= falcon_h1_autocast_bytes(shape, w)
    return trained + 2 * a * shape.mamba_conv_channels + 16 * heads * chunk + 20 * heads * state + gate + \
        8 * states + 2 * a * heads + 20 * heads + norm - cast


def falcon_h1_autocast_bytes(shape: ModelShape, w: Workload) -> float:
    """What Falcon-H1's mixer keeps under autocast beyond the cast discount of `mamba_saved_bytes_per_token`
    (hooks on its tiny block, LoRA and full: tests/test_plan_mamba_hybrid.py): the fp32 exponent of the segment
    sums, which exp saves for its own backward beside the einsum's 16-bit copy (`4 H L`); and in_proj's output
    (z, x, B, C and dt, `I + C + H` values), which the gate's saved z keeps alive whole, in the dtype of the mup
    multiplier it is scaled by: a buffer in the weights' dtype, fp32 under a full fine-tune's fp32 masters (2 bytes
    a value more than the 16-bit one the pure-16-bit count holds)."""
    inner, heads = shape.mamba_inner, shape.mamba_heads
    wider = (4 - compute_bytes(w)) * (inner + shape.mamba_conv_channels + heads) if w.method == "full" else 0
    return 4 * heads * max(shape.mamba_chunk, 1) + wider


def paired_mamba_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What a Mamba hybrid's block that pairs a Mamba mixer with its MLP (ModelShape `mamba_mixers`: Jamba, Bamba,
    Falcon-H1, IBM Granite 4.0) saves per token for its token mixing, where an attention block saves softmax
    attention's tensors: the Mamba-2 mixer as Nemotron-H's (`mamba_saved_bytes_per_token`: the same reference
    scan, or mamba_ssm's fused kernel), Jamba's Mamba-1 mixer `mamba1_saved_bytes_per_token`; Falcon-H1's
    (`mamba_parallel`) both, side by side. Measured with saved-tensor hooks on each family's tiny model
    (tests/test_plan_mamba_hybrid.py).

    Where autocast casts the trainables' inputs (`casts_trainable_inputs`), a block whose mixer is Mamba alone
    keeps three hidden-size 16-bit casts of its norms' outputs (in_proj's, gate's and up's inputs) where
    `block_activation_bytes_per_token` counts an attention block's six: three fewer."""
    mixer = mamba1_saved_bytes_per_token(shape, w) if shape.mamba_v1 else \
        mamba_saved_bytes_per_token(shape, w, strategy)
    if shape.mamba_parallel:
        return mixer + softmax_attention_bytes_per_token(shape, w, strategy)
    fewer_casts = 3 * compute_bytes(w) * shape.hidden if casts_trainable_inputs(w, strategy) else 0
    return mixer - fewer_casts


def mamba1_saved_bytes_per_token(shape: ModelShape, w: Workload) -> float:
    """What Jamba's Mamba-1 mixer saves per token without the mamba_ssm kernels: transformers' reference selective
    scan, a loop over the tokens in fp32. For I channels and a state of N per channel: `14 I N`, the step's decay
    exp(dt A) and input dt B x per state element in fp32, the state each step reads out (fp32) and its 16-bit
    copy; about `25 I` for in_proj's output (x and the gate), the convolution's, dt in 16 bits and fp32, the
    gate's activation, the scan's output and out_proj's input; `20 N` for B and C through their norms. Counted
    with saved-tensor hooks on tiny mixers (I 128 to 256, N 8 to 32). `mamba_ssm`: its selective_scan_fn keeps the
    scan's inputs (x, dt, B, C, the gate) and, per chunk of 2048 tokens, the state (a count from its design)."""
    a, inner, state = compute_bytes(w), shape.mamba_inner, shape.mamba_state
    if w.mamba_scan == "mamba_ssm":
        return a * (4 * inner + 2 * state + shape.mamba_dt_rank) + 4 * inner * state / 2048
    return 14 * inner * state + 25 * inner + 20 * state


def softmax_attention_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What a softmax-attention block's attention saves per token, by kernel (`block_activation_bytes_per_token`
    describes it)."""
    a = compute_bytes(w)
    q, kv = shape.heads * shape.hd, shape.kv_heads * shape.hd
    if w.attention == "eager":
        # The chain's score-sized tensors (plan/eager_scores.py: the softmax's output, its cast, softcap's tanh,
        # dropout's mask and output, gpt-oss's sink column), k/v repeated to every head for the matmuls, and q;
        # gpt-oss keeps the int64 index of each row's max it subtracts, and no output copy (its matmul keeps inputs).
        attn = a * (3 if shape.attention_sinks else 4) * q + (8 * shape.heads if shape.attention_sinks else 0) + \
            eager_saved_bytes_per_token(shape, w, strategy)
    elif w.attention == "sdpa":
        # With a mask, SDPA converts it to an additive bias in the compute dtype per call and keeps it for its
        # backward (the row's width per token, every block: micro_batch x seq_len under static_shape), and
        # transformers repeats k/v to every head, as it hands GQA to SDPA only without a mask (transformers'
        # sdpa_attention.use_gqa_in_sdpa).
        attn = a * (2 * q + 2 * q) + 4 * shape.heads + a * w.row_len
        if w.sequence_parallel > 1:  # the Ulysses kernel's bool mask over the whole row, on each rank
            attn += (w.sequence_parallel - a) * w.seq_len
    else:
        attn = a * (2 * q + 2 * kv) + 4 * shape.heads
    if shape.qk_norm or shape.gated_attention:
        # RMSNorms over q and k (Qwen3, Qwen3-VL, Gemma 3, OLMo 2, GLM-4.5, Qwen3-Next...): each upcasts its input
        # and keeps it in fp32, and, where the norm weights train, its 16-bit output (saved-tensor hooks on tiny
        # Qwen3 and Qwen3-Next blocks: tests/test_plan_activations.py, tests/test_plan_hybrid.py).
        attn += 4 * (q + kv) + (a * (q + kv) if w.method == "full" else 0)
    if shape.gated_attention:
        # Qwen3-Next's and Qwen3.5's output gate: its input and sigmoid, and the attention output it multiplies.
        attn += 3 * a * q
    return attn


def largest_block_activation_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What the one block alive at a time saves per token (the block checkpointing recomputes, the reference's
    forward): the mean block, or in a Gated DeltaNet hybrid the larger of its two kinds, as every block of each
    kind is recomputed at some point of the backward."""
    if shape.single_part:  # a hybrid block (Zamba's) runs its shared block after its own part
        shared = shared_block_bytes_per_token(shape, w, strategy) if shape.shared_uses else 0.0
        return shared + max(block_activation_bytes_per_token(shape, w, strategy, part=kind)
                            for _, kind in shape.block_kinds())
    if shape.mamba_mixers:
        kinds = [Block(False, mamba=True)] + ([Block(False)] if shape.mamba_mixers < shape.layers else [])
        return max(block_activation_bytes_per_token(shape, w, strategy, part=kind) for kind in kinds)
    if not shape.linear_layers:
        return block_activation_bytes_per_token(shape, w, strategy)
    kinds = [True] + ([False] if shape.linear_layers < shape.layers else [])
    return max(block_activation_bytes_per_token(shape, w, strategy, linear) for linear in kinds)


def deltanet_saved_bytes_per_token(shape: ModelShape, w: Workload) -> float:
    """What a Gated DeltaNet block's token mixing saves per token where softmax attention saves q, k, v, its output
    and log-sum-exp, for the kernel `w.delta_rule` names.

    `torch`: counted from transformers' chunked delta rule in PyTorch (torch_chunk_gated_delta_rule, what runs
    where flash-linear-attention is not installed), which computes in fp32 whatever the weights' dtype, and checked
    against saved-tensor hooks on tiny Qwen3.5 blocks under bf16 autocast (tests/test_plan_hybrid.py). Per value
    head (keys are repeated to the value heads), in bytes:
    - `14 C`: per chunk of C tokens two fp32 C x C matrices (the pairwise decays and the chunk's scores) and
      autocast's 16-bit copies of two for their matmuls;
    - `38 dk`: q and k normalised, and the decayed keys, in fp32 over the sequence and again in chunks, and the
      16-bit copies the chunks' matmuls make of them;
    - `28 dv`: the values times beta and the corrected values in fp32, their chunks' 16-bit copies, the gated
      norm's fp32 input, gate and normalised value, and out_proj's 16-bit input;
    - `12 dk dv / C`: the running state each chunk reads (fp32) and the 16-bit copies its matmuls make;
    - 32 for the per-head decay, beta and their cumulative sums;
    plus the depthwise convolution's 16-bit input and output over q, k and v (`4` bytes per channel).

    `fla`: flash-linear-attention's chunk_gated_delta_rule keeps, per the design of its autograd function (its
    backward recomputes the chunks' products), the l2-normalised q and k and v in the compute dtype, the fp32
    cumulative decay, beta, the fp32 reciprocal norms of q and k, and the chunk's solved C-wide triangular matrix
    in the compute dtype; what the block does around the kernel (the decay and beta, the gated norm, out_proj's
    input: `16 dv + 32`, and the convolution) as the torch count. Not measured here (fla needs a GPU): a count from
    the kernel's published design."""
    c, dk, dv = DELTA_CHUNK, shape.linear_k_dim, shape.linear_v_dim
    channels = 2 * shape.linear_k_heads * dk + shape.linear_v_heads * dv
    if w.delta_rule == "fla":
        a = compute_bytes(w)
        per_head = a * (2 * dk + dv + c + 1) + 4 + 8 + 16 * dv + 32
    else:
        per_head = 14 * c + 38 * dk + 28 * dv + 12 * dk * dv / c + 32
    return shape.linear_v_heads * per_head + 4 * channels


def latent_attention_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What DeepSeek's multi-head latent attention (transformers' DeepseekV3Attention) saves per token beyond the
    Llama attention `block_activation_bytes_per_token` counts for the same heads; 0 without MLA. Counted with
    saved-tensor hooks on the real module (bf16 under autocast, LoRA and full, over hidden sizes, heads, ranks and
    head widths), the attention kernel as a GPU runs it (simulate/gpu_kernels.py):
    - each latent (the q latent where `q_rank` is set, and the kv latent) through its RMSNorm: the fp32 upcast and
      the fp32 reciprocal RMS, the 16-bit input of the up projection (q_b_proj, kv_b_proj), and when the norm
      weight trains the normalised value as well;
    - the kernel's q and k are one head width (nope + rope) each, as Llama's, but its v is a view of kv_b_proj's
      output (nope + v wide per head) and its output is v wide per head, where Llama's v and output are a head
      width each;
    - the output as o_proj reads it: the kernel's output itself (a GPU kernel writes it token-major, so the
      reshape copies nothing), which the Llama count takes a hidden-size copy for; fp32 LoRA adapters do copy it
      (peft's cast of o_proj's input), v wide per head;
    - autocast makes a 16-bit copy of the block input for each projection that reads it: two here (q_a_proj or
      q_proj, and kv_a_proj_with_mqa, which makes k and v both), three in Llama's."""
    m = shape.mla
    if m is None:
        return 0.0
    a, heads = compute_bytes(w), shape.heads
    latent = (4 + a + (a if w.method == "full" else 0)) * (m.q_rank + m.kv_rank) + 4 * (2 if m.q_rank else 1)
    kernel = a * heads * ((m.nope + m.v) + m.v - 2 * shape.hd)
    casts = casts_trainable_inputs(w, strategy)
    output = a * (heads * m.v if w.trains_adapters and casts else 0) - (a * shape.hidden if casts else 0)
    return latent + kernel + output - (a * shape.hidden if casts else 0)


def mlp_activation_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What one token's MLP saves, averaged over the decoder's blocks: a dense MLP its four tensors (gate, up,
    act, product; a two-matrix MLP up and act); a mixture's block `moe_saved_bytes_per_token`.

    All but the last are in the dtype the frozen linears return (`linear_output_bytes`): fp32 for bitsandbytes'
    4-bit layers over an fp32 residual stream (`frozen_fp32` under autocast), where down_proj's 16-bit input is
    its adapter's autocast copy. Measured with saved-tensor hooks on a Llama block whose frozen linears return
    their input's dtype as Linear4bit does (tests/test_plan_qlora_stream.py): 14 bytes a width, not 8."""
    saved = 2 if shape.two_matrix else 4
    down_input = compute_bytes(w) if keeps_down_input(shape, w) else 0
    dense = ((saved - 1) * linear_output_bytes(w, strategy) + down_input) * shape.intermediate
    return shape.over_blocks(lambda moe: moe_saved_bytes_per_token(shape, w, strategy) if moe else dense) / \
        shape.layers


def moe_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What a mixture's block saves per token, as transformers 5's grouped experts (`grouped_mm`) run it: for each
    of the top-k (token, expert) pairs (every expert's, for Llama 4) the token's input gathered in expert order,
    the tensors of its activation one expert width wide (`expert_widths_saved`) and the down output (weighted by
    the routing weight afterwards), with the routing weight and the int64 indices of the sort, the gather and the
    unsort; the router's (`router_saved_bytes_per_token`); the shared experts as a dense MLP. Experts behind a
    latent projection (Nemotron-H's `moe_latent`) gather and return latent-wide tensors, and the latent output
    projection keeps its input.

    The experts' matmuls run in their weights' dtype (transformers casts the input to it; autocast does not cover
    grouped_mm): fp32 for a full fine-tune's master weights under autocast, so those pairs' tensors are fp32.
    Llama 4's experts are plain batched matmuls, which autocast runs in 16 bits. A DeepSeek-V3 router's top-k
    weights stay fp32 outside autocast: the pairs' weighting reads them, no 16-bit copy.

    Under autocast over a full fine-tune's fp32 weights, `block_activation_bytes_per_token` counts a dense MLP's
    two 16-bit casts of its input (gate, up); a mixture's block makes the router's one (`router_saved_bytes_per_
    token`) and its shared experts' own (a single-part block, Nemotron-H's, counts no MLP's casts). Checked with
    saved-tensor hooks on the mixture modules of tiny Qwen3-MoE, gpt-oss, GLM-4.5, DeepSeek-V3 and Nemotron-H
    models (tests/test_plan_moe_saved.py)."""
    a = compute_bytes(w)
    e = 4 if autocast_fp32_master(w, strategy) and not shape.every_expert else \
        expert_matmul_bytes(w, strategy) if experts_stay_16bit(shape, w) else a
    width, d = shape.expert_width, shape.moe_latent or shape.hidden
    # Nemotron-H's experts weigh their output by the fp32 weights under autocast too (hooks see no 16-bit copy).
    weight = 0 if shape.router_groups and (shape.single_part or not runs_autocast(w, strategy)) else a
    pairs = shape.routed_per_token * (e * (2 * d + expert_widths_saved(shape) * width) + weight + 3 * 8)
    if shape.every_expert and autocast_fp32_master(w, strategy):
        # Llama 4 weighs every expert's copy of the input by its router score before the experts' matmuls, in the
        # fp32 residual stream's dtype: that product keeps its input fp32 where the pair's other tensors are 16-bit.
        pairs += shape.routed_per_token * (4 - a) * shape.hidden
    casts = 0
    if casts_trainable_inputs(w, strategy) and w.method == "full" and not (shape.every_expert or shape.single_part):
        shared = (1 if shape.two_matrix else 2) if shape.shared_intermediate else 0
        casts = a * shape.hidden * (shared - 2)
    # The latent output projection's input: the experts' combined output in 16 bits (autocast's copy where the
    # experts ran in fp32).
    latent = a * shape.moe_latent
    return pairs + router_saved_bytes_per_token(shape, w, strategy) + latent + casts + \
        expert_widths_saved(shape) * a * shape.shared_intermediate


def router_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What a mixture's router saves per token: the int64 indices of its top-k, and
    - a softmax router (Qwen3-MoE's, Mixtral's): its fp32 probabilities over every expert, the top-k of them
      renormalised (fp32) and their sum; under autocast over fp32 weights the 16-bit copy of its input;
    - gpt-oss's: its top-k softmax in 16 bits (k values), and under autocast over fp32 weights the 16-bit copy of
      its input;
    - DeepSeek-V3's (`router_groups`): where its weight trains (a full fine-tune), its input upcast to fp32 (under
      autocast the 16-bit copy autocast makes of it instead); the sigmoid scores, each group's top two (int64),
      the best groups (int64) and the experts' mask (bool), the top-k weights and their sum, all in fp32 (16 bits
      under autocast)."""
    a, h, k, experts = compute_bytes(w), shape.hidden, shape.top_k, shape.experts
    # Under autocast over fp32 weights the router's F.linear keeps autocast's 16-bit copy of its input.
    cast = a * h if runs_autocast(w, strategy) and w.method == "full" else 0
    if shape.clamped_swiglu:
        return a * k + 8 * k + cast
    autocast = runs_autocast(w, strategy)
    if not shape.router_groups:
        return 4 * experts + 8 * k + 4 * (k + 1) + cast
    r = a if autocast else 4
    groups = 16 * shape.router_groups + 8 * shape.router_topk_groups + experts
    return (r * h if w.method == "full" else 0) + r * experts + groups + 8 * k + r * (k + 1)


def router_copy_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The copy of a DeepSeek-V3 router's weight (`router_groups`) each mixture's block keeps for its backward: fp32
    outside autocast (the router upcasts it), 16 bits under autocast over 16-bit weights (autocast's cast of that
    upcast); none over fp32 weights, whose cast the weight casts already count."""
    if not shape.router_groups or autocast_fp32_master(w, strategy):
        return 0.0
    return (compute_bytes(w) if runs_autocast(w, strategy) else 4) * shape.experts * shape.hidden


def expert_widths_saved(shape: ModelShape) -> int:
    """Tensors one expert width wide that a (token, expert) pair saves, in the experts' dtype: SwiGLU its fused
    gate/up output (two widths), the activation and its product with up; gpt-oss's clamped SwiGLU the fused output
    (its clamp keeps it), the clamped gate and its sigmoid, their product, clamp(up) + 1 and the product of those
    (the down matmul's input), as saved-tensor hooks count them on transformers' GptOssExperts."""
    return 7 if shape.clamped_swiglu else 2 if shape.two_matrix else 4


def lora_expert_copy_bytes(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """LoRA on the routed experts (peft `target_parameters`): every forward of a mixture's block makes the merged
    weights W + B A of all its experts (one baddbmm per fused weight, in the frozen weights' dtype), which the
    grouped matmuls save for their backward: a copy of the block's expert weights, kept until that block's
    backward. Under autocast over fp32 adapters the merge also keeps the 16-bit casts of the experts' A and B
    (saved-tensor hooks on a tiny gpt-oss, tests/test_plan_moe_saved.py); over bitsandbytes' unquantized experts
    upcast to fp32 (`experts_stay_16bit`, `expert_matmul_bytes`) the merge runs in fp32 and keeps none
    (tests/test_plan_qlora_experts.py), except where FSDP or DeepSpeed hand the step 16-bit stacks."""
    if not (w.trains_adapters and w.lora_experts and shape.moe_layers):
        return 0.0
    adapted = [(n, i, o) for n, i, o in shape.named_linears(True) if n.startswith("expert_") and adapts(n, w)]
    weights = sum(i * o for _, i, o in adapted)
    stored = expert_matmul_bytes(w, strategy) if experts_stay_16bit(shape, w) else compute_bytes(w)
    copies = weights * stored
    if casts_fp32_trainables(w, strategy) and stored != 4:
        copies += compute_bytes(w) * sum(rank_of(n, w) * (i + o) for n, i, o in adapted)
    return copies


def matmul_widths(shape: ModelShape, w: Workload) -> list[int]:
    """Output width of each matmul of one decoder block, in the order they run: q, k, v, o, gate, up, down, each
    followed by its LoRA A and B. A mixture of experts counts as one MLP of top-k experts' width."""
    q, kv = shape.heads * shape.hd, shape.kv_heads * shape.hd
    mlp = shape.active_mlp_width()
    outs = [q, kv, kv, shape.hidden, mlp, mlp, shape.hidden]
    if w.trains_adapters:
        targets = w.lora_targets or LORA_TARGETS
        return [width for name, out in zip(LORA_TARGETS, outs, strict=True)
                for width in ((out, w.lora_rank, out) if name in targets else (out,))]
    return outs


def checkpointed_block_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What a checkpointed block keeps from its forward to its backward, per token: its input, and with selective
    checkpointing the outputs it is told to keep: every other matmul's (the first, third, ...) and the attention
    kernel's (its output and fp32 log-sum-exp per head; eager attention runs no kernel)."""
    kept = residual_bytes(w, strategy) * shape.hidden
    if w.grad_ckpt == "selective":
        kept += compute_bytes(w) * sum(matmul_widths(shape, w)[0::2])
        if w.attention != "eager":
            kept += compute_bytes(w) * shape.heads * shape.hd + 4 * shape.heads
    return kept


def activation_bytes(shape: ModelShape, w: Workload, layers: int, strategy: str = "single",
                     at_down_backward: bool = False) -> float:
    """Saved activations of `layers` blocks for one micro-batch, as backward finds them (the recomputed block of
    checkpointing included, with its recomputation's transients `down_projection_bytes_per_token`), or
    (`at_down_backward`) once the block alive (recomputed, or the last) has run its down projection's backward:
    its recomputation's transients gone, and down's input too (`down_backward_bytes_per_token` counts the
    gradients then alive).

    With checkpointing only each block's input stays (fp32 when autocast runs over fp32 master weights), with
    what selective checkpointing keeps besides, and one block is recomputed at a time during backward. Autocast
    also keeps the 16-bit copy of every weight it cast until backward has used it (`weight_cast_bytes`). The block
    alive at a time (recomputed, or the last) adds eager attention's peak above its saved scores
    (`score_peak_bytes_per_token`)."""
    tokens = w.tokens
    # down's input, saved by down (or its adapter) until its backward has run
    used = compute_bytes(w) * shape.intermediate if at_down_backward and keeps_down_input(shape, w) else 0.0
    cast = weight_cast_bytes(shape, w, strategy)
    copies = lora_expert_copy_bytes(shape, w, strategy) + router_copy_bytes(shape, w, strategy)
    scores = score_peak_bytes_per_token(shape, w, strategy)
    if w.grad_ckpt != "none":
        # Checkpointed blocks keep nothing else, not even their weight casts: only the recomputed block has them;
        # selective's kept outputs of the recomputed block are the very tensors its recomputation saves again.
        kept = checkpointed_block_bytes_per_token(shape, w, strategy)
        reused = kept - residual_bytes(w, strategy) * shape.hidden
        recomputed = largest_block_activation_bytes_per_token(shape, w, strategy) + scores - reused
        in_flight = 0.0 if at_down_backward else down_projection_bytes_per_token(shape, w, strategy, recomputed=True)
        return tokens * (layers * kept + recomputed + in_flight - used) + cast + \
            copies + held_mask_bytes(w, strategy)
    per_block = block_activation_bytes_per_token(shape, w, strategy)
    return tokens * (layers * per_block + (scores - used if layers else 0.0)) + layers * cast + \
        layers * copies * shape.moe_layers / shape.layers


def score_peak_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """Eager attention's peak above its saved scores in one block (plan/eager_scores.py) less what the block saves
    after its scores, none yet made at their forward peak nor left at their backward one: o_proj's input, the
    second norm's, autocast's casts of the MLP's input and the MLP's tensors (a `single_part` block: o_proj's
    input alone)."""
    peak = eager_peak_bytes_per_token(shape, w, strategy)
    a, h = compute_bytes(w), shape.hidden
    if not peak or shape.single_part:
        return max(0.0, peak - a * shape.heads * shape.hd)
    norm = 4 * h + 4 + (residual_bytes(w, strategy) * h if w.method == "full" else 0)
    casts = 2 * a * h if casts_trainable_inputs(w, strategy) else 0
    mlp = mlp_activation_bytes_per_token(shape, w, strategy)
    return max(0.0, peak - a * shape.heads * shape.hd - norm - casts - mlp)


def weight_cast_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The 16-bit copies of one block's weights autocast keeps for backward in a full fine-tune over fp32 master
    weights: 2 bytes a weight, less the routed experts' where transformers runs them as grouped matmuls, which
    autocast does not cover (they compute in fp32 from the master weights; Llama 4's batched matmuls are cast).
    Whole-model saved-tensor hooks on tiny Qwen3-MoE and GLM-4.5 models showed no copy of the expert weights."""
    if not autocast_fp32_master(w, strategy):
        return 0.0
    grouped = 0 if shape.every_expert else sum(i * o for name, i, o in shape.named_linears()
                                               if name.startswith("expert_"))
    return 2.0 * (shape.layer_params() - grouped)


def forward_activation_bytes(shape: ModelShape, w: Workload, layers: int, strategy: str,
                             phase: str = "forward") -> float:
    """What the body holds when the loss runs (`phase` forward) or takes its gradient (backward), or (`phase`
    body) at its own forward peak before it returns, for one micro-batch.

    Blocks: everything they save, or what checkpointed blocks keep (`checkpointed_block_bytes_per_token`). After
    the last block: the final norm's fp32 input, its normalised value when the norm weight trains, its output (the
    loss input) where the loss keeps it, and rotary cos/sin. Autocast's cache: the 16-bit copy of every fp32
    weight cast so far, held until the autocast region ends after the loss (the whole body for a full fine-tune
    over fp32 masters, fp32 LoRA adapters); in backward only the copies autograd saved remain, none when the
    blocks are checkpointed."""
    tokens = w.tokens
    r = residual_bytes(w, strategy)
    h = shape.hidden
    per_block = block_activation_bytes_per_token(shape, w, strategy) if w.grad_ckpt == "none" else \
        checkpointed_block_bytes_per_token(shape, w, strategy)
    norm_trains = w.method == "full"
    if w.loss != "chunked":  # the head's matmul keeps its (16-bit) input only when the head trains
        loss_input = compute_bytes(w) if w.method == "full" else 0
    else:  # shardfit's chunked loss holds it to run each chunk's backward
        loss_input = r
    # The last block's output itself is not kept: the final norm saves its fp32 upcast (the output itself when
    # the residual stream is fp32).
    head = 4 * h + (r * h if norm_trains else 0) + loss_input * h + shape.hd * 2 * 4
    if phase == "body":
        # Before the body returns: its embedding output (a variable of its forward; in an fp32 residual stream the
        # first norm's upcast is that very tensor, saved with the first block), rotary cos/sin and the mask
        # (`held_mask_bytes`), with the last block at its down projection (`down_projection_bytes_per_token`) or
        # the final norm's upcast, normalised value and output.
        norm = 4 * h + r * h + (r * h if norm_trains else 0)
        embedded = 0 if r == 4 else r * h
        head = embedded + shape.hd * 2 * 4 + max(down_projection_bytes_per_token(shape, w, strategy, False), norm)
    # Autocast caches only casts of leaf weights that require grad (a full fine-tune's masters); a frozen fp32
    # weight's cast (`loaded_fp32`) lives on as the matmul's saved tensor, which checkpointed blocks do not keep.
    held = w.method == "full" or w.grad_ckpt == "none"
    cast = 2 * shape.decoder_params() * layers / shape.layers if autocast_fp32_master(w, strategy) and held else 0
    if w.trains_adapters and casts_fp32_trainables(w, strategy):
        cast += 2 * lora_params(shape, w) * layers / shape.layers
    if w.grad_ckpt == "none":  # checkpointed blocks save nothing in forward
        cast += (lora_expert_copy_bytes(shape, w, strategy) + router_copy_bytes(shape, w, strategy)) * layers * \
            shape.moe_layers / shape.layers
    if phase == "backward" and w.grad_ckpt != "none":
        cast = 0
    return tokens * (layers * per_block + head) + cast + held_mask_bytes(w, strategy, phase == "body") + \
        all_to_all_bytes(shape, w)


def logits_bytes(shape: ModelShape, w: Workload, strategy: str = "single", phase: str = "forward") -> float:
    """The loss at its peak in `phase` (forward: the loss computed; backward: its gradient).

    shardfit's chunked loss makes its gradient in the forward pass: one chunk of fp32 logits and its 16-bit
    gradient, the gradient handed back to the body, and when the head trains its fp32 gradient (accumulated chunk
    by chunk), a 16-bit copy of an fp32 head and the fp32 chunk input. With a full loss, every position's logits at
    once, as transformers' loss computes them (FULL_LOSS_BYTES in backward). Under torch.compile the fused
    cross-entropy saves its input and a log-sum-exp per row, not a log-softmax (the min-cut partitioner keeps the
    smaller set; the input is alive anyway).

    torchtune's chunked output (`chunked_output`, torchtune.modules.loss.CEWithChunkedOutputLoss): the head runs
    over OUTPUT_CHUNKS slices of the sequence, the recipe holds every slice's 16-bit logits until the loss is
    done, and each slice is upcast to fp32 inside the loss: eager cross-entropy saves each slice's fp32
    log-softmax, compiled it saves the 16-bit slice itself. In backward one slice's fp32 and 16-bit gradients
    exist at a time."""
    tokens = w.tokens
    c = compute_bytes(w)
    # An fp32 head under autocast (a full fine-tune's master, or frozen in fp32): the matmul keeps its 16-bit cast
    # for the gradient of its input until the head's backward.
    head_cast = shape.vocab * shape.hidden * c if (w.frozen_fp32 or w.method == "full") and runs_autocast(
        w, strategy) else 0
    if w.loss in FULL_LOSSES:
        # The log-softmax runs in fp32 (the loss upcasts, or autocast does), except for a loss over 16-bit logits
        # that leaves the upcast to autocast when no autocast runs.
        soft = c if w.loss == "full_shift16" and not runs_autocast(w, strategy) else 4
        if phase == "backward":
            per = FULL_LOSS_BYTES * soft // 4
        else:  # the 16-bit logits, the shifted copy, the fp32 logits (the upcast), the log-softmax
            shifted = {"full_shift": 4, "full_shift16": c}.get(w.loss, 0)
            per = (c if c != 4 else 0) + shifted + (4 if soft == 4 else 0) + (0 if w.compile else soft)
        return tokens * shape.vocab * per + head_cast
    if w.loss == "chunked_output":
        elements = tokens * shape.vocab
        if phase == "backward":
            return elements * (c if w.compile else 4) + elements / OUTPUT_CHUNKS * (4 + c) + head_cast
        return elements * (c + (0 if w.compile else 4)) + elements / OUTPUT_CHUNKS * 4 + head_cast
    if phase == "backward":
        return 0.0
    rows = min(w.loss_chunk or LOSS_CHUNK_MAX_ROWS, tokens)
    # In fp32 the upcast and the gradient's cast are no-ops: one fp32 chunk, its gradient computed in place.
    b = rows * shape.vocab * (4 + (c if c < 4 else 0)) + tokens * shape.hidden * residual_bytes(w, strategy) + \
        head_cast
    if w.method == "full":
        head = shape.vocab * shape.hidden
        b += head * 4 + rows * shape.hidden * 4
    return b


def media_activation_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What one micro-batch's images and audio clips hold through the step (`image_activation_bytes` and
    `audio_activation_bytes`): kept until backward reaches the towers, which it does last."""
    return image_activation_bytes(shape, w, strategy) + audio_activation_bytes(shape, w, strategy)


def image_activation_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The images of one micro-batch through a vision-language model's tower (plan/media.py); 0 without images."""
    if shape.vision is None or w.images == 0:
        return 0.0
    patches = w.rows * w.images * w.image_rows * w.image_cols
    cast_copy = strategies.get(strategy).sharded or (w.vision_trainable and w.method == "full")
    return vision_activation_bytes(shape.vision, patches, w.vision_trainable, compute_bytes(w), cast_copy,
                                   checkpointed=w.grad_ckpt != "none")


def audio_activation_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The audio clips of one micro-batch through the step: their log-mel features (fp32, mel bins x frames, as
    the feature extractor makes them), the 16-bit copy FSDP's mixed precision makes of the root's inputs and keeps
    for the whole forward, and for a trainable tower every block's saved activations (plan/audio.py). A frozen
    tower saves nothing: it runs at the start of the forward pass, long before the step's peak. 0 without clips."""
    a = shape.audio
    if a is None or w.audio_clips == 0:
        return 0.0
    clips = w.rows * w.audio_clips
    low = compute_bytes(w)
    per_value = 4.0 + (low if strategies.get(strategy).sharded and low != 4 else 0)
    features = clips * w.audio_frames * a.mels * per_value
    if not w.audio_trainable:
        return features
    return features + clips * a.saved_bytes(w.audio_frames, low, checkpointed=w.grad_ckpt != "none",
                                            stem=not w.trains_adapters)
