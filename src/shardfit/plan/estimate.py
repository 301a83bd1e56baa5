"""Analytic per-GPU memory of each strategy for a model shape, workload and hardware.

Bytes per parameter follow from the method and precision; sharding divides what the strategy shards by the world
size; activations follow from the tokens per micro-batch and the layer widths. What fake tensors cannot see on a
real GPU is added last (see `runtime_overhead`):
- CUDA context: 0.3-0.6 GiB per process on recent GPUs (PyTorch "CUDA semantics" notes; measured context sizes in
  pytorch/pytorch#20532 and NVIDIA's CUDA lazy-loading notes); 0.5 GiB is used.
- NCCL: communicator buffers of NCCL_BUFFSIZE (4 MiB default) per channel and peer (NCCL env docs); 0.5 GiB
  covers 8-GPU rings and trees.
- The caching allocator reserves more than it allocates (block rounding, fragmentation), and how much more
  depends on whether the card has room. When a card is full it frees every cached segment it can before it gives
  up, so what decides a fit is the reserve it cannot give back: free pieces of segments still in use.
  ALLOCATOR_RESERVE is that reserve as a fraction of the tensor peak, fitted to 58 public OOM messages of training
  runs; it is its own line (`allocator_reserve`). On a card with room nothing makes the cache give back what it
  freed: a successful run's max_memory_reserved() holds ALLOCATOR_CACHE more than its tensor peak, fitted to 25
  public sources of successful runs not near their card, each counted once. Both: bench/allocator_reserve.yaml and .py.
What the plan predicts, in PyTorch's terms: the tensor columns add up to torch.cuda.max_memory_allocated(); with
`allocator_reserve` to the least max_memory_reserved() the step fits in; `total` (with the CUDA context and NCCL's
buffers in `runtime_overhead`) to the least device memory it fits in, which decides `fits`. What a successful run
READS on a card with room (max_memory_reserved(), or nvidia-smi) is `peak_reading`: the tensors and the cache, at
most what the card leaves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardfit import method as methods
from shardfit import strategy as strategies
from shardfit.config.support import LOSS_CHUNK_MAX_ROWS, loss_chunk_rows
from shardfit.plan import experts, quant
from shardfit.plan.cards import card_of
from shardfit.plan.hardware import Hardware
from shardfit.plan.media import vision_activation_bytes
from shardfit.plan.model_shape import ATTENTION, DELTA_CHUNK, MAMBA, MOE, Block
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import FULL_LOSSES, LORA_TARGETS, Workload

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
NCCL_GIB = 0.5
# The median over those OOM messages of reserved-but-unallocated / (allocated + the failed request), to 0.1 %;
# tests/test_allocator_reserve.py holds it to the data. Quartiles 0.7 % and 6.3 %, and 6.4 % at a failed request of
# 1 GiB or more: a step with a large allocation near its card's limit may need several times this.
ALLOCATOR_RESERVE = 0.017
# The median over sources (each source's median first) of successful training runs' max_memory_reserved() /
# max_memory_allocated() - 1, over the runs not near their card, whose peak the log caught and whose flooring moves
# the ratio by 5 points or less, to 0.1 %; tests/test_allocator_reserve.py holds it to the data. Quartiles 3.8 % and
# 20.9 %: Megatron's pre-training logs keep less (5.8 %), the other sources more (17 %). What the cache holds at the
# peak on a card with room; it decides no verdict.
ALLOCATOR_CACHE = 0.099
# The readings a published peak can be (bench/published_memory.yaml `reading`).
READINGS = ("allocated", "reserved", "total")
# transformers' own causal-LM loss (what the HF Trainer, LLaMA-Factory, axolotl and TRL run) over every position.
# In backward: the saved fp32 log-softmax, its incoming gradient and the gradient it produces, all fp32 (the 16-bit
# logits are gone: the Trainer drops the model output before backward). Measured per logit element with MemTracker
# on a real step (tests/test_plan.py): 12.0 bytes. At the end of the forward pass the 16-bit logits, their fp32
# upcast and the log-softmax are alive at once; transformers 4.46-4.48 also copied the shifted fp32 logits
# (`loss: full_shift`; from 4.49 the labels are shifted instead).
FULL_LOSS_BYTES = 12
# torchtune's CEWithChunkedOutputLoss splits the sequence into this many slices (its `num_output_chunks`).
OUTPUT_CHUNKS = 8


@dataclass
class Breakdown:
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    temporaries: float = 0.0
    # The caching allocator's reserve beyond the tensors that a full card cannot give back (fragmentation):
    # torch.cuda's memory_reserved() less memory_allocated() when the card is full (ALLOCATOR_RESERVE). On a card
    # with room the cache holds more (`peak_reading`), which decides nothing.
    allocator_reserve: float = 0.0
    runtime_overhead: float = 0.0  # the CUDA context and NCCL's buffers: outside the allocator
    total: float = 0.0


@dataclass
class Candidate:
    strategy: str
    fits: bool
    per_gpu_gib: Breakdown
    cpu_gib: float
    estimator: str = "analytic"
    notes: str = ""
    peak_phase: str = "forward"  # where the step peaks: forward (at the loss), backward or optimizer
    # False where the hardware named cannot run the strategy at all (a multi-rank strategy on one device, GPU
    # offload or a split over GPUs on a CPU): the memory columns stay, but it is neither rated nor recommended.
    applies: bool = True
    extra: dict = field(default_factory=dict)
    # The time model's prediction (plan/timing.py): one optimizer step, the job's tokens/s, what bounds it.
    step_s: float | None = None
    tokens_per_s: float | None = None
    bound: str | None = None
    # Where the step's time goes, in seconds per optimizer step (compute_s, comm_s, pcie_s, host_s; parts the
    # engine overlaps overlap): `bound` is the largest.
    time_parts: dict[str, float] | None = None
    # A precomputed reference (DPO, KTO): seconds per training example of the one forward pass over the data that
    # runs once before the first step (the whole job's ranks sharing it); None without one.
    reference_pass_s: float | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["per_gpu_gib"] = {k: round(v, 3) for k, v in d["per_gpu_gib"].items()}
        d["cpu_gib"] = round(d["cpu_gib"], 3)
        d["step_s"] = None if self.step_s is None else round(self.step_s, 4)
        d["tokens_per_s"] = None if self.tokens_per_s is None else round(self.tokens_per_s, 1)
        d["reference_pass_s"] = None if self.reference_pass_s is None else float(f"{self.reference_pass_s:.4g}")
        if self.time_parts is not None:
            d["time_parts"] = {k: round(v, 4) for k, v in self.time_parts.items()}
        d.pop("extra")
        return d


def adapts(name: str, w: Workload) -> bool:
    """Whether LoRA adapts the block's linear layer `name` (ModelShape.named_linears): one of `lora_targets` (all
    of them by default); a mixture's routed experts only with `lora_experts` (all of them with `lora_all_experts`,
    else their fused gate/up weight when `gate` or `up` is a target); never a router. Gated DeltaNet's projections
    (`linear_*`) and a shared experts' gate (`shared_gate`) bear no q_proj...down_proj name, so only all-linear
    (`lora_targets` None) reaches them, as it reaches every nn.Linear but the head and the routers
    (models/experts.py `lora_targets`), less a Mamba mixer's out_proj (`linear_out_proj`), whose base weight the
    fused kernel reads itself (models/adapters.py `mamba_out_projs`)."""
    targets = w.lora_targets or LORA_TARGETS
    if name in ("router", "linear_out_proj") or name.startswith("weight_"):  # bare weights: no module to wrap
        return False
    if name.startswith("linear_") or name == "shared_gate":
        return w.lora_targets is None
    if name.startswith("expert_"):
        parts = name.removeprefix("expert_").split("_")
        return w.lora_experts and (w.lora_all_experts or any(p in targets for p in parts))
    return name in targets


def adapted_shapes(shape: ModelShape, w: Workload, moe: bool | None = None) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one block (the largest kind by default) that LoRA adapts; a fused expert
    weight counts once per expert (peft's target_parameters gives each expert its own rank)."""
    return [(i, o) for name, i, o in shape.named_linears(moe) if adapts(name, w)]


