"""What each tool does to a 4-bit (QLoRA) model's dtypes after loading it, which the job file does not spell out:
whether the frozen weights outside the 4-bit layers stay fp32 after peft's prepare_model_for_kbit_training, and
the dtype the adapters train in. Shared by the readers (axolotl, TRL scripts, ms-swift) so one rule per tool. And
the dtype TRL's ModelConfig loads a LoRA or full run in (`trl_loaded`)."""

from __future__ import annotations

import dataclasses

from shardfit.errors import UserError
from shardfit.foreign.common import major_minor
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.precision import experts_stay_16bit
from shardfit.plan.workload import Workload

# TRL's trainers that, for a 4-bit or 8-bit model, skip prepare_model_for_kbit_training and cast every trainable
# parameter (adapters, modules_to_save copies) to bf16 after get_peft_model (trl 1.16 trainer/*_trainer.py,
# `_is_quantized_model`): SFT from 0.26, DPO from 0.29, KTO from 1.4 (trl 1.3's experimental KTO trainer still
# prepared), and trainer/distillation_trainer.py as 1.16 ships it (the version planned, whatever later TRL does).
TRL_BF16_TRAINERS = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "RewardTrainer",
                     "DistillationTrainer")
# TRL's experimental trainers that still call peft's prepare_model_for_kbit_training, then under bf16 cast the
# embeddings and head back to bf16 (trl 1.16 experimental/utils.py `peft_module_casting_to_bf16`; norms stay fp32).
TRL_PREPARING_TRAINERS = ("ORPOTrainer", "CPOTrainer")
# TRL's ModelConfig --dtype choices; float32 is its default (trl 1.16 trainer/model_config.py).
TRL_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The engines that keep a full fine-tune's trainable weights in fp32 whatever dtype loaded them: DeepSpeed's ZeRO
# steps fp32 masters; accelerate's FSDP upcasts 16-bit trainable parameters to fp32 under mixed precision
# (utils/fsdp_utils.py `fsdp2_prepare_model`, accelerator.py `prepare_model` for FSDP1).
FP32_MASTER_ENGINES = ("deepspeed", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_offload")
# What --dtype does to each method's weights, as the key's effect.
TRL_DTYPE_EFFECT = {"qlora": "frozen weights loaded, and 4-bit layers computing, in it",
                    "lora": "frozen weights loaded in it", "full": "weights loaded in it"}
# ms-swift's --bnb_4bit_compute_dtype values (swift/arguments/base_args/quant_args.py), as bytes-relevant names.
SWIFT_COMPUTE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def experts_left_fp32(shape: ModelShape, w: Workload, version: str) -> bool:
    """Whether peft's prepare_model_for_kbit_training leaves routed expert stacks in fp32 that a tool's cast of
    the embeddings, norms and head back to the compute dtype does not reach: the stacks bitsandbytes leaves
    unquantized under transformers `version` (plan/precision.py `experts_stay_16bit`; foreign/read.py sets
    `fused_experts` from the same version after the reader)."""
    return experts_stay_16bit(shape, dataclasses.replace(w, fused_experts=major_minor(version) >= (5, 0)))


def cast_back(w: Workload, shape: ModelShape, version: str, tool: str) -> tuple[Workload, str]:
    """A tool that runs prepare_model_for_kbit_training and then casts the embeddings, norms (or not) and head back
    to the compute dtype (axolotl; TRL's ORPO and CPO under bf16): the frozen weights are 16-bit again but for the
    expert stacks bitsandbytes left unquantized. shardfit's one switch (`frozen_fp32`) is planned on only where
    those stacks exist (their fp32 bytes dwarf the embeddings'); returns the workload and the note saying so."""
    if experts_left_fp32(shape, w, version):
        return dataclasses.replace(w, frozen_fp32=True), (
            f"{tool} casts the embeddings and head back to {w.precision} after peft's prepare_model_for_kbit_training, "
            "but the routed experts bitsandbytes leaves unquantized stay fp32: planned with fp32 frozen weights "
            "(the embeddings, norms and head too: a small over-estimate)")
    return dataclasses.replace(w, frozen_fp32=False), (
        f"{tool} casts the embeddings, norms and head back to {w.precision} after peft's "
        f"prepare_model_for_kbit_training: frozen weights planned in {w.precision}")


def trl_kbit(w: Workload, trainer: str | None, prepares: bool, shape: ModelShape, version: str,
             loaded: tuple[str, str] | None = None) -> tuple[Workload, str | None]:
    """A QLoRA job a TRL trainer runs (`trainer`, the class the script builds; `prepares`: the script calls
    prepare_model_for_kbit_training itself; `loaded`: TRL's ModelConfig `--dtype` and where it is read, when the
    script parses one), as TRL 1.16 (the version shardfit's bench pins) runs it. The trainers of TRL_BF16_TRAINERS
    skip the preparation and cast every trainable parameter to bf16: 16-bit adapters and saved copies, frozen
    weights as loaded unless the script prepared the model itself. Returns the workload and a note naming the
    version and what older TRL did; `w` and None for a job no TRL trainer runs."""
    if w.method != "qlora" or trainer is None:
        return w, None
    if trainer in TRL_PREPARING_TRAINERS:
        if w.precision != "bf16":
            return w, None  # peft's preparation, no cast back: as for a Trainer script
        w, note = cast_back(w, shape, version, f"TRL's {trainer} (trl 1.16, experimental)")
        return w, note + " (norms stay fp32, planned as the rest)"
    if trainer not in TRL_BF16_TRAINERS:
        return w, None
    fp32_load = loaded is not None and _model_config_dtype(*loaded) == "float32"
    w = dataclasses.replace(w, frozen_fp32=prepares or fp32_load, adapters_16bit=True, lora_saved_dtype="trainable",
                            bnb_compute_fp32=w.bnb_compute_fp32 or fp32_load)
    kept = ("fp32 where the script's own prepare_model_for_kbit_training upcast them" if prepares
            else "fp32 as loaded (ModelConfig --dtype float32, its default; the 4-bit layers compute in fp32 too: "
            "--dtype bfloat16 halves them)" if fp32_load
            else f"as loaded ({w.precision}), as TRL no longer calls prepare_model_for_kbit_training")
    return w, (f"TRL's {trainer} on a 4-bit model (trl 1.16; SFT since 0.26, DPO since 0.29, KTO since 1.4) casts "
               f"every trainable parameter to bf16: adapters and saved copies planned in 16 bits, frozen weights "
               f"{kept}; bf16 under bf16 false too, as the cast reads neither flag. Older TRL prepared the model "
               f"(fp32 embeddings, norms, head, adapters and saved copies): "
               f"plan such a run with --frozen-fp32, which plans all of those in fp32")


def trl_loaded(w: Workload, engine: str, loaded: tuple[str, str] | None) -> tuple[Workload, str | None]:
    """A LoRA or full run of TRL's scripts (trl 1.16 scripts/sft.py, dpo.py, ...: `model_init_kwargs` with
    `dtype=model_args.dtype`, which create_model_from_path passes to from_pretrained), loaded in ModelConfig's
    `--dtype` (`loaded`: the value, float32 by default, and where it is given; None where no ModelConfig parses the
    job). Under 16-bit autocast an fp32 load keeps LoRA's frozen weights fp32 (`loaded_fp32`; DeepSpeed casts them
    back) and a full fine-tune's fp32 masters (as planned); a 16-bit load leaves a full fine-tune no fp32 copy
    (`pure_16bit`) where accelerate's FSDP or DeepSpeed does not keep one. Without autocast the layers compute in
    the loaded dtype. Returns the workload and a note; `w` and None for a job without ModelConfig or QLoRA's
    (`trl_kbit`)."""
    if loaded is None or w.method not in ("lora", "full"):
        return w, None
    dtype = _model_config_dtype(*loaded)
    said = f"TRL's ModelConfig --dtype {dtype} (trl 1.16; float32 unless given) loads the model"
    if dtype == "float32":
        if w.precision == "fp32" or w.method == "full":
            return w, None if w.precision == "fp32" else f"{said} in fp32: fp32 master weights, as planned"
        if engine == "deepspeed":
            return w, f"{said} in fp32; DeepSpeed casts the frozen weights to {w.precision} at initialize"
        return dataclasses.replace(w, frozen_fp32=True, loaded_fp32=True), (
            f"{said} in fp32: every frozen weight planned in fp32, {w.precision} autocast casting each per matmul "
            f"(--dtype bfloat16 halves them)")
    low = "fp16" if dtype == "float16" else "bf16"
    auto = " (auto: the checkpoint's dtype, taken as bf16; an fp32 checkpoint plans as --dtype float32)" \
        if dtype == "auto" else ""
    if w.precision != "fp32":
        if w.method == "lora":
            return w, None
        if engine in FP32_MASTER_ENGINES:
            return w, f"{said} in {low}{auto}; the {engine} engine keeps fp32 masters of the trained weights"
        return dataclasses.replace(w, pure_16bit=True), (
            f"{said} in {low}{auto}: no fp32 masters, weights, gradients and AdamW states planned in {low} "
            f"(autocast over them casts nothing)")
    if engine == "deepspeed":
        return w, None
    return dataclasses.replace(w, precision=low, pure_16bit=w.method == "full"), (
        f"{said} in {low}{auto} and neither bf16 nor fp16 is on: the layers compute in {low}, planned as a {low} "
        f"run" + (" with fp32 adapters (peft upcasts them)" if w.method == "lora" else " with no fp32 masters"))


def _model_config_dtype(value: str, where: str) -> str:
    """TRL's ModelConfig `--dtype` (trl 1.16 trainer/model_config.py: auto, bfloat16, float16, float32), which
    loads the model and sets the 4-bit compute dtype; a UserError for another, which TRL's parser refuses."""
    dtype = str(value).strip().lower()
    if dtype not in TRL_DTYPES:
        raise UserError(f"{where}: --dtype {value}: TRL's ModelConfig takes {', '.join(TRL_DTYPES)}; use one of "
                        f"those (bfloat16 for a bf16 run).")
    return dtype


def swift_compute_fp32(value: str | None, precision: str, where: str) -> bool:
    """ms-swift's 4-bit compute dtype is fp32: `--bnb_4bit_compute_dtype float32`, or unset (or None) under a
    float16 or float32 `--torch_dtype` (ms-swift 3.0 to 4.x quant_args.py `__post_init__`: bfloat16 only under a
    bfloat16 one). A UserError naming the key for a value ms-swift's argument parser refuses."""
    if value is None or str(value).strip().lower() == "none":
        return precision in ("fp16", "fp32")
    chosen = SWIFT_COMPUTE.get(str(value).strip().lower())
    if chosen is None:
        raise UserError(f"{where}: --bnb_4bit_compute_dtype {value}: ms-swift takes {', '.join(SWIFT_COMPUTE)} "
                        f"(or leave it unset to follow --torch_dtype); use one of those.")
    return chosen == "fp32"
