"""Bytes of the optimizer's states and of what its step allocates, for the optimizer the workload names
(plan/optimizer_kinds.py `OPTIMIZER_KINDS`): the one count the estimate, ZeRO (plan/deepspeed.py), the pipeline's
stages (plan/pipeline.py) and expert parallelism's share (plan/experts.py) read.

Three layouts of the stepped tensors: plain tensors (one process, DDP, FSDP2's DTensor shards, which keep each
weight's 2-D shape); FSDP1's flat parameters (each rank's shard of a unit is one 1-D tensor, and with
use_orig_params its original parameters are 1-D views of it); DeepSpeed's flat fp32 partitions. On the flat ones an
optimizer sees vectors only, so Adafactor keeps its whole second moment (`flat`), and bitsandbytes' small-tensor
rules never apply.
"""

from __future__ import annotations

from shardfit.plan.adapters import adapts, rank_of, saved_params
from shardfit.plan.model_shape import Block, ModelShape
from shardfit.plan.optimizer_kinds import BNB_STATE_BLOCK, DTYPE_BYTES, OPTIMIZER_KINDS, OptimizerKind
from shardfit.plan.precision import saved_copy_bytes, trainable_bytes
from shardfit.plan.workload import Workload

# bitsandbytes' 8-bit optimizers keep fp32 states for a tensor of fewer elements than this (Optimizer2State's
# `min_8bit_size` default; `init_state`: `if p.numel() < config["min_8bit_size"]: dtype = torch.float32`).
BNB_MIN_8BIT_SIZE = 4096


def kind_of(w: Workload) -> OptimizerKind:
    """The optimizer `w` steps, as the table describes it."""
    return OPTIMIZER_KINDS[w.optimizer]


def state_dtype_bytes(w: Workload) -> tuple[int, ...] | None:
    """Bytes per element of each state of an optimizer that takes their dtypes as settings (the table's `dtypes`:
    AnyPrecision AdamW's): the job's `optimizer_dtypes`, else the optimizer's own as the tool builds it; they hold
    whatever the weights' or the masters' dtype. None for every other optimizer (one `state_width`)."""
    kind = kind_of(w)
    if not kind.dtypes:
        return None
    names = w.optimizer_dtypes or kind.dtypes
    assert len(names) == kind.states, f"{w.optimizer} keeps {kind.states} states, not {len(names)}: {names}"
    return tuple(DTYPE_BYTES[n] for n in names)


def state_width(w: Workload, *, fp32_masters: bool = False, weight_bytes: int | None = None) -> float:
    """Bytes of one full-size state per trained weight: 8-bit blockwise (one byte and an fp32 absmax per
    BNB_STATE_BLOCK), fp32 (the optimizer's own rule, bitsandbytes' 32-bit kernels `bnb_optimizer`:
    `get_state_buffer(p, dtype=torch.float32)`, or an engine's fp32 masters `fp32_masters`: DeepSpeed's ZeRO steps
    its fp32 partition whatever the weights' dtype, even for 16-bit LoRA adapters), else the dtype of the weights
    stepped (torch's `zeros_like(p)`): `weight_bytes` where it is not `trainable_bytes` (peft's trained copies).
    An optimizer with a dtype per state (`state_dtype_bytes`): their mean."""
    kind = kind_of(w)
    each = state_dtype_bytes(w)
    if each is not None:
        return sum(each) / len(each)
    if kind.width == "8bit":
        return 1 + 4 / BNB_STATE_BLOCK
    if kind.width == "fp32" or w.bnb_optimizer or fp32_masters:
        return 4.0
    return float(weight_bytes or trainable_bytes(w))