def lora_params(shape: ModelShape, w: Workload) -> int:
    """Adapter parameters of the whole model: rank x (in + out) per adapted layer (each hybrid block's copy of a
    shared block's layers too: ModelShape `shared_linears`)."""
    shared = sum(w.lora_rank * (i + o) for n, i, o in shape.shared_linears + shape.per_layer_model_linears()
                 if adapts(n, w))
    return int(shape.over_blocks(lambda moe: sum(w.lora_rank * (i + o) for i, o in adapted_shapes(shape, w, moe)))
               + shared)


def lora_expert_params(shape: ModelShape, w: Workload) -> int:
    """The adapter parameters on the routed experts (`lora.experts`): the part of `lora_params` expert parallelism
    shares out with the experts."""
    if not w.trains_adapters:
        return 0
    return int(shape.over_blocks(lambda moe: sum(w.lora_rank * (i + o) for n, i, o in shape.named_linears(moe)
                                                 if moe and n.startswith("expert_") and adapts(n, w))))


def trainable_params(shape: ModelShape, w: Workload) -> int:
    if w.trains_adapters:
        tower = shape.audio.lora_params(w.lora_rank) if shape.audio is not None and w.audio_trainable else 0
        return lora_params(shape, w) + tower
    if w.method == "freeze":
        return len(w.trained_blocks(shape.layers)) * shape.layer_params() + shape.hidden  # and the final norm
    return shape.params() - frozen_audio_params(shape, w)


def frozen_audio_params(shape: ModelShape, w: Workload) -> int:
    """The audio tower's weights a full fine-tune leaves frozen: all of them under freeze_audio_tower, else its
    begin/end-of-audio embedding (it serves only the speech output, models/adapters.py)."""
    if shape.audio is None:
        return 0
    return shape.audio.params() if not w.audio_trainable else 2 * shape.audio.out


def state_bytes(shape: ModelShape, w: Workload) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for the whole model, before any sharding."""
    p, t = shape.params(), trainable_params(shape, w)
    low = compute_bytes(w)
    if w.method == "full":
        # fp32 master weights, cast per layer on the fly by autocast/FSDP; or, pure 16-bit, the weights themselves
        weights = p * float(trainable_bytes(w))
    else:
        frozen = p - (t if w.method == "freeze" else 0)
        linear = shape.decoder_linear_params()
        per_other = 4 if w.frozen_fp32 else low
        stored = shape.over_blocks(lambda moe: linear_weight_bytes(shape, w, moe))
        weights = stored + (frozen - linear) * per_other + t * trainable_bytes(w)
        if quantized_head(shape, w):  # the LM head in 4-bit instead of the 16-bit copy counted with the rest
            weights += head_weight_bytes(shape, w) - shape.vocab * shape.hidden * per_other
    grads = t * trainable_bytes(w)
    return weights, grads, t * optimizer_state_bytes(w)


# bitsandbytes' blockwise 8-bit states: one fp32 absmax per block of this many elements, for each of the two states
# (bitsandbytes/optim/optimizer.py `Optimizer2State.init_state`: blocksize 256, `absmax1` and `absmax2`).
BNB_STATE_BLOCK = 256


def optimizer_state_bytes(w: Workload) -> float:
    """Bytes of AdamW's two states per trainable weight. 8-bit AdamW (bitsandbytes'): one byte each and an fp32
    absmax per BNB_STATE_BLOCK elements of each (tensors under its min_8bit_size, 4,096 elements, keep fp32 states:
    norms and biases, not counted apart). torch's AdamW: the weight's own dtype (torch/optim/adamw.py:
    `torch.zeros_like(p)`). bitsandbytes' 32-bit AdamW (`paged_adamw_32bit`, `bnb_optimizer`): fp32 whatever the
    weight's dtype (`Optimizer2State.init_state`: `get_state_buffer(p, dtype=torch.float32)` for optim_bits 32)."""
    if w.optimizer == "adamw8bit":
        return 2.0 * (1 + 4 / BNB_STATE_BLOCK)
    return 2.0 * (4 if w.bnb_optimizer else trainable_bytes(w))


def planned_shape(shape: ModelShape, w: Workload) -> ModelShape:
    """The shape the recipe runs: with `untied_head`, a tied checkpoint's head is a copy of its own."""
    return replace(shape, tied=False) if w.untied_head and shape.tied else shape


def planned_workload(shape: ModelShape, w: Workload) -> Workload:
    """The workload as the rank runs it: `sdpa` (transformers' default) is eager for a class without SDPA
    (attention_layout.py `runs_eager`, the rule models/build.py loads by)."""
    return replace(w, attention="eager") if shape.eager_only and w.attention == "sdpa" else w


