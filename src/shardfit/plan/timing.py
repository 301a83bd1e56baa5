"""Predicted step time and tokens/s of each strategy: FLOPs at the rate training reaches on the card, and the
bytes each engine moves over its links, overlapped where the engine overlaps.

Compute, per token, from the layer widths (the matmuls' 2 FLOPs per multiply-add):
- forward: every linear layer of a block (a mixture of experts: its top-k experts), attention's two matmuls over
  the attended positions (half the sequence on average for a causal kernel that skips masked blocks, the whole
  sequence where a dense mask is applied), LoRA's A and B, and the head;
- backward: the input gradient of every layer that backward passes through (as much as the forward), the weight
  gradient only of trainable weights (LoRA skips it for the frozen base); flash attention's backward recomputes
  the scores, 2.5 times its forward (Dao, FlashAttention-2, sec. 3.1.2); backward stops below the first trainable
  layer (a `freeze` run of the last blocks does not reach the first ones);
- recomputation: full checkpointing runs each block's forward again; selective checkpointing only the matmuls whose
  outputs it does not keep (every other one, models/checkpointing.py);
- these FLOPs run at the fraction of the card's peak that large-model training reaches (hardware FLOPs
  utilization, plan/cards.yaml), which already pays for an eager step's elementwise work (norms, activations,
  rotary, softmax, casts); QLoRA's dequantization of every 4-bit weight in every use (forward, backward, and again
  where checkpointing recomputes the block) is added as memory-bound traffic at the memory bandwidth, its kernels
  to the host's launches (`DEQUANT`, per backend: torchao's eager ops or bitsandbytes' fused kernel), and the
  optimizer step at the memory bandwidth too (28 bytes per trainable parameter).

Communication per micro-batch or step (ring collectives: all-reduce moves 2(n-1)/n of the buffer per GPU,
all-gather and reduce-scatter (n-1)/n; NCCL's bus bandwidth): DDP all-reduces the trainable gradients once per
optimizer step, overlapped with backward; FSDP2 all-gathers the 16-bit parameters once per micro-batch
(`zero2`: kept for backward) or twice (`zero3`: again in backward), reduce-scatters fp32 gradients every
micro-batch (FSDP2's default and shardfit's: each rank keeps only its gradient shard; once per step under FSDP1's
no_sync(), `fsdp1_no_sync`), and prefetches, so compute and communication overlap; offload copies each shard
host-to-device before each all-gather and the gradient shard back, over PCIe, and runs AdamW on the CPU.
`model_parallel` runs its stages one after another: one GPU computes at a time. Across nodes the ring runs at
the slower of NVLink/PCIe and the node's network bandwidth (one ring per NIC). A published run of an engine that
waits for some of its collectives (FSDP1 with LoRA in flat parameters, FSDP1 without backward prefetch, DeepSpeed
ZeRO-3 before v0.6.0) has those added after its compute instead: `exposed_collectives`, with the engines' code
cited there.

Host dispatch (the fixed cost of a micro-batch): eager PyTorch launches every op from the host, one at a time,
while the GPU runs what was launched before, so a micro-batch cannot finish sooner than the host takes to launch
its ops. The ops per decoder layer were counted with a TorchDispatchMode on transformers' Llama and Qwen2 layers,
with and without peft LoRA, checkpointing and autocast (bench/dispatch_ops.py, LAYER_OPS below); each op that
launches a kernel costs the host ~8 us (a PyTorch eager CUDA op submitted back to back on an A100: 8 us/op,
https://github.com/flagos-ai/Torch-FL/pull/27; ~7 us for a Python-level op with autograd,
https://github.com/pytorch/pytorch/issues/41383), a view ~1 us (the C++ dispatcher alone, the same thread). The
host and the GPU overlap, so a micro-batch takes max(GPU time, host time): the lower bound of that overlap, since a
step that alternates small and large kernels waits on each in turn. Short sequences are host-bound, long ones
compute-bound. torch.compile fuses the elementwise ops between two matmuls into one kernel, so a compiled block
launches about two kernels per matmul and no views.

Three costs of the code itself, each a named term (docs/planning.md): the trained head's weight gradient where
it is an fp32 matmul (`head_gradient_s`), a dense mask's whole square against the causal half of kernels that take
the examples' boundaries (`attended_positions`), and the device's idle at each host wait (`host_sync_s`).

The engine's own host work: DDP's reducer runs a hook per parameter as its gradient is ready; FSDP runs Python
around every wrapped block (all-gather copy-in and copy-out, resharding, the reduce-scatter's copies; FSDP1 with
use_orig_params=True also re-points every original parameter at the unsharded flat parameter and back). That
work sits between the launches on the same host thread, so it adds to the host's time per micro-batch. Measured
per block by bench/fsdp_host_overhead.py (ENGINE_HOST_S below): forward + backward of tiny Llama models of 4 and
8 blocks in one gloo process, plain and under each engine, the difference per extra block; about 1.5 ms for
FSDP2, 2-2.7 ms for FSDP1, 0.1-0.2 ms for DDP, against about 1 ms for a plain block's own ops. Host time on the
development machine's CPU (a Python-bound cost). Only the blocks' wrapping is counted: FSDP1's adapter units
(`flat_params`) are not.

Fusion under torch.compile (a credit on the eager rate): in eager PyTorch every elementwise op reads its inputs from
GPU memory and writes its output back; inductor fuses the ops between two matmuls into one kernel that reads each
input once and writes each output once. The bytes the non-matmul kernels of one decoder layer move per token,
forward + backward (+ recomputation), were counted both ways on transformers' Llama layer in bf16
(bench/elementwise_bytes.py: a TorchDispatchMode over the eager aten ops, inductor's own count of its generated
kernels for the compiled forward and backward graphs; matmuls and attention left out on both sides, as they are
FLOPs here) and solved exactly as bytes = a*h + b*i + c*q + d*kv of the widths (ELEMENTWISE_BYTES below; a held-out
shape within 3 %). The card's training utilization stays the model of an eager step; a compiled micro-batch
computes for the eager time less (eager - compiled bytes) / memory bandwidth. The head and the loss are not in
that credit (tools differ in whether they compile the loss).

The kernels in turn (a floor under every GPU micro-batch): the training utilization is what large models reach,
whose steps are nearly all matmuls; a small model's step holds more non-matmul work for its FLOPs (per token, a
layer's elementwise bytes grow with the width, its FLOPs with the width squared, and the logits' passes through the
loss with the vocabulary). The kernels of one stream run one after another, so no micro-batch computes faster than
its matmuls at the card's GEMM efficiency plus every other kernel's bytes at the memory bandwidth: each layer's
(ELEMENTWISE_BYTES) and the rest of the model's (REST_BYTES: the embedding, final norm, and the logits upcast to
fp32 through log-softmax and its backward, about 48 bytes per token and vocabulary entry eager). Where that sum
is the longer, it is the compute time: GPT-2 124M's (12 layers of 768, a 50k vocabulary) is 1.6x the
utilization's on an A100; an 8B model's is below it (A100: 0.87/0.52 = 1.7x the matmuls' time is the
utilization's, so the floor takes over once the other kernels take more than 0.7x the matmuls' time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from shardfit import method as methods
from shardfit import strategy as strategies
from shardfit.plan import experts
from shardfit.plan.adapters import adapts
from shardfit.plan.attention_layout import CHUNK, WINDOW
from shardfit.plan.cards import Card, card_of
from shardfit.plan.estimate import planned_shape, planned_workload, trainable_params, with_loss_chunk
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import DELTA_CHUNK, BlockGroup
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import LORA_TARGETS, Workload

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
# torch's AdamW on the CPU (offload) streams weights, gradients and both moments at host memory speed: read 16 and
# write 12 bytes per fp32 parameter; 10 GB/s is a conservative share of one socket's DRAM bandwidth for the
# foreach/for-loop kernels torch runs there (no DeepSpeed CPUAdam).
HOST_ADAM_BYTES_PER_S = 10e9
ADAM_BYTES_PER_PARAM = 28
FWD_SHARE = 1 / 3  # the forward pass's part of a micro-batch, for what overlaps with forward-only traffic
FLASH_BWD = 2.5  # FlashAttention-2's backward: 5 matmuls against the forward's 2
# Host time per dispatched op (sources in the module docstring): one that launches a kernel, one that is a view.
DISPATCH_KERNEL_S = 8e-6
DISPATCH_VIEW_S = 1e-6
# aten ops of one decoder layer's forward + backward (+ recomputation), counted by bench/dispatch_ops.py
# (torch 2.13, transformers 5.23, peft 0.21; Llama; Qwen2 within 3 %): (kernels, views, matmuls) keyed by
# (base: full | lora2 | lora7 (LoRA on 2 or all 7 linears), checkpointing, autocast). The width does not change
# the count, so a tiny model's count is the real model's.
LAYER_OPS: dict[tuple[str, bool, bool], tuple[int, int, int]] = {
    ("full", False, False): (114, 105, 23), ("full", False, True): (122, 105, 23),
    ("full", True, False): (148, 190, 30), ("full", True, True): (160, 190, 30),
    ("lora7", False, False): (187, 199, 58), ("lora7", False, True): (251, 199, 58),
    ("lora7", True, False): (261, 332, 79), ("lora7", True, True): (357, 332, 79),
    ("lora2", False, False): (127, 109, 28), ("lora2", False, True): (151, 109, 28),
    ("lora2", True, False): (173, 182, 39), ("lora2", True, True): (209, 182, 39),
}
# Dropout on the adapters (lora7, lora_dropout 0.05): extra kernels per adapted linear, by checkpointing.
DROPOUT_OPS = {False: (222 - 187) / 7, True: (324 - 261) / 7}
FIXED_OPS = (50, 25)  # embedding, final norm, head and loss, once per micro-batch (kernels, views)
# transformers' torch Gated DeltaNet (`delta_rule: torch`): what each DELTA_CHUNK-token chunk of a row adds to one
# DeltaNet block (kernels, views), counted by bench/delta_rule_ops.py (torch 2.13, transformers 5.23), keyed by
# autocast: (forward, forward + backward). Its Python loop over the chunks dispatches them one by one.
DELTA_CHUNK_OPS = {True: ((21, 24), (64, 46)), False: ((13, 24), (45, 46))}
# The reference forward of DPO/KTO with the adapters switched off (peft's disable_adapter, under torch.no_grad): the
# aten ops of one decoder layer and of the rest of the model (kernels, views), keyed by autocast, counted as
# bench/dispatch_ops.py counts a step (its OpCounter over tiny Llama models of 1 and 2 layers, the difference per
# layer; torch 2.13, transformers 5.23, peft 0.21). The count is the same with LoRA on 2 or 7 linears, or none:
# switched-off adapters launch nothing.
REFERENCE_LAYER_OPS = {False: (43, 31), True: (47, 31)}
REFERENCE_FIXED_OPS = {False: (18, 5), True: (23, 5)}
# shardfit's chunked loss: what each chunk after the first adds (kernels, views), by whether the head trains and
# autocast, counted by bench/dispatch_ops.py (`loss/...`).
LOSS_CHUNK_OPS = {(True, False): (16.0, 8.3), (True, True): (21.0, 8.3),
                  (False, False): (15.0, 7.3), (False, True): (19.0, 7.3)}
# Bytes per token that one decoder layer's non-matmul kernels read and write in a training micro-batch (forward +
# backward (+ recomputation)), as coefficients (a, b, c, d) of a*h + b*i + c*q + d*kv (hidden, intermediate,
# heads*head_dim, kv_heads*head_dim), eager and compiled (inductor), counted by bench/elementwise_bytes.py (torch
# 2.13, transformers 5.23, peft 0.21; Llama in bf16, sdpa; Qwen2 within 2.3 % at Llama-3.1-8B's widths) and written to
# bench/results/elementwise_bytes.json, keyed by (full | lora7 (LoRA on all 7 linears), full checkpointing).
ELEMENTWISE_BYTES: dict[tuple[str, bool], dict[str, tuple[float, float, float, float]]] = {
    ("full", False): {"eager": (314.19, 36.0, 60.0, 83.75), "compiled": (56.19, 16.0, 14.5, 22.78)},
    ("full", True): {"eager": (396.25, 54.0, 84.0, 109.25), "compiled": (66.25, 18.0, 56.5, 8.53)},
    ("lora7", False): {"eager": (364.12, 78.0, 84.0, 126.75), "compiled": (64.12, 30.0, 28.5, 42.54)},
    ("lora7", True): {"eager": (464.19, 124.0, 122.0, 187.25), "compiled": (80.19, 32.0, 62.5, 26.29)},
}

# Bytes per micro-batch that the model outside its decoder layers moves in non-matmul kernels (embedding, final
# norm, the logits through transformers' causal-LM loss, in fp32, and their backward; rotary tables), as
# coefficients (vt, ht, vh, t) of V*T + h*T + V*h + T (vocabulary, hidden, tokens of the micro-batch; V*h: the
# embedding's dense gradient, where it trains), eager and compiled, counted by bench/elementwise_bytes.py (`rest`)
# on the same Llama in bf16, keyed by full | lora (frozen embedding and head).
REST_BYTES: dict[str, dict[str, tuple[float, float, float, float]]] = {
    "full": {"eager": (47.985, 136.063, 4.015, 1015.688), "compiled": (9.986, 12.066, 20.014, 90.75)},
    "lora": {"eager": (47.993, 2.017, 2.007, 970.687), "compiled": (9.995, -13.979, 4.005, -498.563)},
}

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

# Host seconds a data-parallel engine adds per decoder block and micro-batch, keyed by engine and (full | lora,
# full checkpointing), measured by bench/fsdp_host_overhead.py (torch 2.13, transformers 5.23, peft 0.21; written
# to bench/results/fsdp_host_overhead.json; medians of 12 interleaved rounds). `zero2`: parameters kept gathered
# between forward and backward (FSDP2 reshard_after_forward=False, FSDP1 SHARD_GRAD_OP).
ENGINE_HOST_S: dict[str, dict[tuple[str, bool], float]] = {
    "ddp": {("full", False): 0.15e-3, ("full", True): 0.20e-3,
            ("lora", False): 0.14e-3, ("lora", True): 0.08e-3},
    "fsdp2": {("full", False): 1.52e-3, ("full", True): 1.46e-3,
            ("lora", False): 1.68e-3, ("lora", True): 1.37e-3},
    "fsdp2_zero2": {("full", False): 1.43e-3, ("full", True): 1.25e-3,
            ("lora", False): 1.43e-3, ("lora", True): 1.27e-3},
    "fsdp1": {("full", False): 1.98e-3, ("full", True): 1.96e-3,
            ("lora", False): 2.57e-3, ("lora", True): 2.69e-3},
    "fsdp1_zero2": {("full", False): 1.92e-3, ("full", True): 1.88e-3,
            ("lora", False): 2.46e-3, ("lora", True): 2.58e-3},
}


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one strategy (grad_accum micro-batches), and where its time goes."""

    step_s: float
    tokens_per_s: float  # the whole job's (every rank's) tokens per second
    bound: str  # compute | host | comm | pcie: what the critical path waits on
    compute_s: float  # per GPU, per step
    comm_s: float  # collectives, per step
    pcie_s: float  # host <-> device copies and the host optimizer step, per step
    busy_gpus: int
    host_s: float = 0.0  # the host's op dispatch, per step (overlapped with the GPU's work)


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


