"""Predicted step time and tokens/s of each strategy: FLOPs at the rate training reaches on the card, and the
bytes each engine moves over its links, overlapped where the engine overlaps.

The recipe of one optimizer step, read top to bottom in `step_time`:
- one GPU's micro-batch (`micro_batch_work`): the forward + backward + recomputation FLOPs per token
  (plan/flops.py) at the fraction of the card's peak that large-model training reaches (hardware FLOPs
  utilization, plan/cards.yaml), which already pays for an eager step's elementwise work (norms, activations,
  rotary, casts; attention's softmax inside SDPA's or flash's kernel); float8's matmuls at the FP8 rate and its
  casts (plan/flops.py `float8_s`); QLoRA's dequantization of every 4-bit weight in every use (plan/dequant.py)
  and eager attention's heads x L x L scores written and read in memory (`eager_score_bytes`), as memory-bound
  traffic at the memory bandwidth; torch.compile's fusion credit and the floor of the kernels in turn (below);
  beside it, the host's launches and the engine's Python (plan/dispatch.py), and DPO/KTO's reference forward where
  it runs inside the micro-batch (`reference_work`);
- the engine's traffic around it (plan/comms.py `traffic`): its collectives and PCIe copies, overlapped with the
  compute as the engine overlaps them, and the optimizer step at the memory bandwidth (28 bytes per trainable
  parameter) or on the host;
- sequence parallelism's and expert parallelism's all-to-alls, on the critical path of every micro-batch;
- once per step, the host's launches of the step itself (clipping, the optimizer, zero_grad: plan/step_ops.py),
  overlapped with the optimizer's kernels, and the wait for the device where the release's clipping makes one.

Three costs of the code itself, each a named term (docs/planning.md): the trained head's weight gradient where
it is an fp32 matmul (`head_gradient_s`), a dense mask's whole square against the causal half of kernels that take
the examples' boundaries (plan/flops.py `attended_positions`), and the device's idle at each host wait
(plan/dispatch.py `host_sync_s`).

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

from dataclasses import dataclass, replace

from shardfit import strategy as strategies
from shardfit.plan import experts
from shardfit.plan.cards import Card, card_of
from shardfit.plan.comms import FWD_SHARE, bus_bandwidth, param_bytes_16, param_bytes_stored, ring_s, traffic, ulysses_s
from shardfit.plan.dequant import dequant_bytes, dequant_per_use, quantized_linear_params
from shardfit.plan.dispatch import (
    GpuWork,
    by_checkpointing,
    engine_host_s,
    host_dispatch_s,
    host_sync_s,
    reference_dispatch_s,
)
from shardfit.plan.eager_scores import (
    ALIBI_CHAIN,
    FP32_QK_CHAIN,
    LLAMA_CHAIN,
    PLAIN_CHAIN,
    SINKS_CHAIN,
    SOFTCAP_CHAIN,
    score_chain,
)
from shardfit.plan.estimate import planned_shape, planned_workload, with_loss_chunk
from shardfit.plan.flops import (
    backward_layers,
    float8_s,
    fp32_experts_s,
    reference_flops_per_token,
    softmax_groups,
    step_flops_per_token,
)
from shardfit.plan.hardware import Hardware
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.step_ops import step_host_s, step_sync_s
from shardfit.plan.workload import Workload


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


def step_time(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> StepTime:
    """Predicted time of one optimizer step of `strategy` and the job's tokens/s."""
    s = strategies.get(strategy)
    card = card_of(hw)
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    gpu = micro_batch_work(shape, w, card, s)
    n = hw.world if s.multi_rank else 1
    t = traffic(shape, w, card, hw, s, gpu, n)
    tokens = w.tokens
    ulysses = ulysses_s(shape, w, card, hw)  # on the critical path: attention waits for it
    if experts.applies(w, shape, s.engine, s.offload):  # the experts wait for their tokens
        ulysses += experts.all_to_all_s(shape, w, card, hw, compute_bytes(w))
    # The step's own launches (clipping, the optimizer, zero_grad: plan/step_ops.py) overlap its own kernels, once
    # per step; a release whose clipping waits for the device adds that wait.
    step_host = step_host_s(shape, w, card)
    boundary = max(t.optim_gpu, step_host) + step_sync_s(shape, w, card)
    step = w.grad_accum * (t.micro + ulysses) + t.comm_step + t.pcie_step + boundary
    job_tokens = tokens * w.grad_accum * (t.ranks if s.multi_rank else 1)
    comm_total = w.grad_accum * (t.comm_mb + ulysses) + t.comm_step
    pcie_total = w.grad_accum * t.pcie_mb + t.pcie_step
    compute_total = w.grad_accum * gpu.compute + t.optim_gpu
    host_total = w.grad_accum * gpu.host + step_host
    parts = (("compute", compute_total), ("host", host_total), ("comm", comm_total), ("pcie", pcie_total))
    bound = max(parts, key=lambda kv: kv[1])[0]
    return StepTime(step, job_tokens / step, bound, compute_total, comm_total, pcie_total, t.busy, host_total)


