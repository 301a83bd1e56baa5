"""What each HF Trainer argument means to shardfit: the TrainingArguments key table with its environment
variables, the launcher's words for the plan's advice, and the LoRA targets and every key's effect, planned and
recorded."""

from __future__ import annotations

import ast
import re
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import TRAINER_NO_EFFECT, as_float, as_int, eight_bit_words, optimizer
from shardfit.foreign.hf_seq import ALL_SEQ_KEYS
from shardfit.foreign.job import ForeignJob, Words
from shardfit.foreign.kbit import LOAD_DTYPE_KEYS, TRL_DTYPE_EFFECT
from shardfit.foreign.keys import HF_TRAINER, TF32, TORCH_COMPILE, Key, Source, file_keys, key_table
from shardfit.foreign.targets import plan_peft_default, plan_saved, plan_targets, saved_names
from shardfit.foreign.trainer_eval import EVAL_KEYS
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload

# What each TrainingArguments (or training script) argument means to shardfit: the first sequence length given
# wins, then lora_r over lora_rank.
KEYS = key_table({
    "torch_compile": TORCH_COMPILE,
    "tf32": TF32,
    "use_lora": Key("{method}"), "q_lora": Key("4-bit NF4 frozen weights, fp32 embeddings/norms/head"),
    # TRL's ModelConfig (`trl_model_config`)
    "use_peft": Key("{method}"), "load_in_4bit": Key("4-bit NF4 frozen weights beside --use_peft"),
    "bf16": Key("{precision}"), "fp16": Key("{precision}"),
    **{k: Key("sequence length", field="seq_len", read=as_int, default=2048) for k in ALL_SEQ_KEYS},
    "per_device_train_batch_size": Key("micro-batch", field="micro_batch", read=as_int, default=8),
    "lora_r": Key("adapter size", field="lora_rank", read=as_int),
    "lora_rank": Key("adapter size", field="lora_rank", read=as_int),
    "gradient_accumulation_steps": Key("grad_accum", field="grad_accum", read=as_int, default=1),
    "gradient_checkpointing": Key("grad_ckpt {grad_ckpt}"), "gradient_checkpointing_kwargs": Key("reentrant or not"),
    # transformers 5.x's names for them, which win where given (`ckpt_key`)
    "activation_checkpointing": Key("grad_ckpt {grad_ckpt}"),
    "activation_checkpointing_kwargs": Key("reentrant or not"),
    "attn_implementation": Key("attention {attention}"), "use_liger_kernel": Key("fused loss"),
    "deepspeed": Key("ZeRO settings"), "fsdp": Key("FSDP"), "device_map": Key("placement"),
    "fsdp_config": Key("FSDP1 or FSDP2, sharding"),
    "ddp_find_unused_parameters": Key("DDP"), "optim": Key("{optimizer}"), "optim_args": Key("{optimizer}"),
    "model": Key("model"),
    # carried over to the shardfit config (LoRA's rank and dropout default by whether LoRA trains: hf.py
    # `_convert_keys`)
    "lora_alpha": Key(config="lora.alpha", read=as_int, default=16),
    "lora_dropout": Key(config="lora.dropout", read=as_float),
    **HF_TRAINER, **EVAL_KEYS,
    "ref_model": Key("reference model given to the trainer"),
    # the script's own argument, and peft's LoraConfig(target_modules=...) read in the script (`plan_file_keys`)
    "lora_target_modules": Key(config="lora.targets", read=lambda v, k, at: target_names(v, k, at, True)),
    "target_modules": Key(config="lora.targets", read=lambda v, k, at: target_names(v, k, at, False)),
}, no_effect=TRAINER_NO_EFFECT | {"beta", "loss_type", "label_smoothing", "precompute_ref_log_probs", "rpo_alpha",
                                  "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight"} | {
                                  "model_name_or_path", "data_path", "eval_data_path", "cache_dir",
                                  "lora_weight_path", "lora_bias", "use_fast_tokenizer"})