def linear_weight_bytes(shape: ModelShape, w: Workload, moe: bool | None = None) -> float:
    """What one decoder block's linear weights take as stored: QLoRA's NF4 (4-bit codes, 8-bit block scales,
    factors per group of scales: 0.5 byte + ~0.127 bit per weight, the QLoRA paper's double quantization, exactly as
    plan/quant.py lays it out; without `double_quant` an fp32 scale per 64 weights) for each linear weight and each
    fused expert stack, the router in the compute precision (never quantized); else the compute precision. Under
    Lightning's BitsandbytesPrecision (`bnb_precision`) every linear layer, one per expert as it counts them."""
    low = compute_bytes(w)
    if w.method == "qlora" and w.bnb_precision:
        return sum(quant.weight_bytes(o, i, low, w.double_quant) for i, o in shape.linear_shapes(moe))
    if w.method == "qlora":
        return sum(r * c * low if name == "router" else quant.weight_bytes(r, c, low, w.double_quant)
                   for name, r, c in shape.stored_weights(moe))
    return sum(i * o for i, o in shape.linear_shapes(moe)) * low


def quantized_head(shape: ModelShape, w: Workload) -> bool:
    """Whether QLoRA stores the LM head in 4-bit: under Lightning's BitsandbytesPrecision every nn.Linear is
    replaced by a bitsandbytes Linear4bit, the head included (lightning/fabric/plugins/precision/bitsandbytes.py
    `module_init_context`, 2.3.0), when the head is a layer of its own (untied)."""
    return w.method == "qlora" and w.bnb_precision and not shape.tied


def head_weight_bytes(shape: ModelShape, w: Workload) -> float:
    """The 4-bit LM head as stored (`quantized_head`)."""
    return float(quant.weight_bytes(shape.vocab, shape.hidden, compute_bytes(w), w.double_quant))


def bnb_dequantize_bytes(numel: int, w: Workload) -> float:
    """What bitsandbytes holds while one Linear4bit weight is dequantized for a matmul under Lightning's
    BitsandbytesPrecision: the plugin quantizes from an fp16 copy (`_Linear4bit.quantize`: weight.to(torch.half)),
    so dequantize_4bit writes the whole weight in fp16 (its quant_state's dtype), and MatMul4Bit casts it to the
    input's dtype before the matmul, forward and backward (bitsandbytes/autograd/_functions.py `MatMul4Bit`,
    0.42.0: F.dequantize_4bit(B, quant_state).to(A.dtype)); the fp16 copy is freed once the cast exists. No index
    tensors: bitsandbytes dequantizes in one CUDA kernel."""
    low = compute_bytes(w)
    return float(numel * (2 + (low if w.precision != "fp16" else 0)))


def block_weight_bytes(shape: ModelShape, w: Workload) -> float:
    """One decoder block's frozen weights as stored (its linear layers and its two norms): what FSDP all-gathers
    for it."""
    return linear_weight_bytes(shape, w) + 2 * shape.hidden * compute_bytes(w)


def dequantize_bytes(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """QLoRA in backward: the most one layer's dequantization holds (plan/quant.py), for the largest NF4 weight of a
    block, and the gradient of that layer's input its LoRA branch has already made (autograd runs the adapter's
    backward first: it was recorded after the base matmul). Each linear layer dequantizes its weight for its matmul
    in forward and again in backward, one at a time."""
    if w.method != "qlora":
        return 0.0
    # A fused expert stack dequantizes whole (models/quantize_experts.py): the largest NF4 weight of a mixture.
    linears = [(i, o) for i, o in shape.linear_shapes() if quant.quantizable(o, i)] if w.bnb_precision else \
        [(c, r) for name, r, c in shape.stored_weights() if name != "router" and quant.quantizable(r, c)]
    if not linears:
        return 0.0
    i, o = max(linears, key=lambda io: (io[0] * io[1], io[0]))
    tokens = w.tokens
    grad_input = compute_bytes(w)
    if w.bnb_precision:
        held = bnb_dequantize_bytes(i * o, w)
    elif w.bnb:  # bitsandbytes' one kernel writes the weight, no index tensors
        held = float(i * o * bnb_dequantized_bytes(w, strategy))
        grad_input = 4 if w.frozen_fp32 and runs_autocast(w, strategy) else grad_input  # the fp32 stream's
    else:
        held = quant.dequantize_peak_bytes(i * o, compute_bytes(w))
    return float(held + tokens * i * grad_input)


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


def no_sync_grad_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The unsharded gradients each rank holds between optimizer steps under FSDP1's no_sync() (`fsdp1_no_sync`,
    with `grad_accum` above 1 on a sharded strategy); 0 otherwise.

    FSDP1's post-backward hook reshards the parameter but, while gradients are not synchronised, returns before
    the reduce-scatter and leaves `.grad` as the unsharded gradient of the whole flat parameter, which the next
    micro-batch's backward accumulates into (torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`: "if
    not state._sync_gradients: ... return"; `_finalize_params`: ".grad remains the unsharded gradient from prior
    no_sync() iterations", pytorch/pytorch@00ae0bc9). Lightning Fabric's `no_backward_sync` under FSDP is
    `module.no_sync()` (src/lightning/fabric/strategies/fsdp.py `_FSDPBackwardSyncControl`). The gradient has the
    unsharded flat parameter's size and dtype, the dtype the forward ran in (MixedPrecision's param_dtype, or the
    weights' own under bf16-true). A flat parameter gets a gradient when any of its weights trains: a full
    fine-tune's every weight; LoRA's adapters alone when they are flat parameters of their own
    (use_orig_params=False, `flat_params`), else the whole wrapped block that holds them (use_orig_params=True
    flattens a block's frozen and trainable weights together)."""
    if not (w.fsdp1_no_sync and w.grad_accum > 1 and strategies.get(strategy).sharded):
        return 0.0
    low = compute_bytes(w)
    if w.method == "full":
        return float(shape.params() * low)
    if w.trains_adapters and not w.flat_params:
        blocks = shape.over_blocks(lambda moe: linear_weight_bytes(shape, w, moe) + 2 * shape.hidden * low)
        return float(blocks + lora_params(shape, w) * low)
    return float(trainable_params(shape, w) * trainable_bytes(w))


def qlora_shard_problem(shape: ModelShape, w: Workload, world: int) -> str | None:
    """Why QLoRA's NF4 weights of `shape` cannot be split into `world` row shards (what the check rule
    qlora_shard_layout refuses before training), or None."""
    if w.method != "qlora":
        return None
    for name, r, c in shape.stored_weights():
        problem = quant.shard_problem(r, c, world) if name != "router" else None
        if problem:
            return f"a {r}x{c} weight: {problem}"
    return None


def compute_bytes(w: Workload) -> int:
    """Bytes per element in the compute precision: 2 for bf16 and fp16, 4 for fp32."""
    return 4 if w.precision == "fp32" else 2


def trainable_bytes(w: Workload) -> int:
    """Bytes per element of the trainable weights and their gradients: fp32, except 16-bit LoRA adapters and
    pure 16-bit training (every weight in the compute precision)."""
    if w.pure_16bit or (w.adapters_16bit and w.trains_adapters):
        return compute_bytes(w)
    return 4


def casts_fp32_trainables(w: Workload, strategy: str) -> bool:
    """Autocast runs over fp32 trainable weights (a full fine-tune's masters, fp32 adapters), so it makes 16-bit
    copies of their inputs and of the weights themselves; 16-bit adapters need none."""
    return runs_autocast(w, strategy) and trainable_bytes(w) == 4


def casts_trainable_inputs(w: Workload, strategy: str) -> bool:
    """Autocast keeps a 16-bit copy of the inputs of the fp32 trainables' matmuls: a full fine-tune's (the fp32
    residual stream into each projection), and fp32 adapters' where peft first casts their input to fp32
    (`adapter_input_casts`); without that cast an adapter reads the base layer's 16-bit input, which autocast
    leaves as it is."""
    return casts_fp32_trainables(w, strategy) and (not w.trains_adapters or w.adapter_input_casts)


def runs_autocast(w: Workload, strategy: str) -> bool:
    """Low precision through autocast; FSDP strategies cast the parameters instead (MixedPrecisionPolicy), and
    pure 16-bit training has nothing to cast."""
    return w.precision != "fp32" and strategies.get(strategy).autocast and not w.pure_16bit


def autocast_fp32_master(w: Workload, strategy: str) -> bool:
    """Full fine-tunes keep fp32 weights, cast by autocast on the fly unless FSDP casts them."""
    return w.method == "full" and runs_autocast(w, strategy)


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
        return shape.over_blocks(lambda kind: part_activation_bytes_per_token(shape, w, strategy, kind)) / \
            shape.layers
    a = compute_bytes(w)
    hidden_16 = 6 if casts_trainable_inputs(w, strategy) else 2
    if hidden_16 == 6 and w.method != "full" and shape.moe_layers and not shape.every_expert:
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
    if w.compile:
        return 2 * residual_bytes(w, strategy) * h + 2 * 4 + a * (2 * h + q) + attn + 3 * a * mlp + lora
    return norms + hidden_16 * a * h + attn + latent_attention_bytes_per_token(shape, w, strategy) + \
        mlp_activation_bytes_per_token(shape, w, strategy) + lora


def lora_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str, kind: Block | None = None) -> float:
    """What a block's adapters save per token (`block_activation_bytes_per_token`): of the largest kind of block,
    or of `kind`."""
    if not w.trains_adapters:
        return 0.0
    a = compute_bytes(w)
    adapted = adapted_shapes(shape, w, kind)
    lora = len(adapted) * a * w.lora_rank
    if w.lora_dropout > 0:
        dropped = a if runs_autocast(w, strategy) and not w.adapter_input_casts else trainable_bytes(w)
        lora += sum((dropped + 1) * i for i, _ in adapted)
    return lora


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
        mixed = mamba_saved_bytes_per_token(shape, w)
    elif kind.part == MOE:
        mixed = moe_saved_bytes_per_token(shape, w, strategy)
    else:
        mixed = 2 * a * shape.intermediate
    return norm + hidden_16 * a * h + mixed + lora_saved_bytes_per_token(shape, w, strategy, kind)