def micro_batch_work(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy) -> GpuWork:
    """The FLOPs at the training utilization (which holds the step's own elementwise work), the head gradient's
    fp32 matmul where it is one, bitsandbytes' fp32 routed experts (plan/flops.py `fp32_experts_s`), and QLoRA's
    dequantization and eager attention's scores (`eager_score_bytes`), which the runs behind that utilization did
    not do; the host's dispatch, and the waits for the device that stall both."""
    tokens = w.tokens
    flops = step_flops_per_token(shape, w, s.name) * tokens
    dequant = dequant_bytes(shape, w) / card.hbm
    scores = eager_scores_s(shape, w, card)
    fp8 = float8_s(shape, w, card, card.matmul_eff)
    # The fp32 experts at the GEMM efficiency, not the step's utilization: only their matmuls change rate, and
    # hfu's share of non-matmul work would scale with the fp32/16-bit ratio (15x on an H100) if applied to them.
    fp32_experts = fp32_experts_s(shape, w, card, card.matmul_eff, s.name)
    compute = flops / card.peak(w.precision) + dequant + scores + head_gradient_s(shape, w, card, card.hfu) + fp8 + \
        fp32_experts
    if w.compile:  # fused elementwise kernels: the bytes they no longer move
        compute -= fused_bytes_saved(shape, w) / card.hbm
    # Never faster than its kernels one after another: the matmuls at the card's GEMM efficiency and every other
    # kernel's bytes at the memory bandwidth. A small model's step has more of the second than the large-model runs
    # behind the training utilization held. Not on a CPU: its rate is the machine's measured matmul, and its memory
    # bandwidth a generic figure, not the datasheet's a GPU has.
    if card.key != "cpu":
        matmuls = flops / (card.dense_flops(w.precision) * card.matmul_eff) + \
            head_gradient_s(shape, w, card, card.matmul_eff) + fp8 + fp32_experts
        side = "compiled" if w.compile else "eager"
        compute = max(compute, matmuls + dequant + scores +
                      elementwise_bytes_per_micro_batch(shape, w, side) / card.hbm)
    # On a GPU the host launches the ops while the device runs earlier ones: the slower of the two sets the pace.
    # On a CPU the ops run on the host itself, inside the measured rates.
    host = host_dispatch_s(shape, w, s.name) + engine_host_s(shape, w, s) if card.key != "cpu" else 0.0
    if w.reference == "adapters_off":  # the reference's forward without gradients runs inside every micro-batch
        ref = reference_work(shape, w, card, s)
        compute, host = compute + ref.compute, host + ref.host
        return GpuWork(compute, host, host_sync_s(w, card, shape, strategy=s.name) + ref.stall)
    return GpuWork(compute, host, host_sync_s(w, card, shape, strategy=s.name))


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
    card's fp32 matmul rate, TF32 as the run sets it (`Workload.fp32_matmuls_tf32`: on in shardfit's 16-bit GPU
    runs, whose loss this matmul is) where the card has it; the fp32 rate on cards without, and on a CPU, where
    it can also be the faster one). Before the 16-bit kernel this matmul made a Qwen2.5-0.5B full fine-tune's
    step 23-46 % longer on an H100 without TF32 (issue 45's study)."""
    widened = card.key != "cpu" and not w.head_grad_fp32
    flops = 0.0 if widened else head_gradient_flops(shape, w)
    if flops == 0.0:
        return 0.0
    return flops / (card.fp32_matmul_flops(w.fp32_matmuls_tf32) * eff) - flops / (card.dense_flops(w.precision) * eff)


def reference_work(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy) -> GpuWork:
    """One forward without gradients over a micro-batch's rows, as the reference runs it (DPO and KTO): its FLOPs
    at the training utilization, QLoRA's dequantization of each weight once more and eager attention's forward
    scores (`eager_score_bytes`); on a GPU no faster than its matmuls plus those and its non-matmul bytes (the
    frozen base's forward part, FWD_SHARE of a step without recomputation: a `freeze` workload without
    checkpointing is that base, no adapters), and the host's launches (plan/dispatch.py `reference_dispatch_s`)
    with the forward's share of the engine's per-block work."""
    flops = reference_flops_per_token(shape, w) * w.tokens
    dequant = quantized_linear_params(shape, w) * dequant_per_use(w)[2] / card.hbm
    scores = eager_scores_s(shape, w, card, forward_only=True)
    fp32_experts = fp32_experts_s(shape, w, card, card.matmul_eff, s.name, forward_only=True)  # GEMMs: as above
    compute = flops / card.peak(w.precision) + dequant + scores + fp32_experts
    if card.key == "cpu":  # the measured CPU rate holds the ops; the host is the device
        return GpuWork(compute, 0.0)
    side = "compiled" if w.compile else "eager"
    base = replace(w, method="freeze", grad_ckpt="none")
    matmuls = flops / (card.dense_flops(w.precision) * card.matmul_eff) + fp32_experts
    compute = max(compute, matmuls + dequant + scores +
                  FWD_SHARE * elementwise_bytes_per_micro_batch(shape, base, side) / card.hbm)
    return GpuWork(compute, reference_dispatch_s(shape, w, s.name) + FWD_SHARE * engine_host_s(shape, w, s),
                   host_sync_s(w, card, shape, forward_only=True, strategy=s.name))


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
        gather = ring_s(n, param_bytes_16(shape, w), bus_bandwidth(card, hw), card.latency_s, shape.layers + 1)
        copy = param_bytes_stored(shape, w) / n / card.pcie if s.offload else 0.0
        busy = max(busy, gather + copy)
    elif s.engine == "device_map":
        busy += (hw.gpus_per_node - 1) * w.tokens * shape.hidden * compute_bytes(w) / card.pcie
    return busy / w.micro_batch / n


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


# The op chains transformers' eager attention runs on the L x L scores (plan/eager_scores.py `score_chain`) move
# different bytes: Llama's eager_attention_forward (scaling, mask add, softmax upcast to fp32 and cast back; most
# families); gpt-oss's sinks (the sink's column joined, the row maximum subtracted, softmax in the scores' dtype);
# Gemma 2's logit softcapping (div, tanh, mul before the mask); GPT-2's softmax in the scores' dtype (no casts);
# GPT-J's and CodeGen's `_attn` (q and k upcast: fp32 scores from QK^T on, then a div; GPT-Neo's is the same less
# the div); BLOOM's baddbmm (the scaling and ALiBi inside the matmul, then Llama's softmax).
# Bytes eager attention's scores move per head and query-key pair of the L x L square it computes, as (a, m): `a`
# per head and score (each op of the chain on the scores and its gradient), `m` per element of the [rows, 1, L, L]
# mask in the compute dtype, broadcast over the heads; keyed by (chain, full checkpointing, dtype). Counted by
# bench/eager_attention_bytes.py (torch 2.13, transformers 5.23; a tiny model of each chain's family, eager alone,
# whose L^2 coefficients SDPA's kernel does not have; a held-out shape exact; LoRA the same as full) into
# bench/results/eager_attention_bytes.json (`chains`; gpt-oss's bf16 under `eager`). Checkpointing adds one
# forward's bytes. fp16 is counted as bf16 (on CUDA ATen fuses the upcast into the softmax for fp16 alone, which
# this count does not take off). gpt-oss was not counted in fp32: twice its bf16 bytes, as the plain chain's, which
# has no casts either.
# Left out: the score matmuls' own bytes (QK^T's output, PV's read of the probabilities, their gradients': 12 of
# Llama's 68 in bf16, `a_less_matmuls` in the json). Their FLOPs are in the step's FLOPs at the training
# utilization, which already prices a matmul's reads and writes; charging them again here would count them twice.
# Compiled (Llama counted, every chain takes it): inductor keeps QK^T and PV as extern bmm kernels and fuses the
# scaling, the mask (built in the kernel from the positions: none read) and the softmax with its casts between
# them: 26 bytes a score, 14 without the matmuls' 12; under checkpointing its count is no polynomial in the sizes,
# so one compiled forward (16, 4 of them the matmuls') is added as eager's counts add one; fp32 twice bf16's (the
# fused kernel reads and writes the same tensors, each twice as wide). SDPA and flash keep the scores on chip, so
# neither ELEMENTWISE_BYTES (counted under SDPA) nor the training utilization holds these bytes.
_COMPILED = {(False, "bf16"): (14.0, 0.0), (True, "bf16"): (26.0, 0.0), (False, "fp32"): (28.0, 0.0),
             (True, "fp32"): (52.0, 0.0)}
_EAGER = {
    (LLAMA_CHAIN, False, "bf16"): (56.0, 2.0), (LLAMA_CHAIN, True, "bf16"): (84.0, 4.0),
    (LLAMA_CHAIN, False, "fp32"): (44.0, 4.0), (LLAMA_CHAIN, True, "fp32"): (68.0, 8.0),
    (SINKS_CHAIN, False, "bf16"): (54.0, 2.0), (SINKS_CHAIN, True, "bf16"): (76.0, 4.0),
    (SINKS_CHAIN, False, "fp32"): (108.0, 4.0), (SINKS_CHAIN, True, "fp32"): (152.0, 8.0),
    (SOFTCAP_CHAIN, False, "bf16"): (82.0, 2.0), (SOFTCAP_CHAIN, True, "bf16"): (122.0, 4.0),
    (SOFTCAP_CHAIN, False, "fp32"): (96.0, 4.0), (SOFTCAP_CHAIN, True, "fp32"): (144.0, 8.0),
    (PLAIN_CHAIN, False, "bf16"): (22.0, 2.0), (PLAIN_CHAIN, True, "bf16"): (34.0, 4.0),
    (PLAIN_CHAIN, False, "fp32"): (44.0, 4.0), (PLAIN_CHAIN, True, "fp32"): (68.0, 8.0),
    (FP32_QK_CHAIN, False, "bf16"): (56.0, 2.0), (FP32_QK_CHAIN, True, "bf16"): (86.0, 4.0),
    (FP32_QK_CHAIN, False, "fp32"): (44.0, 4.0), (FP32_QK_CHAIN, True, "fp32"): (68.0, 8.0),
    (ALIBI_CHAIN, False, "bf16"): (48.0, 2.0), (ALIBI_CHAIN, True, "bf16"): (72.0, 4.0),
    (ALIBI_CHAIN, False, "fp32"): (28.0, 4.0), (ALIBI_CHAIN, True, "fp32"): (44.0, 8.0),
}
EAGER_SCORE_BYTES: dict[tuple[str, bool, str], dict[str, tuple[float, float]]] = {
    key: {"eager": bytes_, "compiled": _COMPILED[key[1:]]} for key, bytes_ in _EAGER.items()}


def dropout_bytes_per_score(w: Workload, p: float) -> tuple[float, float]:
    """(forward, backward) bytes per head and score of attention dropout with probability `p` in training; (0, 0)
    at p 0. From the CUDA kernels' reads and writes (aten native_dropout: the probabilities read, the dropped ones
    written in the compute dtype and a 1-byte mask; native_dropout_backward: the gradient and the mask read, the
    gradient written), not counted: a CPU runs dropout as other ops (bernoulli, mul, div) than a GPU does."""
    if p <= 0:
        return 0.0, 0.0
    each = 2.0 * compute_bytes(w) + 1.0
    return each, each


def eager_score_bytes(shape: ModelShape, w: Workload, side: str, *, forward_only: bool = False) -> float:
    """Bytes per micro-batch that eager attention's scores move, `side` eager or compiled; 0 under SDPA and flash.
    Every softmax block (plan/flops.py `softmax_groups`: a window or chunk is a dense mask over the whole row
    under eager) computes heads x row_len scores per token, at EAGER_SCORE_BYTES of its chain (`score_chain`) per
    head and score; the mask is read again for each head (the add walks the heads outermost, and an 8k row's bf16
    mask, 128 MiB, outgrows any L2 cache). The forward's share is what checkpointing adds (one more forward), full
    and selective alike: shardfit's selective policy (models/checkpointing.py) keeps only mm/addmm and the SDPA and
    flash kernels' outputs, so eager's bmm, scaling, mask add, casts and softmax are all recomputed. The backward
    and recomputation run only in the blocks backward reaches. Attention dropout (`ModelShape.attn_dropout`) adds
    its kernels' bytes under eager (`dropout_bytes_per_score`; inductor fuses it into the softmax kernel, not
    counted); the reference's forward runs in training mode, so its dropout too. `forward_only`: one forward
    without gradients (the reference's)."""
    if w.attention != "eager":
        return 0.0
    chain, dtype = score_chain(shape), "fp32" if w.precision == "fp32" else "bf16"
    drop_fwd, drop_bwd = dropout_bytes_per_score(w, shape.attn_dropout) if side == "eager" else (0.0, 0.0)

    def per_score(ckpt: bool) -> float:
        a, m = EAGER_SCORE_BYTES[(chain, ckpt, dtype)][side]
        return a + m + drop_fwd + drop_bwd + (drop_fwd if ckpt else 0.0)

    scores = shape.heads * w.tokens * sum(n * p for n, p in softmax_groups(shape, w))
    forward = per_score(True) - per_score(False)
    if forward_only:
        return scores * forward
    back = backward_layers(shape, w) / shape.layers
    recomputes = w.grad_ckpt in ("full", "selective")
    return scores * (forward + back * (per_score(recomputes) - forward))


def eager_scores_s(shape: ModelShape, w: Workload, card: Card, *, forward_only: bool = False) -> float:
    """Seconds per micro-batch of eager attention's scores (`eager_score_bytes`) at the card's memory bandwidth;
    0 on a CPU, whose measured rate holds every op and whose bandwidth figure is generic."""
    if card.key == "cpu":
        return 0.0
    side = "compiled" if w.compile else "eager"
    return eager_score_bytes(shape, w, side, forward_only=forward_only) / card.hbm
