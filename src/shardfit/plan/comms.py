"""What each engine moves over its links and PCIe per micro-batch and step, and how much of it the compute
hides.

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

Sequence parallelism's all-to-alls (`ulysses_s`) and a pipeline stage's data-parallel collectives
(`stage_sync_s`) are counted here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit import strategy as strategies
from shardfit.plan import experts
from shardfit.plan.cards import Card, card_of
from shardfit.plan.dequant import quantized_linear_params
from shardfit.plan.dispatch import GpuWork
from shardfit.plan.estimate import state_bytes, trainable_params, trainable_weight_bytes
from shardfit.plan.hardware import Hardware
from shardfit.plan.optimizer_states import step_bytes_per_param
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.weight_bytes import nf4_linear_bytes
from shardfit.plan.workload import LORA_TARGETS, Workload

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
# torch's AdamW on the CPU (offload) streams weights, gradients and both moments at host memory speed: read 16 and
# write 12 bytes per fp32 parameter; 10 GB/s is a conservative share of one socket's DRAM bandwidth for the
# foreach/for-loop kernels torch runs there (no DeepSpeed CPUAdam).
HOST_ADAM_BYTES_PER_S = 10e9
ADAM_BYTES_PER_PARAM = 28  # AdamW's: plan/optimizer_states.py `step_bytes_per_param` for the workload's optimizer
FWD_SHARE = 1 / 3  # the forward pass's part of a micro-batch, for what overlaps with forward-only traffic


def ring_s(n: int, nbytes: float, bw: float, latency: float, calls: int, all_reduce: bool = False) -> float:
    """Seconds of a ring collective over `n` ranks moving `nbytes` per rank at bus bandwidth `bw` in `calls`
    collectives: all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n, and each call's
    `latency` per hop."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2 * (n - 1) / n if all_reduce else (n - 1) / n
    return factor * nbytes / bw + calls * latency * (2 if all_reduce else 1) * (n - 1)


def bus_bandwidth(card: Card, hw: Hardware) -> float:
    """The ring's bus bandwidth. Across nodes NCCL runs one ring per NIC, each ring carrying its share of the
    buffer over its own NIC, so the crossing between two nodes runs at the node's whole network bandwidth."""
    return card.link if hw.nodes == 1 else min(card.link, card.nic * hw.gpus_per_node)


def param_bytes_16(shape: ModelShape, w: Workload) -> float:
    """What FSDP2 all-gathers: the parameters in the compute dtype (QLoRA: the weights stored in 4 bits as
    stored, packed codes and block scales, plan/estimate.py `nf4_linear_bytes`, the memory's rule)."""
    return _params_bytes(shape, w, compute_bytes(w))


def param_bytes_stored(shape: ModelShape, w: Workload) -> float:
    """The model's parameters as their shards are stored (offload copies these), as the memory counts them
    (plan/estimate.py `state_bytes`): fp32 masters for a full fine-tune (16-bit under `pure_16bit`); a freeze run's
    trained blocks in their dtype; QLoRA's 4-bit weights as stored (`nf4_linear_bytes`); every frozen weight outside
    them as stored (plan/precision.py `frozen_weight_bytes`: fp32 where peft's prepare_model_for_kbit_training upcast
    it, `frozen_fp32`, for LoRA as for QLoRA). Adapters and peft's trained copies, not the model's own weights, are
    left out. FSDP casts a shard to the compute dtype after copying it to the GPU, so the copy moves the stored
    bytes (`param_bytes_16` is the gather's)."""
    weights = state_bytes(shape, w)[0]
    return weights - trainable_weight_bytes(shape, w) if w.trains_adapters else weights


def _params_bytes(shape: ModelShape, w: Workload, other: int) -> float:
    """Every parameter, QLoRA's 4-bit weights as stored (`nf4_linear_bytes`) and the others at `other` bytes."""
    linear = quantized_linear_params(shape, w) if w.method == "qlora" else 0
    return nf4_linear_bytes(shape, w) + (shape.params() - linear) * other