def mamba_saved_bytes_per_token(shape: ModelShape, w: Workload) -> float:
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
    - `a I`: out_proj's input.
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
    # product with its weight and dt once more; out_proj's input for it or its adapter.
    trained = 8 * inner + 4 * heads if w.method == "full" else 0
    gate = 32 * inner if shape.mamba_gated_norm else 18 * inner
    return trained + a * inner + 2 * a * shape.mamba_conv_channels + 16 * heads * chunk + 20 * heads * state + \
        gate + 8 * heads * state * shape.mamba_head_dim / chunk + 2 * a * heads + 20 * heads + norm


def paired_mamba_bytes_per_token(shape: ModelShape, w: Workload, strategy: str = "single") -> float:
    """What a Mamba hybrid's block that pairs a Mamba mixer with its MLP (ModelShape `mamba_mixers`: Jamba, Bamba,
    Falcon-H1, IBM Granite 4.0) saves per token for its token mixing, where an attention block saves softmax
    attention's tensors: the Mamba-2 mixer as Nemotron-H's (`mamba_saved_bytes_per_token`: the same reference
    scan, or mamba_ssm's fused kernel), Jamba's Mamba-1 mixer `mamba1_saved_bytes_per_token`; Falcon-H1's
    (`mamba_parallel`) both, side by side. Measured with saved-tensor hooks on each family's tiny model
    (tests/test_plan_mamba_hybrid.py)."""
    mixer = mamba1_saved_bytes_per_token(shape, w) if shape.mamba_v1 else mamba_saved_bytes_per_token(shape, w)
    return mixer + (softmax_attention_bytes_per_token(shape, w, strategy) if shape.mamba_parallel else 0.0)


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
    if w.attention == "eager" and shape.attention_sinks:
        # gpt-oss's eager attention: the softmax runs in the scores' dtype, which the additive mask sets (the
        # residual stream's), over seq_len + 1 columns (the sink's), keeping its output, the int64 index of each
        # row's max it subtracted first and, where that dtype is not the compute dtype, the probabilities' cast;
        # q and k/v repeated to every head, and not the probabilities' product with v (its matmul keeps inputs).
        r = residual_bytes(w, strategy)
        attn = a * 3 * q + shape.heads * ((w.row_len + 1) * r + (w.row_len * a if r != a else 0) + 8)
    elif w.attention == "eager":
        # Eager attention keeps its fp32 softmax and the 16-bit probabilities (seq_len per head and token), and
        # k/v repeated to every head for the matmuls, instead of SDPA's output and log-sum-exp (no s^2 scores).
        attn = a * (2 * q + 2 * q) + shape.heads * w.row_len * (4 + a)
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
    if shape.single_part:
        return max(block_activation_bytes_per_token(shape, w, strategy, part=kind) for _, kind in shape.block_kinds())
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
    act, product); a mixture's block `moe_saved_bytes_per_token`."""
    dense = (2 if shape.two_matrix else 4) * compute_bytes(w) * shape.intermediate
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
    e = 4 if autocast_fp32_master(w, strategy) and not shape.every_expert else a
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


