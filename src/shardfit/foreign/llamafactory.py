"""A LLaMA-Factory training YAML (`llamafactory-cli train my.yaml`), read with LLaMA-Factory's defaults and memory
behaviour: gradient checkpointing on unless disabled, trainable weights upcast to fp32 unless `pure_bf16`, the
model's own loss (Liger's fused one with `use_liger_kernel`), data from `dataset_dir/dataset_info.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import (
    ATTENTION,
    TRAINER_NO_EFFECT,
    as_bool,
    as_float,
    as_int,
    check_bools,
    hf_loss,
    load_yaml,
    local_file,
    optimizer,
    parse_json,
    read_text,
    record_keys,
)
from shardfit.foreign.deepspeed import load_deepspeed
from shardfit.foreign.job import ForeignJob, Words
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

BOOLS = ("bf16", "fp16", "pure_bf16", "use_liger_kernel", "disable_gradient_checkpointing", "use_reentrant_gc",
         "ddp_find_unused_parameters", "freeze_vision_tower", "packing", "neat_packing", "trust_remote_code")
NO_EFFECT = TRAINER_NO_EFFECT | {
    "stage", "template", "max_samples", "overwrite_cache", "preprocessing_num_workers", "val_size", "eval_dataset",
    "lora_alpha", "lora_dropout", "additional_target", "loraplus_lr_ratio", "create_new_adapter", "mix_strategy",
    "streaming", "buffer_size", "tokenized_path", "default_system", "enable_thinking", "train_on_prompt",
    "mask_history", "finetuning_args", "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels",
    "video_fps", "video_maxlen", "export_dir", "export_size", "infer_backend", "adapter_name_or_path",
    "new_special_tokens", "resize_vocab", "use_fast_tokenizer", "split_special_tokens", "print_param_status",
    "freeze_multi_modal_projector", "cache_dir", "hf_hub_token", "ms_hub_token", "use_unsloth_gc",
    "dataset", "dataset_dir", "packing", "neat_packing", "trust_remote_code", "model_name_or_path",
}
# LLaMA-Factory's shipped DeepSpeed configs and how they are named.
ZERO_FILES = {"zero2": "examples/deepspeed/ds_z2_config.json", "zero3": "examples/deepspeed/ds_z3_config.json",
              "zero3_offload": "examples/deepspeed/ds_z3_offload_config.json",
              "zero2_offload": "examples/deepspeed/ds_z2_offload_config.json"}


def words() -> Words:
    return Words(zero={k: f"deepspeed: {v}" for k, v in ZERO_FILES.items()},
                 keys={"fused_loss": "use_liger_kernel: true",
                       "grad_ckpt": "disable_gradient_checkpointing: false (remove the key)",
                       "micro_batch": "per_device_train_batch_size: 1 with gradient_accumulation_steps",
                       "seq": "cutoff_len", "qlora": "quantization_bit: 4", "lora": "finetuning_type: lora",
                       "adamw8bit": "optim: adamw_8bit", "device_map": "(LLaMA-Factory places the model itself; do "
                       "not pass device_map under torchrun)", "launch": "FORCE_TORCHRUN=1 llamafactory-cli train",
                       "reentrant": "use_reentrant_gc: false"})


def read_llamafactory(path: Path, version: str, nproc: int | None, shape_of: Any) -> ForeignJob:
    """The job of a LLaMA-Factory YAML. `shape_of(model)` resolves the model's shape (for DeepSpeed's "auto"
    buckets and freeze layers); `nproc` the ranks it is launched with (LLaMA-Factory starts torchrun itself when
    several GPUs are visible)."""
    cfg, lines = load_yaml(path)
    where = str(path)

    def at(key: str) -> str:
        return f"{where}:{lines[key]}" if key in lines else where

    check_bools(cfg, BOOLS, at)
    model = cfg.get("model_name_or_path")
    if not model:
        raise UserError(f"{where}: no 'model_name_or_path'; LLaMA-Factory needs it, and shardfit plans from it.")
    shape = shape_of(str(model))
    job = ForeignJob("llamafactory", where, str(model), Workload(), words=words(), nproc=nproc)
    ft = str(cfg.get("finetuning_type", "lora")).lower()
    quant = cfg.get("quantization_bit")
    method = {"lora": "lora", "full": "full", "freeze": "freeze", "oft": "lora"}.get(ft)
    if method is None:
        raise UserError(f"{at('finetuning_type')}: 'finetuning_type' is {ft!r}; LLaMA-Factory's are lora, full, "
                        f"freeze (and oft).")
    if quant is not None:
        bits = as_int(quant, "quantization_bit", at("quantization_bit"))
        if method == "lora":
            method = "qlora"
        if bits != 4:
            job.notes.append(f"quantization_bit: {bits} is planned as 4-bit NF4 (the planner models 4-bit only): "
                             "an under-estimate of the frozen weights")
    pure = as_bool(cfg.get("pure_bf16", False))
    precision = "bf16" if as_bool(cfg.get("bf16", False)) or pure else "fp16" if as_bool(cfg.get("fp16", False)) \
        else "fp32"
    liger = as_bool(cfg.get("use_liger_kernel", False))
    attn = str(cfg.get("flash_attn", "auto")).lower()
    if attn not in ATTENTION:
        raise UserError(f"{at('flash_attn')}: 'flash_attn' is {attn!r}; LLaMA-Factory's are auto, disabled, sdpa, "
                        f"fa2.")
    attention = ATTENTION[attn]
    opt = optimizer(str(cfg.get("optim", "adamw_torch")))
    w = Workload(method=method, precision=precision, seq_len=as_int(cfg.get("cutoff_len", 2048), "cutoff_len",
                                                                    at("cutoff_len")),
                 micro_batch=as_int(cfg.get("per_device_train_batch_size", 1), "per_device_train_batch_size",
                                    at("per_device_train_batch_size")),
                 grad_ckpt="none" if as_bool(cfg.get("disable_gradient_checkpointing", False)) else "full",
                 optimizer=opt or "adamw", lora_rank=as_int(cfg.get("lora_rank", 8), "lora_rank", at("lora_rank")),
                 loss=hf_loss(version, liger), attention=attention,
                 grad_accum=as_int(cfg.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps",
                                   at("gradient_accumulation_steps")),
                 frozen_fp32=False, adapters_16bit=pure and method in ("lora", "qlora"))
    job.workload = w
    job.reentrant_ckpt = w.grad_ckpt != "none" and as_bool(cfg.get("use_reentrant_gc", True))
    job.find_unused = as_bool(cfg.get("ddp_find_unused_parameters", False))
    if "deepspeed" in cfg and cfg["deepspeed"]:
        ds = load_deepspeed(str(cfg["deepspeed"]), path.parent, at("deepspeed"), shape.hidden, job.notes)
        job.engine, job.zero = "deepspeed", ds.zero
        for k, v in ds.keys.items():
            job.keys[f"deepspeed:{k}"] = v
        for k, v in ds.not_modelled.items():
            job.not_modelled[f"deepspeed:{k}"] = v
    elif nproc and nproc > 1:
        job.engine = "ddp"
    job.quant_storage = method == "qlora" and job.engine == "deepspeed"  # LLaMA-Factory sets it under ZeRO-3
    job.speech_outputs = False  # LLaMA-Factory loads Qwen2.5-Omni's thinker only
    modelled = {
        "finetuning_type": method, "quantization_bit": "4-bit NF4 frozen weights", "pure_bf16": "16-bit adapters",
        "bf16": precision, "fp16": precision, "cutoff_len": "sequence length",
        "per_device_train_batch_size": "micro-batch", "gradient_accumulation_steps": "grad_accum",
        "disable_gradient_checkpointing": f"grad_ckpt {w.grad_ckpt}", "lora_rank": "adapter size",
        "use_liger_kernel": "fused linear cross-entropy: no full logits", "flash_attn": f"attention {attention}",
        "optim": w.optimizer, "deepspeed": "ZeRO settings", "use_reentrant_gc": "reentrant checkpointing",
        "ddp_find_unused_parameters": "DDP", "lora_target": "adapters on every linear layer (all)",
        "freeze_vision_tower": "vision tower frozen", "freeze_trainable_layers": "trainable blocks",
        "quantization_method": "bitsandbytes", "double_quantization": "NF4 constants",
    }
    unplanned = {"optim"} if opt is None else set()
    if "lora_target" in cfg and str(cfg["lora_target"]) != "all":
        unplanned.add("lora_target")
        job.notes.append("lora_target is not all: planned as adapters on every linear layer (an over-estimate)")
    if "freeze_vision_tower" in cfg:
        if method != "full":
            modelled["freeze_vision_tower"] = "frozen either way"
        elif not as_bool(cfg["freeze_vision_tower"]):
            unplanned.add("freeze_vision_tower")
    record_keys(job, cfg.items(), modelled=modelled, no_effect=NO_EFFECT, not_modelled=unplanned)
    job.data, missing = _datasets(cfg, path, at)
    if missing:
        job.notes.append(f"datasets not found as local files (convert leaves them out): {', '.join(missing)}")
    job.convert = _convert(cfg, job, shape, where, at)
    return job


def _datasets(cfg: dict[str, Any], path: Path, at: Any) -> tuple[list[str], list[str]]:
    """Local files of `dataset`, through dataset_info.json in `dataset_dir` (LLaMA-Factory's registry)."""
    names = [n.strip() for n in str(cfg.get("dataset", "")).split(",") if n.strip()]
    base = Path(str(cfg.get("dataset_dir", "data")))
    folders = [path.parent / base, base]
    info: dict[str, Any] = {}
    for folder in folders:
        f = folder / "dataset_info.json"
        if f.is_file():
            info = parse_json(read_text(f), str(f))
            folders = [folder]
            break
    found, missing = [], []
    for name in names:
        entry = info.get(name, {})
        file_name = entry.get("file_name") if isinstance(entry, dict) else None
        hit = local_file(file_name, *folders) if file_name else None
        if hit is None:
            hit = local_file(name, *folders) or next(
                (h for ext in (".json", ".jsonl") if (h := local_file(name + ext, *folders))), None)
        (found if hit else missing).append(hit or name)
    return found, missing


def _convert(cfg: dict[str, Any], job: ForeignJob, shape: ModelShape, where: str, at: Any) -> dict[str, Any]:
    """shardfit config keys of the same job (beyond the workload and the strategy)."""
    out: dict[str, Any] = {}
    if "learning_rate" in cfg:
        out["lr"] = as_float(cfg["learning_rate"], "learning_rate", at("learning_rate"))
    if "num_train_epochs" in cfg:
        out["epochs"] = max(1, round(as_float(cfg["num_train_epochs"], "num_train_epochs", at("num_train_epochs"))))
    for src, dst in (("max_steps", "max_steps"), ("save_steps", "save_steps"), ("eval_steps", "eval_steps"),
                     ("logging_steps", "log_steps"), ("seed", "seed")):
        if src in cfg and cfg[src] is not None and as_int(cfg[src], src, at(src)) > 0:
            out[dst] = as_int(cfg[src], src, at(src))
    for src, dst in (("warmup_ratio", "warmup_ratio"), ("weight_decay", "weight_decay"),
                     ("max_grad_norm", "max_grad_norm"), ("val_size", "eval_split")):
        if src in cfg:
            out[dst] = as_float(cfg[src], src, at(src))
    lora: dict[str, Any] = {"rank": job.workload.lora_rank}
    if "lora_alpha" in cfg:
        lora["alpha"] = as_int(cfg["lora_alpha"], "lora_alpha", at("lora_alpha"))
    else:
        lora["alpha"] = 2 * job.workload.lora_rank  # LLaMA-Factory's default: twice the rank
    if "lora_dropout" in cfg:
        lora["dropout"] = as_float(cfg["lora_dropout"], "lora_dropout", at("lora_dropout"))
    target = str(cfg.get("lora_target", "all"))
    lora["targets"] = "all-linear" if target == "all" else [t.strip() for t in target.split(",")]
    out["lora"] = lora
    out["packing"] = as_bool(cfg.get("packing", False)) or as_bool(cfg.get("neat_packing", False))
    if "output_dir" in cfg:
        out["output_dir"] = str(cfg["output_dir"])
    if as_bool(cfg.get("trust_remote_code", False)):
        out["trust_remote_code"] = True
    if job.workload.method == "freeze":
        n = as_int(cfg.get("freeze_trainable_layers", 2), "freeze_trainable_layers", at("freeze_trainable_layers"))
        layers = range(shape.layers - n, shape.layers) if n > 0 else range(-n)
        out["freeze_trainable"] = [f"layers.{i}." for i in layers]
    return out