def optimizer_state_bytes(w: Workload, *, fp32_masters: bool = False, weight_bytes: int | None = None,
                          flat: bool = False) -> float:
    """Bytes of the optimizer's full-size states per trainable weight (`state_width` each): AdamW's two, Lion's
    one, AdEMAMix's three, none for SGD without momentum. Adafactor's factored second moment is not in it
    (`factored_state_bytes`) unless the tensors are `flat` (DeepSpeed's partitions, FSDP1's flat parameters): a
    vector's second moment is whole, one more state."""
    kind = kind_of(w)
    states = kind.states + (1 if kind.factored and flat else 0)
    return states * state_width(w, fp32_masters=fp32_masters, weight_bytes=weight_bytes)


def copy_width(w: Workload, weight_bytes: int | None = None) -> float:
    """Bytes per element of the copies a step that loops over tensors makes (`tensor_copies`): of the state
    `copied_state` where each has its own dtype (AnyPrecision AdamW's variance), else `state_width` of weights of
    `weight_bytes`."""
    each = state_dtype_bytes(w)
    if each is not None:
        return float(each[kind_of(w).copied_state])
    return state_width(w, weight_bytes=weight_bytes)


def factored_elements(shape: ModelShape, w: Workload, trainable: int) -> float:
    """Elements of Adafactor's factored second moment over every trained tensor kept in its shape: a row and a
    column factor per matrix (per expert of a stacked 3-D weight: torch and transformers factor the last two
    dimensions), the whole of every other trained weight (norms, biases; a tower's weights and the experts'
    adapters too, an upper bound of a few bytes per row), of the model's `trainable` weights."""
    matrices = _trained_matrices(shape, w)
    return float(trainable - sum(i * o for i, o in matrices) + sum(i + o for i, o in matrices))


def _trained_matrices(shape: ModelShape, w: Workload) -> list[tuple[int, int]]:
    """(in, out) of each trained matrix the planner knows the shape of, each block's once per block: a full
    fine-tune's (or freeze's trained blocks') linear weights, the input embedding and an untied head; LoRA's A
    (rank x in) and B (out x rank) of each adapted dense layer, and peft's trained copies of the embedding or
    head."""
    out: list[tuple[int, int]] = []
    matrix = (shape.hidden, shape.vocab)
    if w.trains_adapters:
        for n, kind in shape.block_kinds():
            out += [m for name, i, o in shape.named_linears(kind)
                    if adapts(name, w) and not name.startswith("expert_")
                    for r in (rank_of(name, w),) for m in ((i, r), (r, o))] * n
        return out + [matrix] * len(set(w.lora_saved))
    if w.method == "freeze":
        blocks = len(w.trained_blocks(shape.layers))
        return [(i, o) for i, o in shape.linear_shapes()] * blocks
    for n, kind in shape.block_kinds():
        out += [(i, o) for _, i, o in shape.named_linears(kind)] * n
    return out + [matrix] * (1 if shape.tied else 2)


def factored_state_bytes(shape: ModelShape, w: Workload, trainable: int) -> float:
    """Bytes of Adafactor's factored second moment over the model's `trainable` weights (0 for an optimizer that
    does not factor): `factored_elements` in the states' width."""
    if not kind_of(w).factored:
        return 0.0
    return factored_elements(shape, w, trainable) * state_width(w)


def fp32_state_embedding(w: Workload) -> bool:
    """Whether a bitsandbytes 8-bit optimizer keeps fp32 states for a trained input embedding: under the HF Trainer
    (a tool's bitsandbytes 8-bit `optim`, `bnb_optimizer`), whose Trainer.create_optimizer registers every
    nn.Embedding of the model for 32-bit states (GlobalOptimManager's `register_module_override` with `optim_bits`
    32) for any bitsandbytes optimizer built with 8 bits: a full fine-tune's embedding, and peft's trained copy of
    it (`lora_saved` "embed": ModulesToSaveWrapper's copy is an nn.Embedding too). The untied head is an nn.Linear:
    8-bit states. Not with FSDP1's flat parameters (`flat_params`): the override is keyed by the embedding's own
    parameter, which no flat parameter is (`fp32_state_params`); nor where nothing registers it
    (`embedding_override` off: a hand-written loop, axolotl's own param groups). The one rule the estimate and a
    pipeline stage's parts (plan/pipeline.py `_part_gib`) read."""
    if kind_of(w).width != "8bit" or not w.bnb_optimizer or w.flat_params or not w.embedding_override:
        return False
    return w.method == "full" or (w.trains_adapters and "embed" in w.lora_saved)