def lora_expert_copy_bytes(shape: ModelShape, w: Workload) -> float:
    """LoRA on the routed experts (peft `target_parameters`): every forward of a mixture's block makes the merged
    weights W + B A of all its experts (one baddbmm per fused weight, in the frozen weights' dtype), which the
    grouped matmuls save for their backward: a copy of the block's expert weights, kept until that block's backward."""
    if not (w.trains_adapters and w.lora_experts and shape.moe_layers):
        return 0.0
    weights = sum(i * o for name, i, o in shape.named_linears(True) if name.startswith("expert_") and adapts(name, w))
    return weights * compute_bytes(w)


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


def activation_bytes(shape: ModelShape, w: Workload, layers: int, strategy: str = "single") -> float:
    """Saved activations of `layers` blocks for one micro-batch, as backward finds them (the recomputed block of
    checkpointing included).

    With checkpointing only each block's input stays (fp32 when autocast runs over fp32 master weights), with
    what selective checkpointing keeps besides, and one block is recomputed at a time during backward. Autocast
    also keeps the 16-bit copy of every weight it cast until backward has used it (`weight_cast_bytes`)."""
    tokens = w.tokens
    cast = weight_cast_bytes(shape, w, strategy)
    copies = lora_expert_copy_bytes(shape, w) + router_copy_bytes(shape, w, strategy)
    if w.grad_ckpt != "none":
        # Checkpointed blocks keep nothing else, not even their weight casts: only the recomputed block has them.
        kept = checkpointed_block_bytes_per_token(shape, w, strategy)
        recomputed = largest_block_activation_bytes_per_token(shape, w, strategy)
        return tokens * (layers * kept + recomputed + recompute_cast_bytes_per_token(shape, w, strategy)) + cast + \
            copies + held_mask_bytes(w, strategy)
    per_block = block_activation_bytes_per_token(shape, w, strategy)
    return tokens * layers * per_block + layers * cast + layers * copies * shape.moe_layers / shape.layers


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


def recompute_cast_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The recomputed block's largest transient, per token, where peft casts each fp32 adapter's input to fp32
    (`adapter_input_casts` under autocast): the fp32 copy of the widest adapted input (down_proj's, the MLP's
    width), alive while the recomputation has made the rest of the block's saved tensors (peft/tuners/lora/layer.py
    `Linear.forward`: `x = self._cast_input_dtype(x, lora_A.weight.dtype)`; autocast then keeps only its 16-bit
    cast). Traced with MemTracker on an HF-style step (tests/test_plan_long_lora.py): the backward's peak is that
    cast's op. 0 otherwise."""
    if not (w.trains_adapters and casts_trainable_inputs(w, strategy)):
        return 0.0
    return 4.0 * max((i for i, _ in adapted_shapes(shape, w)), default=0)


def held_mask_bytes(w: Workload, strategy: str) -> float:
    """The mask transformers builds once per forward ([batch, seq, seq]: bool for SDPA, additive in the residual
    dtype for eager; one row of micro_batch x seq_len under static_shape). Checkpointed blocks keep it as an input
    until their backward; without checkpointing it is gone once the body returns (SDPA's per-block copies are
    counted with the blocks)."""
    if w.grad_ckpt == "none" or w.attention == "flash" or w.sequence_parallel > 1:  # Ulysses: a mask per block
        return 0.0
    rows = 1 if w.static_shape else w.rows
    return rows * w.row_len**2 * (1 if w.attention == "sdpa" else residual_bytes(w, strategy))


def residual_bytes(w: Workload, strategy: str) -> int:
    """Bytes per element of the residual stream: fp32 when autocast runs over an fp32 embedding (fp32 master
    weights, or `frozen_fp32`): the embedding output is fp32 and every residual add keeps it so; else the compute
    precision."""
    fp32_embedding = runs_autocast(w, strategy) and (w.method == "full" or w.frozen_fp32)
    return 4 if fp32_embedding else compute_bytes(w)


def forward_activation_bytes(shape: ModelShape, w: Workload, layers: int, strategy: str,
                             phase: str = "forward") -> float:
    """What the body holds when the loss runs (`phase` forward) or takes its gradient (backward), for one
    micro-batch.

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
    cast = 2 * shape.decoder_params() * layers / shape.layers if autocast_fp32_master(w, strategy) else 0
    if w.trains_adapters and casts_fp32_trainables(w, strategy):
        cast += 2 * lora_params(shape, w) * layers / shape.layers
    if w.grad_ckpt == "none":  # checkpointed blocks save nothing in forward
        cast += (lora_expert_copy_bytes(shape, w) + router_copy_bytes(shape, w, strategy)) * layers * \
            shape.moe_layers / shape.layers
    if phase == "backward" and w.grad_ckpt != "none":
        cast = 0
    return tokens * (layers * per_block + head) + cast + held_mask_bytes(w, strategy) + all_to_all_bytes(shape, w)


def all_to_all_bytes(shape: ModelShape, w: Workload) -> float:
    """Sequence parallelism's all-to-all buffers, one block's at a time: the send and receive copies of q, k and v
    (k/v repeated to every head where the SP size does not divide them), counted at the forward's peak."""
    n = w.sequence_parallel
    if n == 1:
        return 0.0
    q = shape.heads * shape.hd
    kv = shape.kv_heads * shape.hd if shape.kv_heads % n == 0 else q
    return 2.0 * w.tokens * compute_bytes(w) * (q + 2 * kv)


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


def loss_chunk_for(setting: int | str, vocab: int, hw: Hardware, precision: str) -> int:
    """Rows per chunk of the chunked loss: `loss_chunk` as set, or `auto` for `vocab` on `hw`'s card."""
    return loss_chunk_rows(setting, vocab, card_of(hw).compute_bound_rows(precision))


def with_loss_chunk(shape: ModelShape, w: Workload, hw: Hardware) -> Workload:
    """`w` with the rows of its chunked loss decided as a run on `hw` decides `loss_chunk: auto`."""
    if w.loss_chunk:
        return w
    return replace(w, loss_chunk=loss_chunk_for("auto", shape.vocab, hw, w.precision))


