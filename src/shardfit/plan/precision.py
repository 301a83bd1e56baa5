"""Bytes per element in a training step: the compute precision, the trainable weights' dtype, and where autocast
casts (what the planner's memory, activation and time models all read)."""

from __future__ import annotations

from shardfit import strategy as strategies
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload


def compute_bytes(w: Workload) -> int:
    """Bytes per element in the compute precision: 2 for bf16 and fp16, 4 for fp32."""
    return 4 if w.precision == "fp32" else 2


def trainable_bytes(w: Workload) -> int:
    """Bytes per element of the trainable weights and their gradients: fp32, except pure 16-bit training (every
    weight in the compute precision) and 16-bit LoRA adapters, 16-bit whatever the compute precision (TRL casts a
    k-bit model's adapters to bf16 in an fp32 run too)."""
    if w.pure_16bit:
        return compute_bytes(w)
    return 2 if w.adapters_16bit and w.trains_adapters else 4


def saved_copy_bytes(w: Workload) -> int:
    """Bytes per element of peft's trained copies of whole modules (`lora_saved`), of their gradients and of torch
    AdamW's states of them, in the dtype the tool leaves them in (`Workload.lora_saved_dtype`): as the adapters
    (`trainable_bytes`), or as the module was loaded (`frozen_weight_bytes`), fp16 cast to fp32."""
    if w.lora_saved_dtype == "trainable" or w.pure_16bit:
        return trainable_bytes(w)
    if w.lora_saved_dtype == "fp16_upcast" and w.precision == "fp16":
        return 4
    return frozen_weight_bytes(w)


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


def engine_casts_params(strategy: str) -> bool:
    """Whether the engine of `strategy` hands the step 16-bit copies of the parameters: FSDP (shardfit's FSDP2
    MixedPrecisionPolicy; accelerate's FSDP1/FSDP2 `MixedPrecision(param_dtype=bf16)` whenever it mixes precision)
    and DeepSpeed (timed and laid out as the sharded strategies; its engine casts the module,
    plan/deepspeed.py `as_deepspeed_runs`). A tool's accelerate still wraps the forward in autocast there, but over
    16-bit weights it casts nothing, so its copies, casts and fp32 weights are those of no autocast."""
    return not strategies.get(strategy).autocast


def runs_autocast(w: Workload, strategy: str) -> bool:
    """Low precision through autocast over fp32 weights, what the memory model and shardfit's runner
    (resolve/decide.py) read: not where the engine casts the parameters (`engine_casts_params`), nor in pure 16-bit
    training (nothing to cast), nor beside shardfit's own bf16 adapters, which take its place (not
    `Workload.tool_autocast`; a tool autocasts beside them, over 16-bit weights: nothing to copy)."""
    own_16bit_adapters = w.adapters_16bit and w.trains_adapters and not w.tool_autocast
    return w.precision != "fp32" and not engine_casts_params(strategy) and not w.pure_16bit and not own_16bit_adapters


def autocast_launches(w: Workload, strategy: str) -> bool:
    """Whether the host launches under autocast (plan/dispatch.py's op counts are keyed by it): shardfit's own
    runner exactly where `runs_autocast` (its FSDP2 casts the parameters and runs no autocast); a tool's engine
    wherever it mixes precision (`Workload.tool_autocast`): accelerate and Lightning keep autocast on under FSDP
    too (Lightning's bf16-mixed over fp32 parameters), and the measured rows behind the host's counts ran so."""
    if w.tool_autocast:
        return w.precision != "fp32" and not w.pure_16bit
    return runs_autocast(w, strategy)


def autocast_fp32_master(w: Workload, strategy: str) -> bool:
    """Full fine-tunes keep fp32 weights, cast by autocast on the fly unless FSDP casts them; so does a LoRA run
    whose model was loaded in fp32 (`loaded_fp32`), over its frozen weights."""
    return (w.method == "full" or w.loaded_fp32) and runs_autocast(w, strategy)


def residual_bytes(w: Workload, strategy: str) -> int:
    """Bytes per element of the residual stream: fp32 when autocast runs over an fp32 embedding (fp32 master
    weights, or `frozen_fp32`): the embedding output is fp32 and every residual add keeps it so; else the compute
    precision."""
    fp32_embedding = runs_autocast(w, strategy) and (w.method == "full" or w.frozen_fp32)
    return 4 if fp32_embedding else compute_bytes(w)


def linear_output_bytes(w: Workload, strategy: str) -> int:
    """Bytes per element of what a block's frozen base linears return: bitsandbytes' Linear4bit casts its output
    back to its input's dtype, so over QLoRA's fp32 residual stream (`frozen_fp32` under autocast) the
    projections' outputs, and the MLP's activation of them, are fp32 where autocast would make them 16-bit; other
    layers return the compute precision."""
    return residual_bytes(w, strategy) if w.bnb else compute_bytes(w)