def full_width_state_bytes(w: Workload) -> float:
    """Bytes of the states of a tensor an 8-bit optimizer keeps full-width (`fp32_state_params`): fp32 under
    bitsandbytes; torchao's in the parameter's own dtype (optim/adam.py `_new_buffer`: `torch.zeros_like(p)`)."""
    return kind_of(w).states * (trainable_bytes(w) if w.torchao_optimizer else 4.0)


def fp32_state_params(shape: ModelShape, w: Workload) -> float:
    """Trainable weights an 8-bit optimizer keeps full-width states for (`full_width_state_bytes`, not
    `optimizer_state_bytes`' 1.016 per state): bitsandbytes' each tensor under BNB_MIN_8BIT_SIZE elements (LoRA A
    and B matrices of a small model's narrow layers; a full fine-tune's norm weights and biases where the hidden
    size is under it), and the trained input embedding the HF Trainer registers for 32-bit states
    (`fp32_state_embedding`); torchao's (`torchao_optimizer`) each under the same size or not a multiple of its
    block (BNB_STATE_BLOCK, 256), judged on the whole tensor (under FSDP2 it judges each rank's shard: not
    modelled). 0 for other optimizers, and with FSDP1's flat parameters (`flat_params`): the optimizer steps one
    flat parameter per unit, never a small tensor, and the Trainer's override (keyed by the embedding's own
    parameter) matches none; DeepSpeed's ZeRO steps flat fp32 partitions alike (plan/deepspeed.py never adds these).
    """
    if kind_of(w).width != "8bit" or w.flat_params:
        return 0.0

    def wide(n: int) -> bool:
        return n < BNB_MIN_8BIT_SIZE or (w.torchao_optimizer and n % BNB_STATE_BLOCK != 0)

    embedding = shape.vocab * shape.hidden if fp32_state_embedding(w) else 0
    if w.trains_adapters:
        return float(embedding + shape.over_blocks(lambda moe: sum(
            (r * i if wide(r * i) else 0) + (r * o if wide(r * o) else 0)
            for n, i, o in shape.named_linears(moe) if adapts(n, w) and not n.startswith("expert_")
            for r in (rank_of(n, w),))))
    if w.method != "full":
        return 0.0
    # A block's weights outside its linear layers (norms, biases) are vectors no wider than the hidden size or a
    # projection's output: full-width where the hidden size is.
    norms = shape.over_blocks(shape.block_extra_params) + shape.hidden if wide(shape.hidden) else 0
    return float(norms + embedding)


def model_state_bytes(shape: ModelShape, w: Workload, trainable: int, *, flat: bool = False) -> float:
    """The optimizer's states over the whole model's `trainable` weights, before any sharding: the full-size
    states (peft's trained copies in their own dtype, torch's `zeros_like`), an 8-bit optimizer's full-width
    tensors (`fp32_state_params`) and Adafactor's factored second moment (`factored_state_bytes`; whole on `flat`
    tensors, where `optimizer_state_bytes` counts it)."""
    saved = saved_params(shape, w)
    wide = fp32_state_params(shape, w) * (full_width_state_bytes(w) - optimizer_state_bytes(w))
    per, per_saved = (optimizer_state_bytes(w, flat=flat, weight_bytes=b)
                      for b in (None, saved_copy_bytes(w)))
    factored = 0.0 if flat else factored_state_bytes(shape, w, trainable)
    return (trainable - saved) * per + saved * per_saved + wide + factored