def estimate(shape: ModelShape, w: Workload, hw: Hardware, strategy: str) -> Candidate:
    """Per-GPU peak memory of `strategy` (the most loaded GPU) and whether it fits.

    The step is estimated at its three candidate peaks: the loss at the end of the forward pass (all saved
    activations and the loss's buffers), backward (gradients filling while activations are released) and the
    optimizer step (gradients, states and the multi-tensor update's temporary). The largest is the peak, and its
    breakdown is the one reported, so the columns add up to what is allocated at one moment."""
    shape = planned_shape(shape, w)
    w = with_loss_chunk(shape, planned_workload(shape, w), hw)
    s = strategies.get(strategy)
    rank = per_rank(shape, w, hw, s)
    moments = step_moments(shape, w, strategy, rank)
    phase = max(moments, key=lambda k: _tensors(moments[k]))
    b = in_gib(moments[phase])
    add_runtime_overhead(b, hw, strategy)
    fits, notes = _verdict(shape, w, hw, s, b, rank.cpu)
    not_here = not_applicable(s, hw)  # a row the hardware named cannot run at all says why instead
    return Candidate(strategy, fits, b, rank.cpu / GIB, peak_phase=phase, notes=not_here or notes,
                     applies=not not_here)


@dataclass
class PerRank:
    """What one rank holds under a strategy, in bytes: its part of the model states, what it keeps in host RAM
    (offload), the blocks whose activations its GPU saves, and the strategy's transient buffers."""

    weights: float
    grads: float
    optimizer: float
    cpu: float = 0.0
    layers: int = 0
    foreach: float = 0.0  # the multi-tensor AdamW's copy of what this rank steps (`foreach_temp_bytes`)
    fwd_temp: float = 0.0
    bwd_temp: float = 0.0
    persistent_grads: bool = False  # DDP's gradient buckets live for the whole run
    grad_divisor: float = 1  # how many ways the gradients are split