# The environment of the command line: what decides the ranks and GPUs; any other variable changes nothing the
# planner counts.
ENV = {"CUDA_VISIBLE_DEVICES": "GPUs", "WORLD_SIZE": "ranks", "NPROC_PER_NODE": "ranks", "GPUS_PER_NODE": "ranks"}
# Variables that change the memory a rank holds in ways the planner does not count: the caching allocator's
# settings (expandable_segments changes the fragmentation reserve) and NCCL's buffers and transports.
# accelerate's and FSDP's variables count where the plan builds a plugin from them (`Accelerate.env_read`); any
# other (or these where a launch's own settings win) is not modelled, never "no effect".
UNMODELLED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NCCL_", "ACCELERATE_", "FSDP_",
                  "PYTORCH_NO_CUDA_MEMORY_CACHING")


def words() -> Words:
    return Words(zero={"zero2": "--deepspeed ds_config_zero2.json", "zero3": "--deepspeed ds_config_zero3.json",
                       "zero3_offload": "--deepspeed ds_config_zero3_offload.json"},
                 keys={**eight_bit_words("--optim {}"), "fused_loss": "--use_liger_kernel True",
                       "grad_ckpt": "--gradient_checkpointing True", "micro_batch": "--per_device_train_batch_size 1 "
                       "with --gradient_accumulation_steps", "seq": "--model_max_length", "lora": "--use_lora True",
                       # Qwen's finetune.py quantizes only with --use_lora
                       "qlora": "--use_lora True --q_lora True (4-bit base weights)",
                       "device_map": "device_map=None (or {'': int(os.environ['LOCAL_RANK'])}) in from_pretrained "
                       "when WORLD_SIZE > 1", "model_parallel": "one process (python, no torchrun) with "
                       "device_map='auto'", "reentrant": "--gradient_checkpointing_kwargs "
                       "'{\"use_reentrant\": false}'", "quant_storage": "bnb_4bit_quant_storage=torch.bfloat16 in "
                       "BitsAndBytesConfig", "ref_precompute": "precompute_ref_log_probs=True in DPOConfig/KTOConfig "
                       "(--precompute_ref_log_probs True)", "eval_accumulation": "--eval_accumulation_steps 1",
                       "eval_batch": "--per_device_eval_batch_size"})


def target_names(value: Any, key: str, where: str, names: bool) -> str | list[str]:
    """LoRA's target modules as given: a JSON or Python list of module names, or text. A script's own argument
    (`names`, e.g. Qwen's `lora_target_modules: List[str]`) is module names, on the command line separated by
    spaces (HfArgumentParser's nargs) or commas; peft's `target_modules` as a string is one regular expression over
    module names, or all-linear."""
    text = str(value).strip()
    if text.startswith("["):
        try:
            items = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            items = None
        if not isinstance(items, list) or not items or not all(isinstance(t, str) for t in items):
            raise UserError(f"{where}: '{key}' is {text!r}; give module names (q_proj v_proj), not this.")
        return [t.strip() for t in items]
    if not names:
        return text
    parts = [t for t in re.split(r"[,\s]+", text) if t]
    if not parts:
        raise UserError(f"{where}: '{key}' is empty; give module names (q_proj v_proj) or leave it out.")
    return "all-linear" if parts == ["all-linear"] else parts


