"""The host's side of a GPU micro-batch: the ops it dispatches, the engine's own Python around them, and the
device's idle at the host's waits.

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
launches about two kernels per matmul and no views. LAYER_OPS were counted under SDPA: eager attention launches
its ops on the scores instead of SDPA's kernel (`eager_attention_ops`), recomputed under selective checkpointing
as under full.

The engine's own host work: DDP's reducer runs a hook per parameter as its gradient is ready; FSDP runs Python
around every wrapped block (all-gather copy-in and copy-out, resharding, the reduce-scatter's copies; FSDP1 with
use_orig_params=True also re-points every original parameter at the unsharded flat parameter and back). That
work sits between the launches on the same host thread, so it adds to the host's time per micro-batch. Measured
per block by bench/fsdp_host_overhead.py (ENGINE_HOST_S below): forward + backward of tiny Llama models of 4 and
8 blocks in one gloo process, plain and under each engine, the difference per extra block; about 1.5 ms for
FSDP2, 2-2.7 ms for FSDP1, 0.1-0.2 ms for DDP, against about 1 ms for a plain block's own ops. Host time on the
development machine's CPU (a Python-bound cost). Only the blocks' wrapping is counted: FSDP1's adapter units
(`flat_params`) are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardfit import strategy as strategies
from shardfit.plan.cards import Card
from shardfit.plan.dequant import LAYER_WEIGHTS, dequant_per_use, dequantized_weights_per_layer
from shardfit.plan.eager_scores import eager_score_ops, softmax_blocks
from shardfit.plan.flops import fp32_expert_mms, fp32_grouped_mm_calls
from shardfit.plan.model_shape import DELTA_CHUNK
from shardfit.plan.precision import autocast_launches
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

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
# What one wait for the device costs a GPU micro-batch beyond its work: the device runs dry, the host wakes from the
# synchronize (a tiny kernel followed by a synchronize: 4.7-7.1 us, JuliaGPU/CUDA.jl#896) and launches the next op
# (DISPATCH_KERNEL_S) before the device has anything to run.
HOST_SYNC_S = 7e-6 + DISPATCH_KERNEL_S


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


def by_checkpointing(w: Workload, at: Callable[[bool], float]) -> float:
    """`at(full checkpointing?)` for `w`'s checkpointing; selective checkpointing half-way between none and full
    (it recomputes about half of what full checkpointing does)."""
    return (at(False) + at(True)) / 2 if w.grad_ckpt == "selective" else at(w.grad_ckpt == "full")


def _layer_ops(w: Workload, ckpt: bool, dequantized: float, strategy: str) -> tuple[float, float, float]:
    """(kernels, views, matmuls) of one decoder layer for `w` under `strategy` with or without full checkpointing;
    `dequantized`: the layer's 4-bit weights (QLoRA)."""
    autocast = autocast_launches(w, strategy)
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
        k += dequantized * (3 if ckpt else 2) * dk
        v += dequantized * (3 if ckpt else 2) * dv
    return k, v, m


def dispatch_ops_per_layer(w: Workload, dequantized: float = LAYER_WEIGHTS,
                           strategy: str = "single") -> tuple[float, float]:
    """(kernel launches, views) the host dispatches for one decoder layer of one micro-batch of `w`: measured
    counts (LAYER_OPS) by method, LoRA targets and dropout, checkpointing (selective: half of full's
    recomputation) and autocast, and QLoRA's dequantization of each of the layer's `dequantized` 4-bit weights
    (plan/dequant.py `dequantized_weights_per_layer`); compiled, about two kernels per matmul (one fused kernel
    beside each) and no views."""
    if w.grad_ckpt == "selective":
        k, v, m = ((a + b) / 2 for a, b in zip(_layer_ops(w, False, dequantized, strategy),
                                               _layer_ops(w, True, dequantized, strategy),
                                               strict=True))
    else:
        k, v, m = _layer_ops(w, w.grad_ckpt == "full", dequantized, strategy)
    return (2 * m, 0.0) if w.compile else (k, v)