def per_rank(shape: ModelShape, w: Workload, hw: Hardware, s: strategies.Strategy) -> PerRank:
    """The model states one rank holds under `s`, and the buffers its engine adds around each block."""
    n = hw.world
    weights, grads, optim = state_bytes(shape, w)
    t_all = trainable_params(shape, w)
    low = compute_bytes(w)
    # expert_parallel: the routed experts, 1/N of them on each rank and outside the strategy (plan/experts.py)
    ep = experts.applies(w, shape, s.engine, s.offload)
    stored = trainable_bytes(w) if w.method == "full" else low
    ex = experts.expert_states(shape, w, stored, trainable_bytes(w), lora_expert_params(shape, w)) if ep \
        else (0.0, 0.0, 0.0)
    weights, grads, optim = weights - ex[0], grads - ex[1], optim - ex[2]
    layer_16 = block_weight_bytes(shape, w) if w.method != "full" else shape.layer_params() * low
    if ep:  # FSDP2 gathers a block without its routed experts
        layer_16 -= experts.per_block_params(shape) * low
    root_16 = (shape.embed_params() + shape.hidden) * low
    own_embedding_16 = 0 if shape.tied else shape.vocab * shape.hidden * low
    # FSDP1 runs wrap the decoder blocks only (Lightning's {Block}, accelerate's TRANSFORMER_BASED_WRAP), so an
    # untied input embedding is in the root unit, which FSDP1 never frees after forward (torch/distributed/fsdp/
    # _runtime_utils.py `_post_forward_reshard`: "Do not free the root's parameters in the post-forward for
    # FULL_SHARD"; the root's pre-backward unshard then finds it gathered): held from the first forward to the
    # root's post-backward reshard, once (FSDP1 gathers into the flat parameter itself). Forward adds it to
    # FSDP2's layout, which frees the embedding unit after it runs; backward already counts one embedding (FSDP2
    # gathers its unit again for its gradient), which under FSDP1 is this same copy.
    embedding_in_root = own_embedding_16 if w.fsdp1 else 0
    # Unsharded gradients of one block before its reduce-scatter: only trainable weights have them.
    layer_grads = shape.layer_params() * low if w.method == "full" else t_all / shape.layers * trainable_bytes(w)
    if ep and w.method == "full":
        layer_grads -= experts.per_block_params(shape) * low
    r = PerRank(0.0, 0.0, 0.0, layers=shape.layers)
    if s.engine in ("plain", "ddp"):
        div_w = div_g = div_o = 1
        r.persistent_grads = s.engine == "ddp" and n > 1
    elif s.sharded and not s.shards_params:  # zero2
        div_w, div_g, div_o = 1, n, n
        r.bwd_temp = layer_grads
        r.foreach = foreach_temp_bytes(t_all, w) / n
    elif s.sharded:  # zero3, zero3_offload
        div_w = div_g = div_o = n
        # FSDP2 keeps the root unit (head, final norm) unsharded for the whole step, and the last block's
        # all-gather buffer is still allocated at the loss (measured with FSDPMemTracker, plan --simulate). An
        # untied input embedding is a unit of its own (parallel/parallelize.py), freed right after it runs.
        r.fwd_temp = root_16 - own_embedding_16 + layer_16 + embedding_in_root
        # In backward a block's all-gather buffer coexists with its unsharded copy and its unsharded gradients;
        # an untied embedding once (FSDP2 gathers its unit again, FSDP1's root still holds it: embedding_in_root).
        r.bwd_temp = 2 * (root_16 + layer_16) + layer_grads - own_embedding_16
        r.foreach = foreach_temp_bytes(t_all, w) / n
        if s.offload:
            r.cpu = weights / n + grads / n + optim / n
            weights = grads = optim = r.foreach = 0.0
            div_w = div_g = div_o = 1
            staging, grad_shard = offload_staging_bytes(shape, w, n)
            r.fwd_temp += staging
            r.bwd_temp += staging + grad_shard
    else:  # model_parallel: one process, blocks split over the node's GPUs, one GPU computes at a time
        g = hw.gpus_per_node
        share = (-(-shape.layers // g)) / shape.layers
        div_w = div_g = div_o = 1 / share if g > 1 else 1
        r.layers = -(-shape.layers // g)
    n_ep = w.expert_parallel if ep else 1
    r.weights, r.grads, r.optimizer, r.grad_divisor = (weights / div_w + ex[0] / n_ep, grads / div_g + ex[1] / n_ep,
                                                       optim / div_o + ex[2] / n_ep, div_g)
    r.weights += shape.audio.buffer_bytes() if shape.audio is not None else 0  # buffers are never sharded/offloaded
    if not s.sharded:  # plain tensors: one multi-tensor temporary over what this GPU trains
        r.foreach = foreach_temp_bytes(r.grads / trainable_bytes(w), w)
    return r


def foreach_temp_bytes(params: float, w: Workload) -> float:
    """What torch AdamW's multi-tensor step (`foreach`, torch's default on a GPU, the HF Trainer's `adamw_torch`)
    allocates over a param group of `params` plain tensors: `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`,
    one copy of the group in the states' dtype, alive until the update (torch/optim/adam.py `_multi_tensor_adam`).
    The fused kernel (`fused_adamw`) and 8-bit AdamW (bitsandbytes, per tensor in place) allocate none."""
    return params * trainable_bytes(w) if w.multi_tensor_step else 0.0


def offload_staging_bytes(shape: ModelShape, w: Workload, n: int) -> tuple[float, float]:
    """What FSDP2's CPU offload (CPUOffloadPolicy) keeps on the GPU beside the gathered block, per rank: (staging,
    gradient shard). Before a unit's all-gather each rank copies its shard from pinned host memory to the GPU as
    stored (a full fine-tune's fp32 masters) and casts it to the compute dtype for the all-gather's input
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`), for the unit that computes and the
    one prefetched ahead of it; after a unit's reduce-scatter its fp32 gradient shard waits on the GPU until the
    copy to the host has run (_fsdp_collectives.py `foreach_reduce`). The host's pinned buffers are host RAM."""
    low = compute_bytes(w)
    layer = shape.layer_params()
    if w.method == "full":  # the stored shard, and its cast where the masters are wider than the compute dtype
        stored = trainable_bytes(w)
        per_unit = layer * (stored + (low if stored != low else 0)) / n
    else:  # frozen weights are stored as they compute (NF4 as NF4): the copy alone
        per_unit = block_weight_bytes(shape, w) / n
    grads = (layer if w.method == "full" else trainable_params(shape, w) / shape.layers) * 4.0 / n
    return 2 * per_unit, grads


def step_moments(shape: ModelShape, w: Workload, strategy: str, r: PerRank) -> dict[str, Breakdown]:
    """The step at its three candidate peaks (bytes): the loss (forward), the worst moment of backward, and the
    optimizer step."""
    tokens = w.tokens
    layers = r.layers
    g_fwd = r.grads if w.grad_accum > 1 or r.persistent_grads else 0.0
    embedding_grad = shape.vocab * shape.hidden * 4 if w.method == "full" and not shape.tied else 0.0
    # Under FSDP1's no_sync() the micro-batches before the optimizer step's hold every unsharded gradient instead,
    # through their forward and their backward (the last micro-batch's reduce-scatters replace them by shards
    # block by block, so it holds no more); the optimizer step sees the shards alone.
    # (never below nothing: an offloaded run holds no gradient on the GPU to take it from)
    g_bwd_end = max(0.0, r.grads - embedding_grad / r.grad_divisor)
    unsharded_grads = no_sync_grad_bytes(shape, w, strategy)
    if unsharded_grads:
        g_fwd = g_bwd_end = max(r.grads, unsharded_grads)
    residual_grads = tokens * shape.hidden * 4 * 2  # the gradient of the residual stream flowing back, fp32
    # QLoRA: a linear layer's backward dequantizes its weight again (the gradient of its input needs it), with
    # every activation of its block still saved. The same dequantization in forward never peaks: at that moment
    # backward's gradients and the loss's buffers do not exist yet.
    bwd_temp = r.bwd_temp + dequantize_bytes(shape, w, strategy)
    # The fp32 logits a loop keeps through backward and the optimizer step (`keeps_logits`, full losses only).
    held = tokens * shape.vocab * 4.0 if w.keeps_logits and w.loss in FULL_LOSSES else 0.0
    # The images' pixels and the clips' features (and trainable towers' saved activations) stay until backward
    # reaches the towers, which it does last.
    vision = image_activation_bytes(shape, w, strategy) + audio_activation_bytes(shape, w, strategy)
    wr, opt, fwd_temp = r.weights, r.optimizer, r.fwd_temp
    forward = Breakdown(wr, g_fwd, opt, forward_activation_bytes(shape, w, layers, strategy) + vision,
                        logits_bytes(shape, w, strategy), fwd_temp)
    if w.reference == "adapters_off":  # the reference's forward runs first, on the same weights, saving nothing
        forward = max(forward, Breakdown(wr, g_fwd, opt, reference_activation_bytes(shape, w, strategy) + vision,
                                         reference_logits_bytes(shape, w), fwd_temp), key=_tensors)
    return {
        "forward": forward,
        # Backward: the loss's gradient (a full loss only; the blocks are not recomputed yet), the last block's
        # backward (every activation saved, the recomputed block's included) and its end (every gradient made).
        "backward": max(
            Breakdown(wr, g_fwd, opt, forward_activation_bytes(shape, w, layers, strategy, "backward") + vision,
                      logits_bytes(shape, w, strategy, "backward") + held,
                      fwd_temp + head_dequantize_bytes(shape, w)),
            Breakdown(wr, g_fwd, opt, activation_bytes(shape, w, layers, strategy) + vision, held,
                      bwd_temp + residual_grads),
            # The input embedding's gradient comes last, after the first block has released its activations.
            Breakdown(wr, g_bwd_end, opt, activation_bytes(shape, w, 1, strategy) + vision, held,
                      bwd_temp + residual_grads),
            key=_tensors),
        "optimizer": Breakdown(wr, r.grads, opt + r.foreach, 0.0, held, 0.0),
    }


def reference_activation_bytes(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What the reference's forward (DPO/KTO with the adapters switched off) holds at once: it runs without
    gradients, so nothing is saved for backward; one block's tensors exist at a time (at most what that block would
    save with gradients), beside its input in the residual stream and the last block's output, which the
    log-probabilities read. The policy's own forward starts after it, so the two never add up."""
    r = residual_bytes(w, strategy)
    return w.tokens * (largest_block_activation_bytes_per_token(shape, w, strategy) + 2 * r * shape.hidden)


def reference_logits_bytes(shape: ModelShape, w: Workload) -> float:
    """The reference's log-probabilities: one chunk of labelled positions through the head at a time, its fp32
    logits and their 16-bit source (train/preference.py `sequence_logps`), nothing kept for backward."""
    c = compute_bytes(w)
    return min(w.loss_chunk or LOSS_CHUNK_MAX_ROWS, w.tokens) * shape.vocab * (4 + (c if c < 4 else 0))


def in_gib(b: Breakdown) -> Breakdown:
    """`b`'s tensor columns from bytes to GiB (in place; the runtime overhead is added in GiB afterwards)."""
    for f in ("weights", "grads", "optimizer", "activations", "logits", "temporaries"):
        setattr(b, f, getattr(b, f) / GIB)
    return b


def _verdict(shape: ModelShape, w: Workload, hw: Hardware, s: strategies.Strategy, b: Breakdown,
             cpu: float) -> tuple[bool, str]:
    """Whether the strategy fits (its peak in GPU memory, its offloaded shards in host RAM, the layouts QLoRA and
    model_parallel allow), and the note that says why or how much room is left."""
    n = hw.world
    fits = b.total <= hw.gpu_mem_gib
    notes = ""
    host_gib = cpu / GIB * hw.gpus_per_node
    if s.offload and hw.cpu_mem_gib is not None and host_gib > hw.cpu_mem_gib:
        fits = False
        notes = f"host RAM too small for offloaded shards: {host_gib:.0f} GiB per node needed"
    if s.engine == "device_map" and hw.nodes > 1:
        fits, notes = False, "model_parallel splits one process over one node's GPUs; use zero3 across nodes"
    if not methods.get(w.method).allows(s.engine):
        fits, notes = False, "QLoRA's 4-bit weights are not trained split over GPUs; use zero3 (check: " \
                             "qlora_split_over_devices)"
    shard_problem = qlora_shard_problem(shape, w, n) if s.sharded else None
    if shard_problem:
        fits, notes = False, f"QLoRA's 4-bit weights cannot be sharded over {n} GPUs: {shard_problem} (check: " \
                             "qlora_shard_layout)"
    return fits, notes or _note(s, b, hw, w.expert_parallel)


def not_applicable(s: strategies.Strategy, hw: Hardware) -> str | None:
    """Why the hardware named cannot run `s` at all, or None when it can. shardfit runs a multi-rank strategy in
    one process as `single` (parallel/env.py: one process is never a process group), and on a CPU there is no
    device memory to offload from and no GPUs to split layers over."""
    cpu = hw.name == "cpu"
    if s.multi_rank and hw.world == 1:
        return (f"n/a on one {hw.unit}: needs several ranks (shardfit train --nproc N"
                f"{'' if cpu else ' on N GPUs'}); one process runs it as single")
    if cpu and s.offload:
        return "n/a on a CPU: there is no GPU memory to offload from (zero3 is the same without the copies)"
    if cpu and s.engine == "device_map":
        return "n/a on a CPU: there are no GPUs to split the layers over (it runs as single)"
    if s.engine == "device_map" and hw.gpus_per_node == 1:
        return "n/a on one GPU: there is no other GPU to split the layers over (it runs as single)"
    return None


def _tensors(b: Breakdown) -> float:
    return b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries


def add_runtime_overhead(b: Breakdown, hw: Hardware, strategy: str) -> None:
    """Fill in what a real GPU adds to the tensor peak (GiB) and the total: the allocator's reserve (its own line),
    the CUDA context, and NCCL buffers when several ranks of the strategy talk (`runtime_overhead`)."""
    tensors = _tensors(b)
    talks = hw.world > 1 and strategies.get(strategy).multi_rank
    b.allocator_reserve = tensors * ALLOCATOR_RESERVE
    b.runtime_overhead = CUDA_CONTEXT_GIB + (NCCL_GIB if talks else 0.0)
    b.total = tensors + b.allocator_reserve + b.runtime_overhead


def peak_reading(b: Breakdown, gpu_gib: float, reading: str = "reserved") -> float:
    """What a run of breakdown `b` (GiB) reads at its peak on a card of `gpu_gib` when it succeeds: `allocated`
    torch.cuda.max_memory_allocated() (the tensors), `reserved` max_memory_reserved() (the tensors and the cache,
    ALLOCATOR_CACHE of them) and `total` that and the runtime, as nvidia-smi shows the device. The cache is capped by
    the card: before a request fails the allocator frees cached segments and retries, so a run near its card reads
    what the card leaves after the runtime, never less than the verdict's reserve needs."""
    if reading not in READINGS:
        raise ValueError(f"reading {reading!r}: one of {', '.join(READINGS)}")
    tensors = b.total - b.runtime_overhead - b.allocator_reserve
    if reading == "allocated":
        return tensors
    room = max(gpu_gib - b.runtime_overhead, tensors + b.allocator_reserve)
    reserved = min(tensors * (1 + ALLOCATOR_CACHE), room)
    return reserved if reading == "reserved" else reserved + b.runtime_overhead


# What lowers each part of the peak, for the note of a strategy that does not fit.
LOWERS = {"weights": "sharding (zero3), LoRA or QLoRA", "grads": "sharding (zero2/zero3) or LoRA",
          "optimizer": "sharding (zero2/zero3), LoRA or 8-bit AdamW",
          "activations": "gradient checkpointing, a smaller micro-batch or shorter sequences",
          "logits": "a smaller micro-batch or shorter sequences (the chunked loss)",
          "temporaries": "a smaller micro-batch"}


def largest_part(b: Breakdown) -> tuple[str, float]:
    """The part of the peak (weights, grads, optimizer, activations, logits, temporaries) that is largest."""
    return max(((k, getattr(b, k)) for k in LOWERS), key=lambda kv: kv[1])


def _note(s: strategies.Strategy, b: Breakdown, hw: Hardware, ep: int = 1) -> str:
    cap = hw.gpu_mem_gib
    unit = hw.unit
    if b.total > cap:
        part, gib = largest_part(b)
        replica = f"full replica per {unit}: " if s.engine in ("plain", "ddp") else ""
        if s.engine == "ddp" and ep > 1:  # expert_parallel: every weight but the routed experts' (1/ep of those)
            replica = f"replica with 1/{ep} of the experts per {unit}: "
        if part == "weights" and gib > cap:
            return f"{replica}weights alone need {gib:.0f} GiB of {cap:.0f} GiB"
        lowers = LOWERS[part]
        if s.shards_params or (s.sharded and part != "weights"):  # sharded already: more ranks share it
            lowers = lowers.replace("sharding (zero2/zero3)", "more GPUs").replace("sharding (zero3)", "more GPUs")
        return f"{replica}{b.total:.1f} GiB of {cap:.0f} GiB; largest part: {part} {gib:.1f} GiB (lowered by {lowers})"
    if s.engine == "plain" and hw.world > 1:
        return f"uses one {unit} only"
    if s.offload:
        return "params, grads and optimizer state in host RAM (PCIe traffic every step)"
    if s.engine == "device_map":
        return "layers split over local GPUs; one GPU computes at a time"
    return f"{cap - b.total:.1f} GiB headroom"