def backward_layers(shape: ModelShape, w: Workload) -> int:
    """The decoder blocks backward passes through: every one, or under `freeze` those from the top down to the
    lowest that trains (backward stops below it)."""
    return shape.layers - min(w.trained_blocks(shape.layers)) if w.method == "freeze" else shape.layers


def autocasts(w: Workload) -> bool:
    """Whether `w`'s step runs under 16-bit autocast (which the op counts are keyed by)."""
    return w.precision in ("bf16", "fp16") and not w.pure_16bit


def step_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward + backward + recomputation FLOPs per token of one micro-batch."""
    lin, _ = linear_flops_per_token(shape)
    attn = attention_flops_per_token(shape, w)
    lora = lora_flops_per_token(shape, w)
    head = 2.0 * shape.hidden * shape.vocab
    index = indexer_flops_per_token(shape, w)
    block_fwd = lin + attn + lora + index
    weights_train = w.method == "full"
    lin_bwd = lin * (2 if weights_train else 1)
    attn_bwd = attn * (FLASH_BWD if w.attention != "eager" else 2)
    block_bwd = lin_bwd + attn_bwd + 2 * lora
    if w.grad_ckpt == "full":
        recompute = block_fwd
    elif w.grad_ckpt == "selective":
        recompute = (lin + lora) / 2
    else:
        recompute = 0.0
    layers_bwd = backward_layers(shape, w)
    head_bwd = head * (2 if weights_train else 1)
    return shape.layers * block_fwd + head + layers_bwd * (block_bwd + recompute) + head_bwd


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


def _layer_ops(w: Workload, ckpt: bool) -> tuple[float, float, float]:
    """(kernels, views, matmuls) of one decoder layer for `w` with or without full checkpointing."""
    autocast = autocasts(w)
    if w.method == "full":
        return tuple(float(x) for x in LAYER_OPS[("full", ckpt, autocast)])
    # LoRA's ops grow by the same amount per adapted linear (the 7- and 2-target counts give the step); `freeze`
    # runs the frozen base with no adapters: the step taken back to zero targets.
    n = 0 if w.method == "freeze" else len(w.lora_targets) if w.lora_targets is not None else 7
    two, seven = LAYER_OPS[("lora2", ckpt, autocast)], LAYER_OPS[("lora7", ckpt, autocast)]
    k, v, m = (a + (n - 2) * (b - a) / 5 for a, b in zip(two, seven, strict=True))
    if w.lora_dropout > 0:
        k += n * DROPOUT_OPS[ckpt]
    if w.method == "qlora":  # each 4-bit weight dequantized per use: forward, backward, recomputation
        dk, dv, _ = dequant_per_use(w)
        k += 7 * (3 if ckpt else 2) * dk
        v += 7 * (3 if ckpt else 2) * dv
    return k, v, m


def dispatch_ops_per_layer(w: Workload) -> tuple[float, float]:
    """(kernel launches, views) the host dispatches for one decoder layer of one micro-batch of `w`: measured
    counts (LAYER_OPS) by method, LoRA targets and dropout, checkpointing (selective: half of full's
    recomputation) and autocast; compiled, about two kernels per matmul (one fused kernel beside each) and no
    views."""
    if w.grad_ckpt == "selective":
        k, v, m = ((a + b) / 2 for a, b in zip(_layer_ops(w, False), _layer_ops(w, True), strict=True))
    else:
        k, v, m = _layer_ops(w, w.grad_ckpt == "full")
    return (2 * m, 0.0) if w.compile else (k, v)


def host_dispatch_s(shape: ModelShape, w: Workload) -> float:
    """Seconds the host spends launching one micro-batch's ops (a GPU step cannot be shorter)."""
    k, v = dispatch_ops_per_layer(w)
    kernels = shape.layers * k + FIXED_OPS[0]
    views = shape.layers * v + (0 if w.compile else FIXED_OPS[1])
    if shape.linear_layers and w.delta_rule == "torch":
        dk, dv = delta_rule_chunk_ops(w)
        kernels += shape.linear_layers * dk
        views += shape.linear_layers * dv
    if w.loss == "chunked" and w.loss_chunk:  # every position labelled: the most chunks a micro-batch can have
        extra = max(0, -(-w.tokens // w.loss_chunk) - 1)
        autocast = autocasts(w)
        ck, cv = LOSS_CHUNK_OPS[(w.method == "full", autocast)]
        kernels += extra * ck
        views += extra * cv
    return kernels * DISPATCH_KERNEL_S + views * DISPATCH_VIEW_S


def delta_rule_chunk_ops(w: Workload, *, forward_only: bool = False) -> tuple[float, float]:
    """(kernels, views) the torch Gated DeltaNet's chunk loop adds to one DeltaNet block of one micro-batch: each
    row's `ceil(row_len / DELTA_CHUNK)` chunks (the rows of a micro-batch run side by side), forward and backward,
    and the forward again where checkpointing recomputes the block (selective checkpointing too: it keeps only
    `mm`s, and the loop's products are `bmm`s); `forward_only`: the forward alone (a reference's)."""
    (fk, fv), (sk, sv) = DELTA_CHUNK_OPS[autocasts(w)]
    chunks = -(-w.row_len // DELTA_CHUNK)
    if forward_only:
        return chunks * fk, chunks * fv
    again = w.grad_ckpt != "none"
    return chunks * (sk + (fk if again else 0)), chunks * (sv + (fv if again else 0))


def by_checkpointing(w: Workload, at: Callable[[bool], float]) -> float:
    """`at(full checkpointing?)` for `w`'s checkpointing; selective checkpointing half-way between none and full
    (it recomputes about half of what full checkpointing does)."""
    return (at(False) + at(True)) / 2 if w.grad_ckpt == "selective" else at(w.grad_ckpt == "full")


def engine_host_s(shape: ModelShape, w: Workload, s: strategies.Strategy) -> float:
    """Host seconds the data-parallel engine of strategy `s` adds to one micro-batch of `w` (ENGINE_HOST_S per
    block); 0 for one GPU and for model_parallel."""
    if s.engine == "ddp":
        engine = "ddp"
    elif s.engine == "fsdp2":
        engine = ("fsdp1" if w.fsdp1 else "fsdp2") + ("" if s.reshard_after_forward else "_zero2")
    else:
        return 0.0
    kind = "full" if w.method == "full" else "lora"
    table = ENGINE_HOST_S[engine]
    return shape.layers * by_checkpointing(w, lambda ckpt: table[(kind, ckpt)])


def _elementwise_coef(w: Workload, ckpt: bool, side: str) -> tuple[float, ...]:
    """ELEMENTWISE_BYTES's coefficients for `w` with or without full checkpointing. LoRA's bytes grow with each
    adapted linear (its scaling, the add onto the base's output, their backward): the step from the frozen base to
    seven targets, taken per target; `freeze` is the base with none."""
    full = ELEMENTWISE_BYTES[("full", ckpt)][side]
    if w.method == "full":
        return full
    n = 0 if w.method == "freeze" else len(w.lora_targets) if w.lora_targets is not None else 7
    lora = ELEMENTWISE_BYTES[("lora7", ckpt)][side]
    return tuple(a + n * (b - a) / 7 for a, b in zip(full, lora, strict=True))


def elementwise_bytes_per_token(shape: ModelShape, w: Workload, side: str) -> float:
    """Bytes the non-matmul kernels of one decoder layer move per token of a micro-batch of `w`, `side` eager or
    compiled: counted in bf16 (twice as many in fp32), selective checkpointing half of full's recomputation."""
    width = (shape.hidden, shape.mean_active_mlp_width(), shape.heads * shape.hd, shape.kv_heads * shape.hd)

    def at(ckpt: bool) -> float:
        return sum(c * x for c, x in zip(_elementwise_coef(w, ckpt, side), width, strict=True))

    return by_checkpointing(w, at) * compute_bytes(w) / 2


def elementwise_bytes_per_micro_batch(shape: ModelShape, w: Workload, side: str) -> float:
    """Bytes every non-matmul kernel of one micro-batch of `w` moves, `side` eager or compiled: each decoder
    layer's (`elementwise_bytes_per_token`, twice as many in fp32) and the rest of the model's (REST_BYTES:
    embedding, final norm, the logits' passes through the loss) as counted in bf16 whatever the precision: the loss
    runs in fp32 either way, and an fp32 model saves the casts to and from it about as much as its wider norm
    costs."""
    tokens = w.tokens
    vt, ht, vh, t = REST_BYTES["full" if w.method == "full" else "lora"][side]
    rest = vt * shape.vocab * tokens + ht * shape.hidden * tokens + vh * shape.vocab * shape.hidden + t * tokens
    return shape.layers * tokens * elementwise_bytes_per_token(shape, w, side) + rest


def fused_bytes_saved(shape: ModelShape, w: Workload) -> float:
    """Bytes per micro-batch that torch.compile's fused kernels do not move where eager kernels would: every layer's
    eager minus compiled elementwise bytes; 0 for an eager run."""
    if not w.compile:
        return 0.0
    saved = elementwise_bytes_per_token(shape, w, "eager") - elementwise_bytes_per_token(shape, w, "compiled")
    return shape.layers * w.tokens * max(0.0, saved)


def _ring(n: int, nbytes: float, bw: float, latency: float, calls: int, all_reduce: bool = False) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2 * (n - 1) / n if all_reduce else (n - 1) / n
    return factor * nbytes / bw + calls * latency * (2 if all_reduce else 1) * (n - 1)


def _bus(card: Card, hw: Hardware) -> float:
    """The ring's bus bandwidth. Across nodes NCCL runs one ring per NIC, each ring carrying its share of the
    buffer over its own NIC, so the crossing between two nodes runs at the node's whole network bandwidth."""
    return card.link if hw.nodes == 1 else min(card.link, card.nic * hw.gpus_per_node)


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


def _qlora_dequant_bytes(shape: ModelShape, w: Workload) -> float:
    """Per micro-batch: the bytes every 4-bit linear weight's dequantizations move (`dequant_per_use`), as memory-bound
    traffic; the same per weight whatever the tokens, so it weighs most on short micro-batches."""
    return dequant_uses(w) * shape.decoder_linear_params() * dequant_per_use(w)[2]


def param_bytes_16(shape: ModelShape, w: Workload) -> float:
    """What FSDP2 all-gathers: the parameters in the compute dtype (QLoRA: the packed 4-bit data and scales)."""
    p = shape.params()
    if w.method == "qlora":
        linear = shape.decoder_linear_params()
        return linear * (0.5 + 0.127 / 8) + (p - linear) * compute_bytes(w)
    return p * compute_bytes(w)


def param_bytes_stored(shape: ModelShape, w: Workload) -> float:
    """The parameters as their shards are stored (offload copies these): fp32 masters for a full fine-tune."""
    return shape.params() * 4.0 if w.method == "full" else param_bytes_16(shape, w)


@dataclass(frozen=True)
class Exposure:
    """What of a sharded engine's traffic runs after, not beside, the compute (see `exposed_collectives`)."""

    gathers: int = 0  # all-gathers per micro-batch that the compute waits for in full
    reduce_scatter: bool = False  # the gradients' reduce-scatter is waited for in full
    host: bool = False  # the host's launches do not overlap the GPU either
    per_tensor: bool = False  # one collective per parameter tensor, not per wrapped block


def exposed_collectives(w: Workload, reshard_after_forward: bool) -> Exposure:
    """Where the engine that ran `w` cannot overlap its collectives with compute, from the engines' code:

    - DeepSpeed ZeRO-3 before v0.6.0 (`zero3_sync_fetch`): fetch_sub_module, "This call is blocking", all-gathers
      each submodule's parameters and calls _synchronize_communication(), which ends in torch.cuda.synchronize();
      a prefetch runs torch.cuda.synchronize() before each parameter's all-gather, one dist.all_gather per tensor
      (deepspeed/runtime/zero/stage3.py and partition_parameters.py at v0.5.8; the same code at the autotuning
      merge, 9caa74e5). The device synchronize waits for the reduction stream as well. So compute, the host's
      launches, every all-gather and the reduce-scatter take turns. PR #1453 (v0.6.0) lists what it changed:
      "batching allgather calls to amortize fixed overhead", "more fine grained synchronization".
    - FSDP1 with LoRA under use_orig_params=False (`flat_params`, FULL_SHARD): a flat parameter holds only frozen or
      only trainable weights, so the adapters are FSDP units of their own inside each block (Answer.AI's train.py
      get_wrapping_policy: every leaf whose weight requires grad). Forward: FSDP1 has no forward prefetch by
      default, and limit_all_gathers' rate limiter makes the host wait, before each all-gather, for the free of the
      unit two frees back (torch/distributed/fsdp/_runtime_utils.py `_unshard`, _limiter_utils.py, at most 2 in
      flight); the adapters free after their forward too, so the next block's all-gather is issued only when the
      current block's last adapters have run. Backward: BACKWARD_PRE prefetches the unit before the current one
      in post-forward order (_exec_order_utils.py `get_handle_to_backward_prefetch`), which for a block is its own
      last adapter; the previous block is prefetched only from the block's first adapter, at the end of its
      backward. Both all-gathers of a micro-batch are waited for.
    - FSDP1 with backward_prefetch=None (`fsdp1_no_backward_prefetch`, FULL_SHARD): "This has no overlap"
      (torch.distributed.fsdp.BackwardPrefetch): collectives of one process group share one NCCL stream, and the
      next unit's all-gather is issued after the current unit's reduce-scatter, which waits for its gradients.
      The backward all-gather and the reduce-scatter are waited for; the forward still overlaps (the host runs
      ahead).
    Otherwise (FSDP2, FSDP1 with its default prefetch over blocks) nothing is exposed beyond what the overlap
    itself leaves."""
    if not reshard_after_forward:  # ZeRO-2, SHARD_GRAD_OP: none of the three (the forward's gather overlaps)
        return Exposure()
    if w.zero3_sync_fetch:
        return Exposure(2, True, True, True)
    if w.flat_params and w.trains_adapters:
        return Exposure(2)
    if w.fsdp1_no_backward_prefetch:
        return Exposure(1, True)
    return Exposure()


def collective_calls(shape: ModelShape, w: Workload, exposed: Exposure) -> int:
    """Collectives per all-gather or reduce-scatter of the whole model: one per wrapped block and one for the rest;
    under FSDP1 with LoRA and flat parameters also one per adapter matrix (each LoRA A and B its own unit, as in
    `exposed_collectives`); one per parameter tensor where the engine gathers tensor by tensor."""
    if exposed.per_tensor:
        return param_tensors(shape)
    adapters = 0
    if w.flat_params and w.trains_adapters:
        adapters = 2 * (len(w.lora_targets) if w.lora_targets is not None else len(LORA_TARGETS))
    return shape.layers * (1 + adapters) + 1


def param_tensors(shape: ModelShape) -> int:
    """Parameter tensors of the model: each linear weight and two norms per block, the embedding (and an untied
    head), the final norm. Biases, where a model has them, are not counted."""
    def per_block(moe: bool) -> int:  # fused expert weights are two tensors per block, not two per expert
        named = shape.named_linears(moe)
        return sum(not n.startswith("expert_") for n, _, _ in named) + (2 if moe else 0) + 2

    return int(shape.over_blocks(per_block)) + (1 if shape.tied else 2) + 1


def step_time(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> StepTime:
    """Predicted time of one optimizer step of `strategy` and the job's tokens/s."""
    s = strategies.get(strategy)
    card = card_of(hw)
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    gpu = micro_batch_work(shape, w, card, s)
    n = hw.world if s.multi_rank else 1
    if s.engine == "plain" or n == 1 and s.engine != "device_map":
        t = _one_rank(shape, w, card, s, gpu)
    elif s.engine == "ddp":
        t = _ddp(shape, w, card, hw, gpu, n)
    elif s.engine == "fsdp2":
        t = _fsdp(shape, w, card, hw, s, gpu, n)
    else:
        t = _model_parallel(shape, w, card, hw, gpu)
    tokens = w.tokens
    ulysses = ulysses_s(shape, w, card, hw)  # on the critical path: attention waits for it
    if experts.applies(w, shape, s.engine, s.offload):  # the experts wait for their tokens
        ulysses += experts.all_to_all_s(shape, w, card, hw, compute_bytes(w))
    step = w.grad_accum * (t.micro + ulysses) + t.comm_step + t.pcie_step + t.optim_gpu
    job_tokens = tokens * w.grad_accum * (t.ranks if s.multi_rank else 1)
    comm_total = w.grad_accum * (t.comm_mb + ulysses) + t.comm_step
    pcie_total = w.grad_accum * t.pcie_mb + t.pcie_step
    compute_total = w.grad_accum * gpu.compute + t.optim_gpu
    host_total = w.grad_accum * gpu.host
    parts = (("compute", compute_total), ("host", host_total), ("comm", comm_total), ("pcie", pcie_total))
    bound = max(parts, key=lambda kv: kv[1])[0]
    return StepTime(step, job_tokens / step, bound, compute_total, comm_total, pcie_total, t.busy, host_total)


def stage_sync_s(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> tuple[float, float, float]:
    """A pipeline stage's collectives over its data-parallel ranks (`hw`: those ranks; `shape`: the stage's part
    of the model), as torch's PipelineStage runs the strategy: gradient sync and resharding after backward are off
    until the step's last backward (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`), then the
    gradients are reduced once (`perform_reduce_grad`). Returns seconds of (all-gathers per micro-batch, all-gathers
    per step, the gradients' reduction per step): DDP all-reduces the fp32 gradients once a step; FSDP2
    reduce-scatters them once a step and all-gathers the 16-bit parameters once a step (zero2: kept from the first
    forward on) or once a micro-batch (zero3: freed after each forward, gathered again for backward and kept), each
    prefetched under the compute."""
    s = strategies.get(strategy)
    n = hw.world
    if not s.multi_rank or n == 1:
        return 0.0, 0.0, 0.0
    card = card_of(hw)
    bus = _bus(card, hw)
    grads = trainable_params(shape, w) * 4.0
    if s.engine == "ddp":
        calls = max(1, round(grads / DDP_BUCKET_BYTES))
        return 0.0, 0.0, _ring(n, grads, bus, card.latency_s, calls, all_reduce=True)
    units = shape.layers + 1  # a unit per block and the stage's root
    gather = _ring(n, param_bytes_16(shape, w), bus, card.latency_s, units)
    reduce = _ring(n, grads, bus, card.latency_s, units)
    return (gather, 0.0, reduce) if s.reshard_after_forward else (0.0, gather, reduce)


def ulysses_s(shape: ModelShape, w: Workload, card: Card, hw: Hardware) -> float:
    """Sequence parallelism's all-to-alls in one micro-batch: per block, q, k, v and the attention output in
    forward and their gradients in backward (and the forward's again where checkpointing recomputes the block),
    each moving (N-1)/N of a rank's tensor, over the GPUs' links while the SP group sits in one node."""
    n = w.sequence_parallel
    if n == 1:
        return 0.0
    q = shape.heads * shape.hd
    kv = shape.kv_heads * shape.hd if shape.kv_heads % n == 0 else q
    per_block = w.tokens * compute_bytes(w) * (2 * q + 2 * kv)
    passes = 3 if w.grad_ckpt != "none" else 2
    bw = card.link if n <= hw.gpus_per_node else min(card.link, card.nic * hw.gpus_per_node)
    return shape.layers * passes * _ring(n, per_block, bw, card.latency_s, 4)


@dataclass(frozen=True)
class GpuWork:
    """One GPU's work on one micro-batch, in seconds: its kernels (`compute`), the host's launches (`host`,
    overlapped with them), and the slower of the two plus the device's idle at the host's waits (`busy`)."""

    compute: float
    host: float
    stall: float = 0.0  # the device idle at the host's waits for it (`host_sync_s`), overlapping neither

    @property
    def busy(self) -> float:
        return max(self.compute, self.host) + self.stall


def micro_batch_work(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy) -> GpuWork:
    """The FLOPs at the training utilization (which holds the step's own elementwise work), the head gradient's
    fp32 matmul where it is one, and QLoRA's dequantization, which the runs behind that utilization did not do;
    the host's dispatch, and the waits for the device that stall both."""
    tokens = w.tokens
    flops = step_flops_per_token(shape, w) * tokens
    dequant = _qlora_dequant_bytes(shape, w) / card.hbm
    fp8 = float8_s(shape, w, card, card.matmul_eff)
    compute = flops / card.peak(w.precision) + dequant + head_gradient_s(shape, w, card, card.hfu) + fp8
    if w.compile:  # fused elementwise kernels: the bytes they no longer move
        compute -= fused_bytes_saved(shape, w) / card.hbm
    # Never faster than its kernels one after another: the matmuls at the card's GEMM efficiency and every other
    # kernel's bytes at the memory bandwidth. A small model's step has more of the second than the large-model runs
    # behind the training utilization held. Not on a CPU: its rate is the machine's measured matmul, and its memory
    # bandwidth a generic figure, not the datasheet's a GPU has.
    if card.key != "cpu":
        matmuls = flops / (card.dense_flops(w.precision) * card.matmul_eff) + \
            head_gradient_s(shape, w, card, card.matmul_eff) + fp8
        side = "compiled" if w.compile else "eager"
        compute = max(compute, matmuls + dequant + elementwise_bytes_per_micro_batch(shape, w, side) / card.hbm)
    # On a GPU the host launches the ops while the device runs earlier ones: the slower of the two sets the pace.
    # On a CPU the ops run on the host itself, inside the measured rates.
    host = host_dispatch_s(shape, w) + engine_host_s(shape, w, s) if card.key != "cpu" else 0.0
    if w.reference == "adapters_off":  # the reference's forward without gradients runs inside every micro-batch
        ref = reference_work(shape, w, card, s)
        compute, host = compute + ref.compute, host + ref.host
    return GpuWork(compute, host, host_sync_s(w, card))


def head_gradient_flops(shape: ModelShape, w: Workload) -> float:
    """FLOPs per micro-batch of the trained head's weight gradient (2 h V per labelled position, every position at
    the most) where it runs as an fp32 matmul; 0 where it runs at the 16-bit rate like the other matmuls.

    shardfit's chunked loss (train/loss.py `_LinearCrossEntropy`) multiplies each chunk's 16-bit softmax gradient by
    its 16-bit hidden states into the fp32 gradient (addmm with out_dtype) where the device has that kernel: CUDA
    with a torch that has the overload (`head_grad_fp32` False); elsewhere it widens both operands to fp32 for an
    fp32 matmul: a CPU always, a GPU under an older torch. Only where the head trains (a full fine-tune) in a
    16-bit run with shardfit's loss: an fp32 run's matmuls are all fp32 in its rate already, and the other losses
    leave the head's gradient to autocast (16-bit)."""
    if w.method != "full" or w.loss != "chunked" or w.precision not in ("bf16", "fp16"):
        return 0.0
    return 2.0 * shape.hidden * shape.vocab * w.tokens


def head_gradient_s(shape: ModelShape, w: Workload, card: Card, eff: float) -> float:
    """The head-gradient term: seconds per micro-batch the head's weight gradient takes beyond what the 16-bit
    matmul rate (at efficiency `eff`) counted for it, where it is an fp32 matmul (`head_gradient_flops`): at the
    card's fp32 matmul rate (TF32 where the card has it: shardfit sets TF32 for a 16-bit GPU run,
    parallel/env.py `fast_fp32_matmuls`; the fp32 rate on cards without, and on a CPU, where it can also be the
    faster one). Before the 16-bit kernel this matmul made a Qwen2.5-0.5B full fine-tune's step 23-46 % longer on
    an H100 without TF32 (issue 45's study)."""
    widened = card.key != "cpu" and not w.head_grad_fp32
    flops = 0.0 if widened else head_gradient_flops(shape, w)
    if flops == 0.0:
        return 0.0
    return flops / (card.fp32_matmul_flops() * eff) - flops / (card.dense_flops(w.precision) * eff)


# What one wait for the device costs a GPU micro-batch beyond its work: the device runs dry, the host wakes from the
# synchronize (a tiny kernel followed by a synchronize: 4.7-7.1 us, JuliaGPU/CUDA.jl#896) and launches the next op
# (DISPATCH_KERNEL_S) before the device has anything to run.
HOST_SYNC_S = 7e-6 + DISPATCH_KERNEL_S


def host_sync_s(w: Workload, card: Card) -> float:
    """The syncs term: seconds per micro-batch the device idles at the host's waits for it (`w.host_syncs`, each
    HOST_SYNC_S), which neither the GPU's work nor the host's launches overlap. The lower bound: a wait also stops
    the host from running ahead, so launches after it that it could have hidden behind earlier kernels are not
    hidden any more. 0 on a CPU (its host is the device) and on shardfit's path (no wait in a step,
    tests/test_host_syncs.py)."""
    return 0.0 if card.key == "cpu" else w.host_syncs * HOST_SYNC_S


def reference_flops_per_token(shape: ModelShape, w: Workload) -> float:
    """Forward FLOPs per token of the reference model: every block's linear layers and attention (no adapters: they
    are switched off) and the head. No backward and no recomputation: it runs without gradients."""
    lin, _ = linear_flops_per_token(shape)
    return shape.layers * (lin + attention_flops_per_token(shape, w) + indexer_flops_per_token(shape, w)) + \
        2.0 * shape.hidden * shape.vocab


def reference_work(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy) -> GpuWork:
    """One forward without gradients over a micro-batch's rows, as the reference runs it (DPO and KTO): its FLOPs
    at the training utilization, QLoRA's dequantization of each weight once more; on a GPU no faster than its
    matmuls plus its non-matmul bytes (the frozen base's forward part, FWD_SHARE of a step without recomputation:
    a `freeze` workload without checkpointing is that base, no adapters), and the host's launches
    (REFERENCE_LAYER_OPS, and the forward of the torch Gated DeltaNet's chunk loop, DELTA_CHUNK_OPS) with the
    forward's share of the engine's per-block work."""
    flops = reference_flops_per_token(shape, w) * w.tokens
    dequant = shape.decoder_linear_params() * dequant_per_use(w)[2] / card.hbm
    compute = flops / card.peak(w.precision) + dequant
    if card.key == "cpu":  # the measured CPU rate holds the ops; the host is the device
        return GpuWork(compute, 0.0)
    side = "compiled" if w.compile else "eager"
    base = replace(w, method="freeze", grad_ckpt="none")
    matmuls = flops / (card.dense_flops(w.precision) * card.matmul_eff)
    compute = max(compute, matmuls + dequant + FWD_SHARE * elementwise_bytes_per_micro_batch(shape, base, side)
                  / card.hbm)
    autocast = autocasts(w)
    (k, v), (fk, fv) = REFERENCE_LAYER_OPS[autocast], REFERENCE_FIXED_OPS[autocast]
    dk, dv, _ = dequant_per_use(w)  # each 4-bit weight dequantized once more for the reference's forward
    k, v = k + 7 * dk, v + 7 * dv
    if w.compile:  # compiled blocks: about two kernels per matmul (8 per layer), no views
        k, v = 16, 0
    ops = (shape.layers * k + fk) * DISPATCH_KERNEL_S + (shape.layers * v + fv) * DISPATCH_VIEW_S
    if shape.linear_layers and w.delta_rule == "torch":  # the fallback's chunk loop, forward only
        ck, cv = delta_rule_chunk_ops(w, forward_only=True)
        ops += shape.linear_layers * (ck * DISPATCH_KERNEL_S + cv * DISPATCH_VIEW_S)
    return GpuWork(compute, ops + FWD_SHARE * engine_host_s(shape, w, s))


def reference_pass_s(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> float | None:
    """Seconds the whole job's reference pass takes per example, where the reference is precomputed: one forward
    without gradients over every example once before the first step, each rank taking every world-th micro-batch
    (a sharded strategy all-gathers the parameters for each, offload copies them in first); None otherwise."""
    if w.reference != "precomputed":
        return None
    s = strategies.get(strategy)
    card = card_of(hw)
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    n = hw.world if s.multi_rank else 1
    busy = reference_work(shape, w, card, s).busy
    if s.engine == "fsdp2" and s.reshard_after_forward and n > 1:  # ZeRO-2 keeps its first gather
        gather = _ring(n, param_bytes_16(shape, w), _bus(card, hw), card.latency_s, shape.layers + 1)
        copy = param_bytes_stored(shape, w) / n / card.pcie if s.offload else 0.0
        busy = max(busy, gather + copy)
    elif s.engine == "device_map":
        busy += (hw.gpus_per_node - 1) * w.tokens * shape.hidden * compute_bytes(w) / card.pcie
    return busy / w.micro_batch / n


@dataclass
class Traffic:
    """What an engine adds to each micro-batch's GPU work, in seconds: the micro-batch as it runs (`micro`), its
    collectives and PCIe copies (overlapped or not, as the engine does), and per optimizer step the collectives and
    copies after the last micro-batch and the optimizer step on the GPU; `busy` GPUs, `ranks` that each take their
    own micro-batches."""

    micro: float
    comm_mb: float = 0.0
    pcie_mb: float = 0.0
    comm_step: float = 0.0
    pcie_step: float = 0.0
    optim_gpu: float = 0.0
    busy: int = 1
    ranks: int = 1


def _adam_on_gpu(shape: ModelShape, w: Workload, card: Card) -> float:
    return trainable_params(shape, w) * ADAM_BYTES_PER_PARAM / card.hbm


def _one_rank(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy, gpu: GpuWork) -> Traffic:
    """One process on one GPU; an offloading one still streams its shards through PCIe."""
    t = Traffic(gpu.busy, optim_gpu=_adam_on_gpu(shape, w, card))
    if s.sharded and s.offload:
        trainable = trainable_params(shape, w)
        t.pcie_mb = 2 * param_bytes_stored(shape, w) / card.pcie
        t.micro = max(gpu.busy, t.pcie_mb)
        t.pcie_step = trainable * 4.0 / card.pcie + trainable * ADAM_BYTES_PER_PARAM / HOST_ADAM_BYTES_PER_S
        t.optim_gpu = 0.0
    return t


def _ddp(shape: ModelShape, w: Workload, card: Card, hw: Hardware, gpu: GpuWork, n: int) -> Traffic:
    """DDP all-reduces the fp32 gradients once per step, overlapped with the last micro-batch's backward."""
    grads = trainable_params(shape, w) * 4.0
    ar = _ring(n, grads, _bus(card, hw), card.latency_s, max(1, round(grads / DDP_BUCKET_BYTES)), all_reduce=True)
    return Traffic(gpu.busy, comm_step=max(0.0, ar - gpu.compute * (1 - FWD_SHARE)),
                   optim_gpu=_adam_on_gpu(shape, w, card), busy=n, ranks=n)


def _fsdp(shape: ModelShape, w: Workload, card: Card, hw: Hardware, s: strategies.Strategy, gpu: GpuWork,
          n: int) -> Traffic:
    """FSDP2: all-gathers of the 16-bit parameters (once or twice per micro-batch), the gradients'
    reduce-scatter, offload's copies; prefetched, so they overlap the compute except what the engine that ran
    `w` waits for (`exposed_collectives`)."""
    t_params = trainable_params(shape, w)
    # expert_parallel: the routed experts stay whole on their ranks, neither gathered nor reduce-scattered
    kept = experts.routed_expert_params(shape) if experts.applies(w, shape, s.engine, s.offload) else 0
    grads = (t_params - (kept if w.method == "full" else 0)) * 4.0  # fp32 gradients (FSDP2's reduce_dtype)
    bus = _bus(card, hw)
    # ZeRO-3 gathers each block for the forward and again for backward, and for the reference's forward where it
    # runs inside the micro-batch; ZeRO-2 keeps them gathered after the first forward (FSDP2's reshard() returns
    # early without reshard_after_forward), so the policy's forward gathers nothing more.
    gathers = (2 + (w.reference == "adapters_off")) if s.reshard_after_forward else 1
    exposed = exposed_collectives(w, s.reshard_after_forward)
    calls = collective_calls(shape, w, exposed)
    comm_mb = gathers * _ring(n, param_bytes_16(shape, w) - kept * compute_bytes(w), bus, card.latency_s, calls)
    pcie_mb = gathers * param_bytes_stored(shape, w) / n / card.pcie if s.offload else 0.0
    # The gradients' reduce-scatter: every micro-batch (FSDP2 and FSDP1 by default, shardfit's own runs), so
    # that each rank only ever holds its shard (offload: copied to the host each time); once per optimizer
    # step under FSDP1's no_sync().
    per_micro_batch = not w.fsdp1_no_sync
    rs = _ring(n, grads, bus, card.latency_s, calls)
    rs_mb = rs if per_micro_batch else 0.0
    grads_d2h = grads / n / card.pcie if s.offload else 0.0
    if per_micro_batch:
        pcie_mb += grads_d2h
    # FSDP2 prefetches the next unit's all-gather (its H2D copy first) while the current one computes; what the
    # engine that ran `w` waits for in full (`exposed_collectives`) is added after.
    hidden = (gathers - exposed.gathers) / gathers
    gpu_side = gpu.compute + gpu.host + gpu.stall if exposed.host else gpu.busy
    rs_exposed = rs_mb if exposed.reduce_scatter else 0.0
    overlapped = hidden * (comm_mb + pcie_mb) + rs_mb - rs_exposed
    t = Traffic(max(gpu_side, overlapped) + (1 - hidden) * (comm_mb + pcie_mb) + rs_exposed, comm_mb + rs_mb,
                pcie_mb, busy=n, ranks=n)
    if not per_micro_batch:
        t.comm_step = rs if exposed.reduce_scatter else max(0.0, rs - gpu.compute * (1 - FWD_SHARE))
    if s.offload:
        t.pcie_step = (0.0 if per_micro_batch else grads_d2h) + t_params / n * ADAM_BYTES_PER_PARAM / \
            HOST_ADAM_BYTES_PER_S
    else:
        t.optim_gpu = _adam_on_gpu(shape, w, card) / n
    return t


def _model_parallel(shape: ModelShape, w: Workload, card: Card, hw: Hardware, gpu: GpuWork) -> Traffic:
    """The stages run one after another; between them the hidden states cross a link."""
    g = hw.gpus_per_node
    tokens = w.tokens
    # forward and backward cross every boundary; the reference's forward (adapters_off) crosses them once more
    hops = (2 + (w.reference == "adapters_off")) * (g - 1) * tokens * shape.hidden * compute_bytes(w)
    comm_mb = hops / card.pcie
    return Traffic(gpu.busy + comm_mb, comm_mb, optim_gpu=_adam_on_gpu(shape, w, card), busy=g, ranks=1)