def plan_file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str,
               model_config: bool = False, load_key: str | None = None) -> None:
    """Plan the LoRA targets and modules_to_save given, and record every key's effect. Under TRL's ModelConfig
    (`model_config`, trl 1.16 `get_peft_config`), --use_peft without targets builds a LoraConfig without
    target_modules, so peft takes its default for the model's type, and one --lora_target_modules entry reaches
    peft as a string (ModelConfig's `__post_init__` unwraps a list of one), which peft reads as a regular
    expression over whole module names."""
    unplanned = {"optim"} if optimizer(src.get("optim", "adamw_torch")) is None else set()
    effects = {}
    if model_config:
        _plan_peft_default(src, job, w, shape, version)
    for key in ("lora_target_modules", "target_modules"):
        if key not in src:
            continue
        # no adapters train: the targets change nothing
        effect = _plan_target_key(src, job, key, shape, version, model_config) if w.trains_adapters else ""
        if effect:
            effects[key] = effect
        else:
            unplanned.add(key)
    # ModelConfig's --lora_modules_to_save goes to peft's modules_to_save (trl `get_peft_config`), as LF's,
    # axolotl's and ms-swift's do: planned alike
    saved = saved_names(src.get("lora_modules_to_save"))
    if saved and job.workload.trains_adapters:
        effect = plan_saved(job, "--lora_modules_to_save", saved)
        if effect:
            effects["lora_modules_to_save"] = effect
        else:
            unplanned.add("lora_modules_to_save")
    # foreign/kbit.py `job_load`, `trl_kbit`, `apply_load`; `load_key`: the argument that gave the load's dtype
    for key in (*(LOAD_DTYPE_KEYS if model_config else ()), *((load_key,) if load_key else ())):
        effects[key] = TRL_DTYPE_EFFECT.get(w.method, "")
    file_keys(job, src.items(), KEYS, job.workload, effects=effects, unplanned=unplanned)


def _plan_peft_default(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str) -> None:
    """TRL's ModelConfig with --use_peft and no targets: peft's default targets for the model's type, planned
    (`plan_peft_default`, whose note says them) and kept for the converted config."""
    if w.trains_adapters and src.flag("use_peft", "false") and \
            not {"lora_target_modules", "target_modules", "lora_target_parameters"} & set(src.values):
        _, targets = plan_peft_default(job, "--use_peft", shape, version)
        if targets:
            job.convert.setdefault("lora", {})["targets"] = targets


def _one_entry(src: Source, job: ForeignJob, key: str, model_config: bool) -> str | None:
    """The string peft gets where TRL's ModelConfig unwraps a --lora_target_modules of one entry (a regular
    expression over whole module names), with a note saying so; None where the targets reach peft as a list.
    argparse splits on spaces only, so `q_proj,v_proj` is that one entry whole, which no module name matches:
    exit 2 naming the fix."""
    raw = src.get(key)
    one_raw = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw if isinstance(raw, str) and \
        len(raw.split()) == 1 else None
    if not (model_config and key == "lora_target_modules" and isinstance(one_raw, str)):
        return None
    targets = one_raw.strip()
    if "," in targets:  # no module name holds a comma: peft raises "Target modules ... not found"
        raise UserError(f"{src.at(key)}: --lora_target_modules {targets} is one entry: TRL's ModelConfig "
                        f"hands peft one entry as this string, a regular expression over whole module "
                        f"names, and no name holds a comma, so peft raises \"Target modules {{'{targets}'}} "
                        f"not found in the base model\". Separate the names with spaces "
                        f"(--lora_target_modules {' '.join(targets.split(','))}).")
    job.notes.append(f"--lora_target_modules {targets}: TRL's ModelConfig hands peft one entry as a "
                     f"string, a regular expression over whole module names")
    return targets


def _plan_target_key(src: Source, job: ForeignJob, key: str, shape: ModelShape, version: str,
                     model_config: bool) -> str:
    """Plan the LoRA targets of `key` (`plan_targets`; all-linear: every linear layer) and return their effect,
    "" where not modelled. A pattern of one entry under TRL's ModelConfig (`_one_entry`) that peft would refuse
    says how to write it as whole names."""
    targets = KEYS[key].read(src.get(key), key, src.at(key))
    one = _one_entry(src, job, key, model_config)
    if one is not None:
        targets = one
    try:
        return "adapters on every linear layer" if targets == "all-linear" else \
            plan_targets(job, key, targets, shape, version)
    except UserError as e:
        if one is None:
            raise
        raise UserError(f"{e} TRL's ModelConfig hands peft a --lora_target_modules of one entry as this "
                        f"string, not as a list of one name: give a pattern of whole names "
                        f"('.*\\.{targets}').") from None