def _block_tensors(shape: ModelShape, w: Workload, block: Block) -> list[int]:
    """Elements of each matrix one decoder block of kind `block` trains, in the order the model registers them
    (its mixer's, then its MLP's): a mixture's routed experts as the fused 3-D stacks transformers 5 keeps
    (`fused_experts`: ModelShape.stored_weights, each stack one tensor, factored over its last two dimensions by
    Adafactor), else one per expert."""
    if w.fused_experts or shape.experts_always_fused:
        return [r * c for _, r, c in shape.stored_weights(block)]
    return [i * o for _, i, o in shape.named_linears(block)]


def stepped_pairs(shape: ModelShape, w: Workload, *, matrices: bool = True) -> list[tuple[int, int, int, int]]:
    """(elements, bytes per element) of each trained matrix a step that loops over tensors may peak at, followed by
    those of the matrix it steps just before (0 for the first). The HF Trainer's param groups put every matrix in
    the decay group and the norms and biases in the other, so matrices follow one another in the model's order:
    a full fine-tune's embedding first, each block's weights (a block's first after the block before's last; the
    first block's after the embedding), an untied head after the last block's last weight; `freeze` its trained
    blocks' (of any kind: a bound). LoRA: two adapter matrices in a row (A, then B), none over the largest
    (`lora_rank` times the widest layer), and peft's trained copies of the embedding (the first trained tensor;
    the first adapter after it) and of the head (after the last adapter), in their own dtype (`saved_copy_bytes`).
    axolotl's own groups (`embedding_group`, `lr_groups`): `_grouped_pairs`. `matrices` off (a pipeline's middle
    stage): neither the embedding, the head, nor their copies."""
    low, matrix = trainable_bytes(w), shape.vocab * shape.hidden
    if w.trains_adapters:
        adapter = w.lora_rank * max(max(i, o) for i, o in shape.linear_shapes())
        pairs = [(adapter, low, adapter, low)]
        saved = set(w.lora_saved) if matrices else set()
        copy = saved_copy_bytes(w)
        if w.embedding_group:
            return pairs + _grouped_copies(saved, matrix, copy, adapter, low)
        if "embed" in saved:
            pairs += [(matrix, copy, 0, low), (adapter, low, matrix, copy)]
        if "head" in saved:
            pairs.append((matrix, copy, adapter, low))
        return pairs
    blocks = [seq for _, kind in shape.block_kinds() if (seq := _block_tensors(shape, w, kind))]
    last = max(seq[-1] for seq in blocks)
    pairs = [(x, low, before, low) for seq in blocks for x, before in zip(seq, [last, *seq[:-1]], strict=True)]
    if w.embedding_group or w.lr_groups:
        return pairs + _grouped_pairs(shape, w, blocks, matrices=matrices)
    if w.method != "full" or not matrices:
        return pairs
    pairs += [(matrix, low, 0, low)] + [(seq[0], low, matrix, low) for seq in blocks]
    return pairs + ([] if shape.tied else [(matrix, low, last, low)])


def _grouped_pairs(shape: ModelShape, w: Workload, blocks: list[list[int]], *,
                   matrices: bool) -> list[tuple[int, int, int, int]]:
    """The pairs axolotl's own param groups add to the block matrices' (its OptimizerMixin's
    `create_optimizer_grouped_parameters`, used once `embedding_lr`, `embedding_lr_scale` or `lr_groups` is set):
    the decay group's matrices in the model's order; then the embedding and an untied head in a group of their
    own (`embed_tokens`, `lm_head`), the embedding after the decay group's last matrix and the head right after
    the embedding; then the norms' group; then each `lr_groups` group, whose matrices (named by module, which the
    plan does not match) are bounded as any block matrix after any other. The tensor before a group's first is
    the previous group's last, as transformers' Adafactor still holds it (one step() over every group; torch's
    frees it between groups: a bound)."""
    low, matrix = trainable_bytes(w), shape.vocab * shape.hidden
    largest = max(max(seq) for seq in blocks)
    last = largest if w.lr_groups else max(seq[-1] for seq in blocks)
    pairs = [(largest, low, largest, low)] if w.lr_groups else []
    if w.method != "full" or not matrices:
        return pairs
    pairs.append((matrix, low, last, low))
    return pairs + ([] if shape.tied else [(matrix, low, matrix, low)])