def param_tensors(shape: ModelShape) -> int:
    """Parameter tensors of the model: each linear weight and two norms per block, the embedding (and an untied
    head), the final norm. Biases, where a model has them, are not counted."""
    def per_block(moe: bool) -> int:  # fused expert weights are two tensors per block, not two per expert
        named = shape.named_linears(moe)
        return sum(not n.startswith("expert_") for n, _, _ in named) + (2 if moe else 0) + 2

    return int(shape.over_blocks(per_block)) + (1 if shape.tied else 2) + 1


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
    return trainable_params(shape, w) * step_bytes_per_param(w) / card.hbm


def _one_rank(shape: ModelShape, w: Workload, card: Card, s: strategies.Strategy, gpu: GpuWork) -> Traffic:
    """One process on one GPU; an offloading one still streams its shards through PCIe."""
    t = Traffic(gpu.busy, optim_gpu=_adam_on_gpu(shape, w, card))
    if s.sharded and s.offload:
        trainable = trainable_params(shape, w)
        t.pcie_mb = 2 * param_bytes_stored(shape, w) / card.pcie
        t.micro = max(gpu.busy, t.pcie_mb)
        t.pcie_step = trainable * 4.0 / card.pcie + trainable * step_bytes_per_param(w) / HOST_ADAM_BYTES_PER_S
        t.optim_gpu = 0.0
    return t


def _ddp(shape: ModelShape, w: Workload, card: Card, hw: Hardware, gpu: GpuWork, n: int) -> Traffic:
    """DDP all-reduces the fp32 gradients once per step, overlapped with the last micro-batch's backward."""
    grads = trainable_params(shape, w) * 4.0
    calls = max(1, round(grads / DDP_BUCKET_BYTES))
    ar = ring_s(n, grads, bus_bandwidth(card, hw), card.latency_s, calls, all_reduce=True)
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
    bus = bus_bandwidth(card, hw)
    # ZeRO-3 gathers each block for the forward and again for backward, and for the reference's forward where it
    # runs inside the micro-batch; ZeRO-2 keeps them gathered after the first forward (FSDP2's reshard() returns
    # early without reshard_after_forward), so the policy's forward gathers nothing more.
    gathers = (2 + (w.reference == "adapters_off")) if s.reshard_after_forward else 1
    exposed = exposed_collectives(w, s.reshard_after_forward)
    calls = collective_calls(shape, w, exposed)
    comm_mb = gathers * ring_s(n, param_bytes_16(shape, w) - kept * compute_bytes(w), bus, card.latency_s, calls)
    pcie_mb = gathers * param_bytes_stored(shape, w) / n / card.pcie if s.offload else 0.0
    # The gradients' reduce-scatter: every micro-batch (FSDP2 and FSDP1 by default, shardfit's own runs), so
    # that each rank only ever holds its shard (offload: copied to the host each time); once per optimizer
    # step under FSDP1's no_sync().
    per_micro_batch = not w.fsdp1_no_sync
    rs = ring_s(n, grads, bus, card.latency_s, calls)
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
        t.pcie_step = (0.0 if per_micro_batch else grads_d2h) + t_params / n * step_bytes_per_param(w) / \
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


def traffic(shape: ModelShape, w: Workload, card: Card, hw: Hardware, s: strategies.Strategy, gpu: GpuWork,
            n: int) -> Traffic:
    """What strategy `s`'s engine adds to each micro-batch's GPU work `gpu` over its `n` ranks: one process alone
    (or one rank), DDP, FSDP2 (ZeRO-2/3, offload), or model_parallel's stages in turn."""
    if s.engine == "plain" or n == 1 and s.engine != "device_map":
        return _one_rank(shape, w, card, s, gpu)
    if s.engine == "ddp":
        return _ddp(shape, w, card, hw, gpu, n)
    if s.engine == "fsdp2":
        return _fsdp(shape, w, card, hw, s, gpu, n)
    return _model_parallel(shape, w, card, hw, gpu)


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
    bus = bus_bandwidth(card, hw)
    grads = trainable_params(shape, w) * 4.0
    if s.engine == "ddp":
        calls = max(1, round(grads / DDP_BUCKET_BYTES))
        return 0.0, 0.0, ring_s(n, grads, bus, card.latency_s, calls, all_reduce=True)
    units = shape.layers + 1  # a unit per block and the stage's root
    gather = ring_s(n, param_bytes_16(shape, w), bus, card.latency_s, units)
    reduce = ring_s(n, grads, bus, card.latency_s, units)
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
    return shape.layers * passes * ring_s(n, per_block, bw, card.latency_s, 4)