def experts_stay_16bit(shape: ModelShape, w: Workload) -> bool:
    """Whether bitsandbytes QLoRA leaves a mixture's routed experts unquantized, in the dtype they are loaded in
    (fp32 after prepare_model_for_kbit_training: `frozen_weight_bytes`): transformers' 4-bit loading replaces only
    nn.Linear and Conv1D modules (integrations/bitsandbytes.py `replace_with_bnb_linear`, 5.23), so fused 3-D
    expert stacks (`Workload.fused_experts`, ModelShape.experts_always_fused) stay as they are (a real load of a
    Mixtral: q_proj a Params4bit, `experts.gate_up_proj` a bf16 Parameter), and the grouped experts compute in
    their dtype; unless the tool quantizes them itself (`quantize_fused_experts`). Llama 4's experts
    (`every_expert`) are unfused into an nn.Linear per expert for bitsandbytes first (quantizers/base.py
    MODULES_TO_PATCH_FOR_QUANTIZATION), so they are quantized. shardfit's torchao path quantizes the stacks itself
    (models/quantize_experts.py); Lightning's plugin (`bnb_precision`) runs litgpt's mixtures, an nn.Linear per
    expert."""
    return (shape.moe and w.method == "qlora" and w.quant_backend == "bnb" and not w.bnb_precision
            and not w.quantize_fused_experts and not shape.every_expert
            and (w.fused_experts or shape.experts_always_fused))


def frozen_weight_bytes(w: Workload) -> int:
    """Bytes per element of a frozen weight outside the 4-bit ones, as stored: the embeddings, norms and head, a
    mixture's router and the expert stacks bitsandbytes leaves unquantized (`experts_stay_16bit`). fp32 where
    peft's prepare_model_for_kbit_training upcasts every weight that is not 4-bit (`frozen_fp32`), else the 16-bit
    loading dtype. The one rule of the memory (plan/estimate.py), the pipeline's stages (plan/pipeline.py) and
    offload's copies (plan/comms.py `param_bytes_stored`)."""
    return 4 if w.frozen_fp32 or w.loaded_fp32 else compute_bytes(w)


def expert_matmul_bytes(w: Workload, strategy: str) -> int:
    """Bytes per element the grouped matmuls of bitsandbytes' unquantized expert stacks (`experts_stay_16bit`) run
    and keep their tensors in: the stored dtype (`frozen_weight_bytes`), except where the engine hands the step
    16-bit copies of the parameters (`engine_casts_params`: FSDP, DeepSpeed), whose matmul gets the compute dtype
    whatever peft upcast (measured on FSDP2 over the CPU: `_grouped_mm` in bf16)."""
    return compute_bytes(w) if engine_casts_params(strategy) else frozen_weight_bytes(w)


def experts_run_fp32(shape: ModelShape, w: Workload, strategy: str) -> bool:
    """Whether the routed experts' grouped matmuls run in fp32 in a 16-bit run under `strategy`: bitsandbytes'
    unquantized stacks (`experts_stay_16bit`) that peft upcast, where the engine does not hand the step 16-bit
    copies (`expert_matmul_bytes`). The one rule the time side (plan/flops.py `fp32_expert_flops`) reads, as the
    memory side reads `expert_matmul_bytes`."""
    return compute_bytes(w) != 4 and experts_stay_16bit(shape, w) and expert_matmul_bytes(w, strategy) == 4


def stored_nf4(name: str, shape: ModelShape, w: Workload) -> bool:
    """Whether the block's weight `name` (ModelShape.named_linears, stored_weights) is stored in NF4: the one
    rule the memory (plan/estimate.py `stored_linear_bytes`, `nf4_linear_bytes`, `nf4_weights`), the gathers and
    offload copies (plan/comms.py) and the dequantization's time (plan/dequant.py) read. False without QLoRA.
    Under Lightning's BitsandbytesPrecision (`bnb_precision`) every linear layer, litgpt's router among them (an
    nn.Linear there); else every linear weight and fused expert stack except the router (an nn.Parameter in
    every mixture of transformers 5, Qwen3MoeTopKRouter to DeepseekV3TopkRouter, which no 4-bit loading replaces)
    and the expert stacks bitsandbytes leaves alone (`experts_stay_16bit`)."""
    if w.method != "qlora":
        return False
    if w.bnb_precision:
        return True
    return name != "router" and not (name.startswith("expert_") and experts_stay_16bit(shape, w))