def _grouped_copies(saved: set[str], matrix: int, copy: int, adapter: int,
                    low: int) -> list[tuple[int, int, int, int]]:
    """peft's trained copies of the embedding and head (`saved`) in axolotl's embeddings group (`_grouped_pairs`:
    every name ending modules_to_save.default.weight): stepped after the last adapter, the head's right after the
    embedding's."""
    pairs = []
    if "embed" in saved:
        pairs.append((matrix, copy, adapter, low))
    if "head" in saved:
        pairs.append((matrix, copy, *((matrix, copy) if "embed" in saved else (adapter, low))))
    return pairs


def largest_trainable(shape: ModelShape, w: Workload, *, matrices: bool = True) -> int:
    """Elements of the largest trainable parameter (`stepped_pairs`' tensors): the embedding or head of a full
    fine-tune (or its largest block weight, a mixture's fused expert stack; only that where the tensors stepped
    hold neither matrix, `matrices` off: a pipeline's middle stage), the largest trained block weight of `freeze`,
    the largest adapter matrix of LoRA, or peft's trained copy of the embedding or head where the job trains one."""
    return max(x for x, _, _, _ in stepped_pairs(shape, w, matrices=matrices))


def fsdp1_flat_piece(shape: ModelShape, w: Workload, n: int, *, matrices: bool = True) -> float:
    """Elements of the largest 1-D tensor FSDP1 hands the optimizer on each of `n` ranks: a unit's flat shard (the
    root's embedding and head, unless `matrices` is off, or a block: 1/n of it), or with use_orig_params an original
    parameter's view of that shard, never more than the parameter (`largest_trainable`). LoRA: an adapter matrix
    may lie whole in one rank's shard; peft's trained copies lie in the root unit, 1/n each."""
    if w.trains_adapters:
        copy = shape.vocab * shape.hidden / n if matrices and set(w.lora_saved) else 0.0
        return max(float(largest_trainable(shape, w, matrices=False)), copy)
    largest = largest_trainable(shape, w, matrices=matrices)
    root = shape.embed_params() + shape.hidden if matrices and w.method == "full" else 0
    return min(float(largest), max(shape.layer_params(), root) / n)


def foreach_temp_bytes(params: float, w: Workload, largest: float = 0.0, *, flat: bool = False,
                       before: float = 0.0) -> float:
    """What the optimizer's step allocates over a param group of `params` tensors whose largest has `largest`
    elements. torch's multi-tensor (`foreach`) kernels, their default on a GPU (`multi_tensor_step`): each of the
    kind's `group_copies` a copy of the group in the states' dtype, alive until the update (AdamW's
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, torch/optim/adam.py `_multi_tensor_adam`). A step that
    loops over tensors (`tensor_copies`: Adafactor's, AnyPrecision AdamW's): `loop_copy_bytes` of the largest
    stepped after one of `before` elements. On `flat` tensors (FSDP1's, several in one step) its
    `several_flat_copies` of the largest: the previous tensor's `update` stays bound until the next one's is made
    (measured: 3.0 copies of each of several equal vectors, torch's and transformers' Adafactor alike; 2.0 with
    beta1). Fused kernels (`fused_adamw`) and bitsandbytes' (per tensor in place) allocate none."""
    kind = kind_of(w)
    if w.multi_tensor_step:
        return kind.group_copies * params * trainable_bytes(w)
    if not kind.tensor_copies or w.bnb_optimizer:
        return 0.0
    if not flat:
        return loop_copy_bytes(w, largest, before)
    upcast = 2 * 4 if kind.upcasts and trainable_bytes(w) < 4 else 0
    held = kind.previous_weight_copies * trainable_bytes(w)
    return largest * (kind.several_flat_copies * copy_width(w) + upcast + held)


