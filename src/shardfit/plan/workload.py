"""The workload the planner sizes: what trains, in which precision, over how many tokens, with which kernels.

`workload_of` reads it from a training config; `shardfit plan` flags override single fields.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.config import Config
from shardfit.kernels import delta_rule_kernel, mamba_kernel, widening_matmul_in_torch
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS

# transformers' own causal-LM loss over every position (what the HF Trainer, LLaMA-Factory, axolotl and TRL run),
# in three generations: see `Workload.loss`.
FULL_LOSSES = ("full", "full_shift", "full_shift16")
# torchtune's CEWithChunkedOutputLoss: the head runs over 8 slices of the sequence and the loss upcasts each slice.
LOSSES = ("chunked", *FULL_LOSSES, "chunked_output")
# The linear layers of a decoder block LoRA can target, in the order they run.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTIONS = ("sdpa", "flash", "eager")
# What dequantizes QLoRA's 4-bit weights for each matmul: torchao's NF4Tensor in plain PyTorch ops (shardfit's own
# QLoRA) or bitsandbytes' fused CUDA kernel (the HF Trainer, TRL, LLaMA-Factory, axolotl, unsloth): plan/dequant.py
# `DEQUANT`.
QUANT_BACKENDS = ("torchao", "bnb")
# transformers' attention implementations by what they keep: a dense mask (sdpa, and transformers' default) or not.
ATTENTION_MEMORY = {"eager": "eager", "flash_attention_2": "flash", "flex_attention": "flash"}


@dataclass(frozen=True)
class Workload:
    method: str = "lora"
    precision: str = "bf16"
    seq_len: int = 2048
    micro_batch: int = 1
    # none; full: each block keeps only its input; selective: also its attention kernel's and every other matmul's
    # outputs (torchtitan's op-level policy, models/checkpointing.py)
    grad_ckpt: str = "full"
    # The optimizer's name in plan/optimizer_kinds.py `OPTIMIZER_KINDS` (OPTIMIZERS): its states and step copies.
    optimizer: str = "adamw"
    lora_rank: int = 8
    # chunked: shardfit's loss; full: the model's own loss over full logits (HF Trainer); full_shift: the same with
    # transformers 4.46-4.48, which copied the shifted fp32 logits; full_shift16: a GPT-2-style loss that copies the
    # shifted 16-bit logits and leaves the upcast to autocast's cross-entropy (remote code such as Qwen v1's)
    loss: str = "chunked"
    # Rows of logits per chunk of the `chunked` loss; 0: `loss_chunk: auto`, decided by the vocabulary and the card
    # (plan/estimate.py `with_loss_chunk`).
    loss_chunk: int = 0
    # sdpa: torch's SDPA over shardfit's rows where they hold several examples (packing restarts the positions), so
    # transformers builds a block-diagonal [batch, seq, seq] mask; flash: flash-attention 2 or flex attention
    # (variable lengths, no dense mask), or SDPA over rows of one example each (padding continues the positions,
    # data/loader.py `collate`: no mask, the causal kernel with GQA) of a model without windowed or chunked blocks
    # (their masks make SDPA dense: plan such a run as sdpa); eager: the scores are saved
    attention: str = "sdpa"
    grad_accum: int = 1  # above 1, the gradients of earlier micro-batches are held through each forward
    # Ranks that split every row (`sequence_parallel`, parallel/ulysses.py): each forwards 1/N of the row's tokens,
    # and four all-to-alls per block move its attention's q, k, v and output (plan/comms.py `ulysses_s`).
    sequence_parallel: int = 1
    # Ranks that share each block's routed experts (`expert_parallel`, parallel/experts.py): each holds 1/N of them,
    # and the tokens travel by all-to-all (plan/experts.py).
    expert_parallel: int = 1
    # The frozen weights outside the decoder's linear layers (embeddings, norms, head) kept in fp32, as peft's
    # prepare_model_for_kbit_training leaves them (TRL's SFTTrainer and axolotl apply it to every 4-bit model).
    frozen_fp32: bool = False
    # ... and the decoder's frozen linear layers in fp32 too: a LoRA run whose model was loaded in fp32 under 16-bit
    # autocast (TRL's ModelConfig --dtype float32, its default). Set with `frozen_fp32`; autocast casts each frozen
    # weight to 16 bits per matmul and the matmul keeps that copy for its input's gradient, as over a full
    # fine-tune's fp32 masters (plan/precision.py `autocast_fp32_master`).
    loaded_fp32: bool = False
    # LoRA adapters, their gradients and AdamW states in 16 bits instead of fp32: peft before 0.12 (adapters took
    # the base layer's 16-bit dtype), LLaMA-Factory's pure_bf16, shardfit's `lora.dtype: bf16`, TRL's cast of a
    # k-bit model's trainables to bf16 (in an fp32 run too: plan/precision.py `trainable_bytes`).
    adapters_16bit: bool = False
    # A tool's engine wraps the forward in autocast whenever it mixes precision, under FSDP and beside 16-bit
    # adapters too (accelerate's `native_amp`, Lightning's bf16-mixed). False: shardfit's own runner, which
    # autocasts only where resolve/decide.py turns it on (plan/precision.py `runs_autocast`, `autocast_launches`).
    tool_autocast: bool = True
    # Every weight, gradient and AdamW state in the compute precision and no autocast: torchtune's recipes,
    # Answer.AI's train.py `--precision bf16`. Implies 16-bit adapters.
    pure_16bit: bool = False
    # torch.compile over each decoder block (inductor): elementwise ops are fused and recomputed in backward, so a
    # block saves fewer tensors (see estimate.block_activation_bytes_per_token).
    compile: bool = False
    # TF32 for the run's fp32 matmuls (the HF Trainer's `tf32`); None: as the Trainer leaves torch, on under
    # `torch_compile` unless the run is fp16 (`fp32_matmuls_tf32`), torch's default (off) otherwise.
    tf32: bool | None = None
    # The projections LoRA adapts (LORA_TARGETS names); None: all of them (peft's `all-linear`).
    lora_targets: tuple[str, ...] | None = None
    # peft's lora_dropout: above 0 every adapter keeps its dropped-out input and the dropout mask for backward.
    lora_dropout: float = 0.0
    # A mixture of experts: adapters on the routed experts too (`lora.experts`).
    lora_experts: bool = True
    # ... on every routed expert weight whatever `lora_targets` names, as shardfit's trainer adds them (peft
    # target_parameters, models/adapters.py); False: only the expert weights of targeted gate/up/down, as the
    # other tools' peft target_modules reach them.
    lora_all_experts: bool = False
    # A mixture's router (its gate weight or module) carries an adapter: peft's all-linear or a `gate` target on
    # the families peft 0.21 rewrites, all-linear on Llama 4 (whose router is an nn.Linear).
    lora_router: bool = False
    # peft 0.21's rewrite of transformers 4's expert names onto transformers 5's fused weights (None: not applied):
    # the routed expert weights it adapts ("gate_up" at twice the rank: gate_proj's and up_proj's adapters fused;
    # "down"), while the MLP names it moves (gate/up/down) adapt no dense layer's or shared expert's module.
    lora_rewritten: tuple[str, ...] | None = None
    # Modules trained whole beside the adapters (peft's modules_to_save: LLaMA-Factory's additional_target,
    # axolotl's lora_modules_to_save, ms-swift's --modules_to_save): "embed", "head". peft trains a full copy of
    # each while the original stays frozen, so each adds its weights to the trainable parameters.
    lora_saved: tuple[str, ...] = ()
    # The dtype those copies, their gradients and torch AdamW's states are in (plan/precision.py `saved_copy_bytes`):
    # "loaded": peft deep-copies the module as it was loaded (ModulesToSaveWrapper; cast_adapter_dtype upcasts only
    # the adapters' own layers), fp32 after prepare_model_for_kbit_training (`frozen_fp32`), else the compute dtype
    # (the HF Trainer and TRL, axolotl); "trainable": the tool casts every trainable weight to fp32 after wrapping,
    # as the adapters (LLaMA-Factory's cast_trainable_params_to_fp32, off under pure_bf16); "fp16_upcast": as
    # loaded, but fp16 ones cast to fp32 (ms-swift's fix for GradScaler's "Attempting to unscale FP16 gradients").
    lora_saved_dtype: str = "loaded"
    # `freeze`: the decoder blocks that train, by index (`trained_blocks`); empty: the last two (LLaMA-Factory's
    # default). Backward runs from the top down to the lowest of them.
    freeze_blocks: tuple[int, ...] = ()
    # The training loop keeps the model's output, and with it the fp32 logits of a full loss, until the next step
    # (a loop that writes `output = model(...)` and never deletes it, as Answer.AI's train.py); the HF Trainer
    # and torchtune drop it before backward.
    keeps_logits: bool = False
    # FSDP1's no_sync() between optimizer steps (Lightning Fabric's `no_backward_sync` under its FSDPStrategy, as
    # litgpt's finetune scripts use it; Answer.AI's train.py `--no_sync`): through the accumulating micro-batches
    # each rank keeps the unsharded gradient of every flat parameter that holds a trainable weight, until the
    # optimizer step's micro-batch reduce-scatters it (plan/estimate.py `no_sync_grad_bytes`). shardfit's FSDP2
    # reduce-scatters every micro-batch.
    fsdp1_no_sync: bool = False
    # FSDP1 with use_orig_params=False: each flat parameter holds only trainable or only frozen weights. With
    # use_orig_params=True (False here) one flat parameter holds a whole wrapped block, frozen weights included.
    flat_params: bool = False
    # FSDP1 with backward_prefetch=None: torch 1.12's default, which accelerate 0.7 passed on unless its plugin was
    # told otherwise. The next unit's all-gather is then issued after the current unit's reduce-scatter, on the
    # same NCCL stream, so a FULL_SHARD backward waits for both (plan/comms.py `exposed_collectives`).
    fsdp1_no_backward_prefetch: bool = False
    # DeepSpeed ZeRO-3 before v0.6.0: every submodule's parameters are all-gathered one tensor at a time and the
    # host then calls torch.cuda.synchronize(), so compute, the host's launches and the collectives take turns
    # (plan/comms.py `exposed_collectives`). shardfit's FSDP2 prefetches instead.
    zero3_sync_fetch: bool = False
    # FSDP1 (FullyShardedDataParallel) ran the published zero2/zero3 run, blocks wrapped with use_orig_params=True
    # (Lightning Fabric, Composer, accelerate): its hooks cost the host more per block than FSDP2's
    # (plan/dispatch.py ENGINE_HOST_S). shardfit's own runs are FSDP2.
    fsdp1: bool = False
    # ... and each wrapped block's one flat parameter holds its LoRA adapters beside its frozen weights, as Lightning
    # Fabric's FSDPStrategy wraps a Block (use_orig_params=True permits mixed requires_grad): every block's flat
    # gradient then spans its frozen weights (plan/fsdp1_grads.py). Not under the tools built on transformers'
    # Trainer (HF Trainer, TRL, axolotl, LLaMA-Factory, ms-swift): for a LoRA model the Trainer swaps in peft's
    # fsdp_auto_wrap_policy, which wraps every module with a trainable weight (each adapter matrix) as its own unit.
    fsdp1_mixed_units: bool = False
    # The LM head as its own copy of the embedding even where the checkpoint ties them: litgpt's GPT has no tying
    # at the commits its config-hub tables ran (scripts/convert_hf_checkpoint.py copies wte into lm_head).
    untied_head: bool = False
    # QLoRA's 4-bit block scales quantized again to 8 bits (the QLoRA paper's double quantization, shardfit's
    # layout); False: bitsandbytes' plain `nf4`, one fp32 absmax per block of 64 weights.
    double_quant: bool = True
    # QLoRA through Lightning's BitsandbytesPrecision (litgpt's `--quantize bnb.*`): every nn.Linear, the LM head
    # included, becomes a bitsandbytes Linear4bit quantized from an fp16 copy, so bitsandbytes dequantizes each
    # weight to fp16 and MatMul4Bit casts it to the compute dtype for every matmul (plan/estimate.py
    # `bnb_dequantize_bytes`). shardfit's QLoRA is torchao's NF4 with a 16-bit head.
    bnb_precision: bool = False
    # bitsandbytes before 0.43.2 ran Lightning's plugin (`bnb_precision`): its MatMul4Bit.forward kept each 4-bit
    # linear's input whenever that input needed a gradient (`ctx.tensors = (A, B)`, bitsandbytes/autograd/
    # _functions.py 0.39-0.43.1) although its backward never reads it, until bitsandbytes-foundation/bitsandbytes
    # PR #1270 (0.43.2, Jul 2024) dropped it (plan/activations.py `bnb_kept_input_bytes_per_token`). litgpt's `all`
    # extra pinned bitsandbytes 0.42.0 from Mar to Dec 2024 (0.41.x before); since Dec 2024 (Lightning-AI/litgpt
    # PR #1893) it installs 0.44 or later on Linux, so a litgpt run of today keeps none, whatever its "only
    # supports v0.42.0" warning says. Counted under Lightning's plugin alone, the layout it was measured on:
    # transformers' Linear4bit casts each input to its compute dtype first, copies this count does not hold.
    bnb_keeps_inputs: bool = False
    # QLoRA's dequantizing library (QUANT_BACKENDS): its kernels and bytes per weight per use set the time of the
    # dequantization (plan/dequant.py `dequant_per_use`), and what one dequantization holds (plan/estimate.py
    # `dequantize_bytes`). Lightning's BitsandbytesPrecision (`bnb_precision`) is bitsandbytes whatever this says.
    quant_backend: str = "torchao"
    # bitsandbytes QLoRA computing in fp32: transformers' BitsAndBytesConfig without `bnb_4bit_compute_dtype`
    # (its default is torch.float32, transformers/utils/quantization_config.py). Without autocast the layers'
    # outputs, and so their gradients, are fp32, and MatMul4Bit's backward casts each dequantized 16-bit weight to
    # fp32 beside it (plan/estimate.py `bnb_dequantized_bytes`); under autocast the outputs are 16-bit.
    bnb_compute_fp32: bool = False
    # The job's transformers builds a mixture's routed experts as fused 3-D parameters (transformers 5, the default
    # and the installed one; gpt-oss's and Llama 4's classes in every version: ModelShape.experts_always_fused);
    # False: transformers 4's nn.Linear per expert. bitsandbytes' 4-bit loading replaces only nn.Linear (and
    # Conv1D) modules (transformers/integrations/bitsandbytes.py `replace_with_bnb_linear`), so fused stacks stay
    # unquantized, fp32 after prepare_model_for_kbit_training (plan/precision.py `experts_stay_16bit`, the one rule
    # the weights, activations and step time read: plan/dequant.py); foreign/read.py sets it from `--transformers`.
    fused_experts: bool = True
    # The tool quantizes fused expert stacks to 4 bits itself on load (axolotl's `quantize_moe_experts`).
    quantize_fused_experts: bool = False
    # AdamW from bitsandbytes (the tools' `adamw_bnb_8bit`, `adamw_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`):
    # its 32-bit states are fp32 whatever the trainable weights' dtype (bitsandbytes/optim/optimizer.py
    # `Optimizer2State.init_state`), where torch's AdamW keeps them in the weights' own (16-bit adapters').
    bnb_optimizer: bool = False
    # Whoever builds a bitsandbytes 8-bit optimizer registers the input embedding for 32-bit states
    # (GlobalOptimManager's `register_module_override`; bitsandbytes keeps none on its own, optimizer.py
    # `check_overrides`): the HF Trainer and the tools on it do (plan/optimizer_states.py `fp32_state_embedding`).
    # False: nothing does, so the embedding's states are 8-bit too: a hand-written loop that never calls it, and
    # axolotl's own param groups (embedding_lr, embedding_lr_scale, lr_groups), which register it only for
    # bitsandbytes' Adam8bit class, one no `optimizer` name builds.
    embedding_override: bool = True
    # axolotl's own param groups (`embedding_lr`, `embedding_lr_scale` or `lr_groups` set: its OptimizerMixin's
    # `create_optimizer_grouped_parameters`): the trained embedding and head (`embed_tokens`, `lm_head`, peft's
    # trained copies) stepped in a group of their own after the decay group's matrices; `lr_groups` more groups,
    # stepped last, of the matrices whose names hold a group's module names (plan/optimizer_states.py
    # `stepped_pairs`, where a step that loops over tensors peaks).
    embedding_group: bool = False
    lr_groups: int = 0
    # 8-bit AdamW from torchao (transformers' adamw_torch_8bit, axolotl's ao_adamw_8bit) rather than bitsandbytes':
    # its full-width fallback differs (plan/optimizer_states.py `fp32_state_params`).
    torchao_optimizer: bool = False
    # The planned `optimizer` is not what the job names but stands for it (foreign/common.py `optimizer_stand_in`:
    # GaLore, LOMO, APOLLO, GrokAdamW, StableAdamW planned as AdamW; torch's Adam as AdamW), or DeepSpeed builds it
    # from its JSON's optimizer section, which names no bitsandbytes kernel: the recommender offers no 8-bit form
    # of it (plan/plan.py `alternatives`), which would train with another optimizer than the job's.
    no_8bit_form: bool = False
    # The dtype of each of the optimizer's states (torch's names) where the job's settings choose them: AnyPrecision
    # AdamW's momentum_dtype, variance_dtype and, with Kahan summation, compensation_buffer_dtype (the HF Trainer's
    # optim_args). Empty: the optimizer's own (plan/optimizer_kinds.py `dtypes`, else `width`).
    optimizer_dtypes: tuple[str, ...] = ()
    # Vision-language models: images in each sample and each image's patch grid (rows and columns of 14-pixel
    # patches after the processor's resize, plan/media.py); the image tokens are counted within seq_len. A trainable
    # vision tower keeps its blocks' activations for backward; a frozen one (the default) keeps none.
    images: int = 0
    image_rows: int = 0
    image_cols: int = 0
    vision_trainable: bool = False
    # Models with an audio tower (Qwen2.5-Omni): clips in each sample and each clip's log-mel frames (100 a second,
    # plan/audio.py); their tokens are counted within seq_len. The clips' fp32 features stay through the step; a
    # trainable tower (freeze_audio_tower: false) also keeps its blocks' activations.
    audio_clips: int = 0
    audio_frames: int = 0
    audio_trainable: bool = False
    # What the run optimises (objective.py): a preference objective on pairs forwards both answers of each pair,
    # so a micro-batch of `micro_batch` pairs is 2 x micro_batch rows (`rows`); DPO and KTO also need the
    # reference's log-probabilities, as `precompute_reference` (auto | True | False) decides (`reference`).
    objective: str = "sft"
    precompute_reference: bool | str = "auto"
    # Every micro-batch one row of micro_batch x seq_len tokens, its examples side by side (data/static_shape.py):
    # a dense mask then spans the whole row (`row_len`); kernels that take the examples' boundaries do not care.
    static_shape: bool = False
    # The trained head's weight gradient as an fp32 matmul: shardfit's loss on a torch without addmm's out_dtype
    # (16-bit operands into an fp32 result, CUDA only); plan/timing.py `head_gradient_s`.
    head_grad_fp32: bool = False
    # Times per micro-batch the host waits for the device (a value read back, a data-dependent size): 0 on
    # shardfit's training path (tests/test_host_syncs.py); plan/dispatch.py `host_sync_s`.
    host_syncs: float = 0.0
    # AdamW's fused kernel, on plain tensors and FSDP2's DTensor shards alike (shardfit's runs, train/optim.py;
    # a tool's `adamw_torch_fused`): it steps in place. False: the multi-tensor (foreach) kernel torch picks by
    # default on a GPU, one copy of what it steps (plan/optimizer_states.py `foreach_temp_bytes`).
    fused_adamw: bool = False
    # How torch's optimizer walks the trainable tensors (the time model's decision, plan/optimizer_launches.py):
    # `foreach`, multi-tensor ops (torch's default on a GPU since 2.0); `for_loop`, one tensor at a time (torch's
    # foreach=False, its default before 2.0); `fused`, torch's fused kernel; `transformers`, transformers' own
    # AdamW (the HF Trainer's `adamw_hf`, its default before 4.32), a Python loop; `auto`, as the optimizer
    # decides (the fused kernel where `fused_adamw`, else foreach). Each launches its own ops once per step
    # (plan/step_ops.py); a Python loop copies no param group (`multi_tensor_step`).
    optimizer_loop: str = "auto"
    # Gradient clipping before each step (plan/step_ops.py): `foreach` (torch's default since 2.0), `per_tensor` (a
    # norm and a multiply per gradient, torch 1.10-1.13), `per_tensor_sync` (the same, the host waiting for the
    # device to decide whether to clip: torch before 1.10), `none`.
    grad_clip: str = "foreach"
    # zero_grad writes zeros into every gradient (set_to_none=False, torch's default before 2.0) instead of
    # dropping them: a fill per gradient each step (plan/step_ops.py).
    zero_grad_zeros: bool = False
    # peft casts each fp32 adapter's input to fp32 first, which autocast casts back to 16 bits and keeps for the
    # adapter's backward: a 16-bit copy of the input of every adapted layer (peft's default; the HF Trainer, TRL,
    # LLaMA-Factory). shardfit's own runs under autocast switch the cast off (models/adapters.py
    # `skip_adapter_input_casts`): the adapters read the base layer's 16-bit input, saved once for both.
    adapter_input_casts: bool = True
    # The decoder blocks' linear layers as torchao's Float8Linear (`float8: true`): their matmuls at the card's FP8
    # rate, plus the casts to FP8 (plan/flops.py `float8_s`).
    float8: bool = False
    # The Gated DeltaNet kernel of Qwen3.5's and Qwen3-Next's linear-attention blocks (kernels.py
    # `delta_rule_kernel`, what is installed where the plan runs): `fla`, flash-linear-attention's fused kernel, or
    # `torch`, transformers' fallback, which saves the chunks' fp32 tensors (plan/activations.py
    # `deltanet_saved_bytes_per_token`) and dispatches its ops chunk by chunk (plan/dispatch.py `host_dispatch_s`).
    delta_rule: str = dataclasses.field(default_factory=delta_rule_kernel)
    # The Mamba-2 scan of Nemotron-H's mixer blocks (kernels.py `mamba_kernel`): `mamba_ssm`'s fused kernel, or
    # `torch`, transformers' reference scan, which saves the chunks' fp32 tensors (plan/activations.py
    # `mamba_saved_bytes_per_token`).
    mamba_scan: str = dataclasses.field(default_factory=mamba_kernel)
    # The fused kernel taken for GPUs other than the planning machine's (`for_target`), not found installed: the
    # plan's note gives the torch fallback's figure beside it.
    mamba_scan_assumed: bool = False
    # Evaluation while training under transformers' Trainer (plan/evaluation.py): rows of each eval forward on
    # every rank (per_device_eval_batch_size, or the tool's key `eval_batch_key`); 0: the job does not evaluate
    # while it trains. shardfit's own evaluation runs the training micro-batch without gradients through its
    # chunked loss, below the training step's forward, so its configs leave it 0.
    eval_batch: int = 0
    eval_batch_key: str = "per_device_eval_batch_size"
    # The Trainer gathers every eval step's logits and keeps them on the GPU (a compute_metrics without a
    # preprocess_logits_for_metrics that reduces them, prediction_loss_only off, no generation) ...
    eval_keeps_logits: bool = False
    # ... until eval_accumulation_steps steps have gathered, then moves them to the CPU; 0 (unset): the whole
    # eval set's stay until evaluation ends.
    eval_accumulation: int = 0
    # Examples in the eval set where the job says (it bounds the eval steps kept); 0: not known.
    eval_examples: int = 0
    # Each kept step's logits join the earlier ones by torch.cat (eval_do_concat_batches, default true: old and new
    # at once); false appends them to a list.
    eval_concat: bool = True

    @property
    def bnb(self) -> bool:
        """QLoRA's weights dequantized by bitsandbytes (`quant_backend: bnb`, or Lightning's plugin)."""
        return self.method == "qlora" and (self.quant_backend == "bnb" or self.bnb_precision)

    def on_shardfits_engine(self) -> Workload:
        """The same training on shardfit's own engine (FSDP2, prefetching): the settings that describe another
        engine's sharding (FSDP1's flat parameters, no_sync, no backward prefetch; old ZeRO-3's fetches) off. A
        plan of another tool's job (`plan --from`) compares shardfit's strategies on this workload."""
        return replace(self, fsdp1=False, flat_params=False, fsdp1_no_sync=False, fsdp1_no_backward_prefetch=False,
                       zero3_sync_fetch=False)

    @property
    def runs_fsdp1(self) -> bool:
        """Whether FSDP1 (FullyShardedDataParallel) ran the published sharded run: `fsdp1`, or `flat_params`, which
        is FSDP1's use_orig_params=False (FSDP2 shards each parameter and has no flat parameters)."""
        return self.fsdp1 or self.flat_params

    @property
    def multi_tensor_step(self) -> bool:
        """The optimizer stepped by one of torch's multi-tensor kernels (`foreach`, torch's default on a GPU), which
        allocate copies of what they step (plan/optimizer_states.py `foreach_temp_bytes`): AdamW, Adagrad, RMSprop
        and schedule-free AdamW's; a fused kernel (`fused_adamw`), 8-bit and bitsandbytes' optimizers do not, nor a
        loop over the tensors one at a time or a fused kernel (`optimizer_loop`: torch before 2.0, adamw_hf)."""
        in_place = self.optimizer_loop in ("for_loop", "transformers", "fused")
        return OPTIMIZER_KINDS[self.optimizer].group_copies > 0 and not self.fused_adamw and not in_place

    @property
    def fp32_matmuls_tf32(self) -> bool:
        """Whether the run's fp32 matmuls use TF32 (where the card has it: plan/cards.py `fp32_matmul_flops`), the
        one rule of every fp32 matmul the step time counts. In shardfit's trainer, which sets it for every 16-bit
        run (parallel/env.py `fast_fp32_matmuls`): the run whose loss computes the head's gradient as an fp32
        matmul (`head_grad_fp32`, shardfit's own loss). Else as the HF Trainer sets it: the job's `tf32` where it
        gives one, else on under `torch_compile` unless fp16 alone is on (transformers' training_args.py
        `__post_init__`, its TF32 step: `tf32 is None and not fp16 or bf16` enables it for a compiled run, an
        explicit `tf32` then wins)."""
        if self.head_grad_fp32 and self.precision in ("bf16", "fp16"):
            return True
        return self.tf32 if self.tf32 is not None else self.compile and self.precision != "fp16"

    @property
    def trains_adapters(self) -> bool:
        """LoRA or QLoRA: low-rank adapters train while the base weights stay frozen."""
        return methods.get(self.method).adapters

    def trained_blocks(self, layers: int) -> list[int]:
        """Under `freeze`, the indices of the decoder blocks that train, of `layers` blocks."""
        ids = sorted({i for i in self.freeze_blocks if 0 <= i < layers})
        return ids or list(range(max(0, layers - 2), layers))

    @property
    def rows(self) -> int:
        """Sequences one micro-batch forwards: `micro_batch` examples, each one sequence, or two for a pair
        (chosen and rejected, each up to seq_len tokens: the prompt's tokens are in both)."""
        return self.micro_batch * objectives.get(self.objective).sequences

    @property
    def tokens(self) -> int:
        """Tokens one rank forwards in a micro-batch at its largest: every row full to seq_len, a 1/N slice of each
        under sequence parallelism. Every activation, logits and FLOPs count of the plan is per these tokens (the
        attention's own terms per token read the whole row's seq_len: a rank attends over all of it)."""
        return -(-self.seq_len * self.rows // self.sequence_parallel)

    @property
    def row_len(self) -> int:
        """Tokens in one row of a micro-batch, what a dense attention mask spans: seq_len, or the micro-batch's
        rows side by side under `static_shape`."""
        return self.seq_len * (self.rows if self.static_shape else 1)

    @property
    def reference(self) -> str | None:
        """How the run gets its reference log-probabilities: "adapters_off" (a forward without gradients inside
        every micro-batch), "precomputed" (one such forward over the data before the first step) or None."""
        return objectives.reference_of(self.objective, self.trains_adapters, self.precompute_reference)


def workload_of(cfg: Config) -> Workload:
    """What the planner needs of a training config."""
    return Workload(method=cfg.method, precision=cfg.precision, seq_len=cfg.max_seq_len, micro_batch=cfg.micro_batch,
                    grad_ckpt=cfg.grad_ckpt, optimizer="adamw", lora_rank=cfg.lora.rank,
                    attention=ATTENTION_MEMORY.get(cfg.attn_implementation, "sdpa"), grad_accum=cfg.grad_accum,
                    # `compile: auto` is decided at train time; planning it as eager errs on the large side.
                    compile=cfg.compile is True or cfg.compile == "true",
                    lora_targets=lora_targets_of(cfg.lora.targets), lora_dropout=cfg.lora.dropout,
                    lora_experts=cfg.lora.experts, lora_all_experts=cfg.lora.experts,
                    freeze_blocks=blocks_named(cfg.freeze_trainable),
                    loss_chunk=0 if cfg.loss_chunk == "auto" else int(cfg.loss_chunk),
                    vision_trainable=not cfg.freeze_vision_tower, audio_trainable=not cfg.freeze_audio_tower,
                    objective=cfg.objective, precompute_reference=cfg.dpo.precompute_reference,
                    sequence_parallel=cfg.sequence_parallel, quant_backend="torchao",
                    expert_parallel=cfg.expert_parallel,
                    # `static_shape: auto` is decided at train time (resolve/decide.py plans the decided value).
                    static_shape=cfg.static_shape is True, head_grad_fp32=not widening_matmul_in_torch(),
                    fused_adamw=True, adapter_input_casts=False, float8=cfg.float8,
                    # `lora.dtype: bf16`: adapters, their gradients and states in bf16 (resolve/decide.py keeps
                    # them fp32 under FSDP2, which already computes them in bf16; the rows there count them bf16)
                    adapters_16bit=cfg.lora.dtype == "bf16", tool_autocast=False)


# What `shardfit plan --model` and the UI's plan page change of a default config: the workload users of other tools
# run by default (LLaMA-Factory, TRL and ms-swift checkpoint), on shardfit's own kernels (`workload_of`).
MODEL_DEFAULT = {"grad_ckpt": "full"}


def model_workload() -> Workload:
    """The workload planned for a model named without a config: a default config's, with MODEL_DEFAULT."""
    return dataclasses.replace(workload_of(Config()), **MODEL_DEFAULT)


def blocks_named(patterns: list[str]) -> tuple[int, ...]:
    """The decoder block indices `freeze_trainable` names (`layers.11`, `model.layers.11.mlp`: the whole block is
    counted); a glob or a module outside the blocks names none, and then the planner counts the last two."""
    hits = (re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", p) for p in patterns)
    return tuple(sorted({int(m.group(1)) for m in hits if m}))


def lora_targets_of(targets: str | list[str]) -> tuple[str, ...] | None:
    """A config's `lora.targets` as LORA_TARGETS names (`q_proj` -> `q`, `o_proj` -> `o`); None for all-linear or
    for module names the planner does not know (it then counts every projection, the larger estimate). A string
    other than all-linear is a regular expression over module names, as peft reads it: the projections whose
    names it matches in full."""
    if isinstance(targets, str):
        return None if targets == "all-linear" else regex_targets(targets)
    names = tuple(t.split(".")[-1].removesuffix("_proj") for t in targets)
    return names if names and all(n in LORA_TARGETS for n in names) else None


# Where a decoder block's projections sit in transformers' models (text, and the language model of a
# vision-language one), and some block numbers: what a regular expression of targets is tried against.
_BLOCK_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers", "model.model.layers",
                "transformer.layers", "layers")
_BLOCK_NUMBERS = ("0", "1", "7", "10", "15", "31", "63")


def regex_targets(pattern: str) -> tuple[str, ...] | None:
    """The LORA_TARGETS projections that `pattern` matches in full under any block of any of _BLOCK_PATHS (a
    pattern that reaches some blocks only is counted on every block: the larger estimate); None when it is no
    regular expression or matches none of them (names the planner does not know)."""
    try:
        rx = re.compile(pattern)
    except re.error:
        return None
    found = set()
    for name in LORA_TARGETS:
        parent = "self_attn" if name in ("q", "k", "v", "o") else "mlp"
        if any(rx.fullmatch(f"{path}.{i}.{parent}.{name}_proj") for path in _BLOCK_PATHS for i in _BLOCK_NUMBERS):
            found.add(name)
    return tuple(n for n in LORA_TARGETS if n in found) or None


def for_target(w: Workload, mamba_blocks: int, elsewhere: Callable[[], bool]) -> Workload:
    """The workload as the job's own machine runs it, where the model has Mamba blocks (`mamba_blocks`, ModelShape
    `mamba_blocks`) and the plan is for GPUs other than this machine's (`elsewhere()`: GPUs named, and no CUDA
    here or other cards; asked only for a Mamba model, as it may load torch): mamba_ssm's fused scan, what the
    model cards have a GPU user install, in place of the torch fallback this machine would run. On the GPU
    machine itself (and for train and check, which run where the job runs) the probe's answer stands."""
    if mamba_blocks <= 0 or w.mamba_scan != "torch" or not elsewhere():
        return w
    return dataclasses.replace(w, mamba_scan="mamba_ssm", mamba_scan_assumed=True)