def host_dispatch_s(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """Seconds the host spends launching one micro-batch's ops under `strategy` (a GPU step cannot be shorter)."""
    k, v = dispatch_ops_per_layer(w, dequantized_weights_per_layer(shape, w), strategy)
    kernels = shape.layers * k + FIXED_OPS[0]
    views = shape.layers * v + (0 if w.compile else FIXED_OPS[1])
    if shape.linear_layers and w.delta_rule == "torch":
        dk, dv = delta_rule_chunk_ops(w, strategy)
        kernels += shape.linear_layers * dk
        views += shape.linear_layers * dv
    kernels += fp32_expert_mms(shape, w, strategy)  # the fallbacks' mm per expert
    ek, ev = eager_attention_ops(shape, w, strategy)
    kernels += softmax_blocks(shape) * ek
    views += softmax_blocks(shape) * ev
    if w.loss == "chunked" and w.loss_chunk:  # every position labelled: the most chunks a micro-batch can have
        extra = max(0, -(-w.tokens // w.loss_chunk) - 1)
        autocast = autocast_launches(w, strategy)
        ck, cv = LOSS_CHUNK_OPS[(w.method == "full", autocast)]
        kernels += extra * ck
        views += extra * cv
    return kernels * DISPATCH_KERNEL_S + views * DISPATCH_VIEW_S


# The ops of SDPA's kernel in LAYER_OPS (counted under SDPA): one forward, one backward, and under checkpointing
# one more forward (half of one under selective, whose half-way count takes half of full's recomputation).
SDPA_KERNEL_OPS = {"none": 2.0, "full": 3.0, "selective": 2.5}


def eager_attention_ops(shape: ModelShape, w: Workload, strategy: str = "single", *,
                        forward_only: bool = False) -> tuple[float, float]:
    """(kernels, views) eager attention adds to one softmax block of one micro-batch beyond the SDPA kernel
    LAYER_OPS counted: its ops on the scores (plan/eager_scores.py EAGER_SCORE_OPS), forward and backward, and
    the forward again under full and selective checkpointing alike (the selective policy keeps mm/addmm and the
    SDPA/flash kernels' outputs only, so every eager score op is recomputed, as plan/timing.py `eager_score_bytes`
    charges their bytes); `forward_only`: one forward (a reference's). 0 under SDPA and flash, and compiled (about
    two kernels per matmul already)."""
    if w.attention != "eager" or w.compile:
        return 0.0, 0.0
    fk, fv, bk, bv = eager_score_ops(shape, w, strategy)
    if forward_only:
        return fk - 1.0, float(fv)
    forwards = 2 if w.grad_ckpt != "none" else 1
    return forwards * fk + bk - SDPA_KERNEL_OPS[w.grad_ckpt], float(forwards * fv + bv)


def delta_rule_chunk_ops(w: Workload, strategy: str = "single", *, forward_only: bool = False) -> tuple[float, float]:
    """(kernels, views) the torch Gated DeltaNet's chunk loop adds to one DeltaNet block of one micro-batch: each
    row's `ceil(row_len / DELTA_CHUNK)` chunks (the rows of a micro-batch run side by side), forward and backward,
    and the forward again where checkpointing recomputes the block (selective checkpointing too: it keeps only
    `mm`s, and the loop's products are `bmm`s); `forward_only`: the forward alone (a reference's)."""
    (fk, fv), (sk, sv) = DELTA_CHUNK_OPS[autocast_launches(w, strategy)]
    chunks = -(-w.row_len // DELTA_CHUNK)
    if forward_only:
        return chunks * fk, chunks * fv
    again = w.grad_ckpt != "none"
    return chunks * (sk + (fk if again else 0)), chunks * (sv + (fv if again else 0))


def engine_host_s(shape: ModelShape, w: Workload, s: strategies.Strategy) -> float:
    """Host seconds the data-parallel engine of strategy `s` adds to one micro-batch of `w` (ENGINE_HOST_S per
    block); 0 for one GPU and for model_parallel."""
    if s.engine == "ddp":
        engine = "ddp"
    elif s.engine == "fsdp2":
        engine = ("fsdp1" if w.runs_fsdp1 else "fsdp2") + ("" if s.reshard_after_forward else "_zero2")
    else:
        return 0.0
    kind = "full" if w.method == "full" else "lora"
    table = ENGINE_HOST_S[engine]
    return shape.layers * by_checkpointing(w, lambda ckpt: table[(kind, ckpt)])


def host_sync_s(w: Workload, card: Card, shape: ModelShape, *, forward_only: bool = False,
                strategy: str = "single") -> float:
    """The syncs term: seconds per micro-batch the device idles at the host's waits for it (`w.host_syncs`, and
    one per fp32 grouped matmul of `shape`: `fp32_grouped_mm_calls`, its offsets read back; `forward_only`: a
    reference's forward's alone), each HOST_SYNC_S, which neither the GPU's work nor the host's launches overlap.
    The lower bound: a wait also stops the host from running ahead, so launches after it that it could have hidden
    behind earlier kernels are not hidden any more. 0 on a CPU (its host is the device) and on shardfit's path (no
    wait in a step, tests/test_host_syncs.py)."""
    if card.key == "cpu":
        return 0.0
    fallback = fp32_grouped_mm_calls(shape, w, strategy, forward_only=forward_only)
    return ((0.0 if forward_only else w.host_syncs) + fallback) * HOST_SYNC_S


def reference_dispatch_s(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """Seconds the host spends launching the reference's forward without gradients over one micro-batch (DPO and
    KTO with the adapters switched off): REFERENCE_LAYER_OPS per layer and REFERENCE_FIXED_OPS once, each 4-bit
    weight's dequantization once more, the forward of the torch Gated DeltaNet's chunk loop (DELTA_CHUNK_OPS) and
    of eager attention's score ops (`eager_attention_ops`), under `strategy`."""
    autocast = autocast_launches(w, strategy)
    (k, v), (fk, fv) = REFERENCE_LAYER_OPS[autocast], REFERENCE_FIXED_OPS[autocast]
    dk, dv, _ = dequant_per_use(w)  # each 4-bit weight dequantized once more for the reference's forward
    weights = dequantized_weights_per_layer(shape, w)
    k, v = k + weights * dk, v + weights * dv
    if w.compile:  # compiled blocks: about two kernels per matmul (8 per layer), no views
        k, v = 16, 0
    k_fallback = fp32_expert_mms(shape, w, strategy, forward_only=True)  # an mm per expert
    ek, ev = eager_attention_ops(shape, w, strategy, forward_only=True)
    k_fallback += softmax_blocks(shape) * ek
    ops = (shape.layers * k + fk + k_fallback) * DISPATCH_KERNEL_S + \
        (shape.layers * v + fv + softmax_blocks(shape) * ev) * DISPATCH_VIEW_S
    if shape.linear_layers and w.delta_rule == "torch":  # the fallback's chunk loop, forward only
        ck, cv = delta_rule_chunk_ops(w, strategy, forward_only=True)
        ops += shape.linear_layers * (ck * DISPATCH_KERNEL_S + cv * DISPATCH_VIEW_S)
    return ops