def loop_copy_bytes(w: Workload, elements: float, before: float = 0.0, *, weight_bytes: int | None = None,
                    before_bytes: int | None = None) -> float:
    """What a step that loops over tensors holds while it steps one of `elements` elements right after one of
    `before`: its `tensor_copies` of it (`copy_width`), transformers' fp32 copies of a 16-bit weight and its
    gradient (`upcasts`), and what it still holds of the one before (`previous_copies`, `previous_weight_copies`);
    or, where more, its `weight_clones` beside one of those copies and the previous tensor's weight copies (Kahan
    summation's `temp_buffer`, which outweighs a variance copy narrower than the weights). `weight_bytes`,
    `before_bytes`: each tensor's own bytes per element where not `trainable_bytes` (peft's trained copies)."""
    kind, low = kind_of(w), trainable_bytes(w)
    now, then = weight_bytes or low, before_bytes or low
    upcast = 2 * 4 if kind.upcasts and now < 4 else 0
    held = before * (kind.previous_copies * copy_width(w, then) + kind.previous_weight_copies * then)
    copies = elements * (kind.tensor_copies * copy_width(w, now) + upcast) + held
    if not kind.weight_clones:
        return copies
    cloned = elements * ((kind.tensor_copies - 1) * copy_width(w, now) + kind.weight_clones * now + upcast) + \
        before * kind.previous_weight_copies * then
    return max(copies, cloned)


def step_temp_bytes(shape: ModelShape, w: Workload, params: float, *, matrices: bool = True) -> float:
    """What the optimizer's step allocates over `params` of the model's trained weights, before any sharding
    (`foreach_temp_bytes`): a multi-tensor kernel's copies of them, or where the step loops over tensors its most
    over the model's matrices one after another (`stepped_pairs`, `matrices` as there)."""
    kind = kind_of(w)
    if w.multi_tensor_step or not kind.tensor_copies or w.bnb_optimizer:
        return foreach_temp_bytes(params, w)
    return max(loop_copy_bytes(w, x, before, weight_bytes=b, before_bytes=before_b)
               for x, b, before, before_b in stepped_pairs(shape, w, matrices=matrices))


def sharded_step_bytes(shape: ModelShape, w: Workload, trainable: float, n: int, *, flat: bool,
                       matrices: bool = True) -> float:
    """What the optimizer's step allocates on each of `n` ranks that shard the model's `trainable` weights: 1/n of
    the multi-tensor copies, or of a loop over tensors' copies (`step_temp_bytes`: FSDP2 shards each tensor, so a
    rank steps 1/n of each); FSDP1's `flat` tensors for a loop over tensors (Adafactor): copies of the largest one
    (`fsdp1_flat_piece`)."""
    if flat and kind_of(w).flat_copies and not w.multi_tensor_step:
        return foreach_temp_bytes(trainable / n, w, fsdp1_flat_piece(shape, w, n, matrices=matrices), flat=True)
    return step_temp_bytes(shape, w, trainable, matrices=matrices) / n


def step_bytes_per_param(w: Workload) -> int:
    """Bytes the optimizer's step reads and writes per trained weight, which sets its time at the memory bandwidth
    (plan/comms.py): the fp32 weight read and written and its gradient read (12), each full-size state read and
    written, and each per-tensor copy written and read, 8 bytes apiece as the fitted AdamW's 28 counts its two
    (comms.py ADAM_BYTES_PER_PARAM, kept for 8-bit AdamW too); Adafactor's factors are a few bytes per row."""
    kind = kind_of(w)
    return 12 + 8 * (kind.states + kind.tensor_copies)
