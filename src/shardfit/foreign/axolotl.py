"""An axolotl YAML (`axolotl train my.yml`, `accelerate launch -m axolotl.cli.train my.yml`), with axolotl's
memory behaviour: 4/8-bit models go through peft's prepare_model_for_kbit_training (fp32 embeddings, norms and
head), the Liger / Cut Cross-Entropy plugins fuse the loss, `fsdp` / `fsdp_config` shard with FSDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import (
    TRAINER_NO_EFFECT,
    Settings,
    as_bool,
    as_float,
    as_int,
    carry_settings,
    check_bools,
    hf_loss,
    load_yaml,
    local_file,
    optimizer,
    record_keys,
    take_deepspeed_keys,
)
from shardfit.foreign.deepspeed import load_deepspeed
from shardfit.foreign.job import ForeignJob, Words
from shardfit.plan.workload import Workload

SETTINGS: Settings = (
    ("learning_rate", "lr", as_float), ("warmup_ratio", "warmup_ratio", as_float),
    ("weight_decay", "weight_decay", as_float), ("max_grad_norm", "max_grad_norm", as_float),
    ("val_set_size", "eval_split", as_float), ("max_steps", "max_steps", as_int),
    ("logging_steps", "log_steps", as_int), ("seed", "seed", as_int),
    ("save_steps", "save_steps", as_int), ("eval_steps", "eval_steps", as_int))

BOOLS = ("load_in_4bit", "load_in_8bit", "fp16", "liger_fused_linear_cross_entropy", "cut_cross_entropy",
         "flash_attention", "flex_attention", "eager_attention", "ddp_find_unused_parameters", "lora_target_linear",
         "sample_packing", "trust_remote_code")
NO_EFFECT = TRAINER_NO_EFFECT | {
    "base_model", "model_type", "tokenizer_type", "strict", "datasets", "dataset_prepared_path", "val_set_size",
    "lora_alpha", "lora_dropout", "lora_model_dir", "lora_fan_in_fan_out", "wandb_project", "wandb_entity",
    "wandb_watch", "wandb_name", "wandb_log_model", "num_epochs", "lr_scheduler", "train_on_inputs",
    "early_stopping_patience", "evals_per_epoch", "saves_per_epoch", "debug", "special_tokens", "tokens",
    "chat_template", "sample_packing", "pad_to_sequence_len", "eval_sample_packing", "trust_remote_code", "plugins",
    "hub_strategy", "xformers_attention", "s2_attention", "eval_table_size", "eval_max_new_tokens",
    "shuffle_merged_datasets", "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model",
    "micro_batch_size", "optimizer", "sequence_len", "cosine_min_lr_ratio", "loss_watchdog_threshold",
    "loss_watchdog_patience", "bnb_4bit_quant_storage",
}


def words() -> Words:
    return Words(zero={"zero2": "deepspeed: deepspeed_configs/zero2.json",
                       "zero3": "deepspeed: deepspeed_configs/zero3_bf16.json",
                       "zero3_offload": "deepspeed: deepspeed_configs/zero3_bf16_cpuoffload_all.json"},
                 keys={"fused_loss": "plugins: [axolotl.integrations.liger.LigerPlugin] with "
                       "liger_fused_linear_cross_entropy: true",
                       "grad_ckpt": "gradient_checkpointing: true", "micro_batch": "micro_batch_size: 1 with "
                       "gradient_accumulation_steps", "seq": "sequence_len", "qlora": "adapter: qlora with "
                       "load_in_4bit: true", "lora": "adapter: lora", "adamw8bit": "optimizer: adamw_bnb_8bit",
                       "reentrant": "gradient_checkpointing_kwargs: {use_reentrant: false}",
                       "device_map": "drop device_map under accelerate launch"})


def read_axolotl(path: Path, shape_of: Any, version: str, nproc: int | None) -> ForeignJob:
    cfg, lines = load_yaml(path)
    where = str(path)

    def at(key: str) -> str:
        return f"{where}:{lines[key]}" if key in lines else where

    check_bools(cfg, BOOLS, at)
    model = cfg.get("base_model")
    if not model:
        raise UserError(f"{where}: no 'base_model'; axolotl needs it, and shardfit plans from it.")
    shape = shape_of(str(model))
    job = ForeignJob("axolotl", where, str(model), Workload(), words=words(), nproc=nproc)
    adapter = str(cfg.get("adapter") or "").lower()
    four, eight = as_bool(cfg.get("load_in_4bit", False)), as_bool(cfg.get("load_in_8bit", False))
    if adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or four or eight else "lora"
    elif adapter:
        raise UserError(f"{at('adapter')}: 'adapter' is {adapter!r}; axolotl's are lora and qlora (unset: full).")
    else:
        method = "full"
    if eight:
        job.notes.append("load_in_8bit planned as 4-bit NF4 (an under-estimate of the frozen weights)")
    bf16 = cfg.get("bf16", False)
    precision = "bf16" if bf16 == "auto" or as_bool(bf16) else "fp16" if as_bool(cfg.get("fp16", False)) else "fp32"
    plugins = " ".join(str(p) for p in cfg.get("plugins") or [])
    fused = (as_bool(cfg.get("liger_fused_linear_cross_entropy", False)) and "liger" in plugins.lower()) or (
        as_bool(cfg.get("cut_cross_entropy", False)))
    flash = as_bool(cfg.get("flash_attention", False)) or as_bool(cfg.get("flex_attention", False))
    attention = "flash" if flash else "eager" if as_bool(cfg.get("eager_attention", False)) else "sdpa"
    opt = optimizer(str(cfg.get("optimizer", "adamw_torch")))
    gc = cfg.get("gradient_checkpointing", False)
    w = Workload(method=method, precision=precision,
                 seq_len=as_int(cfg.get("sequence_len", 2048), "sequence_len", at("sequence_len")),
                 micro_batch=as_int(cfg.get("micro_batch_size", 1), "micro_batch_size", at("micro_batch_size")),
                 grad_ckpt="full" if gc == "unsloth" or as_bool(gc) else "none", optimizer=opt or "adamw",
                 lora_rank=as_int(cfg.get("lora_r", 8), "lora_r", at("lora_r")), loss=hf_loss(version, fused),
                 attention=attention,
                 grad_accum=as_int(cfg.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps",
                                   at("gradient_accumulation_steps")),
                 frozen_fp32=method == "qlora")
    job.workload = w
    kwargs = cfg.get("gradient_checkpointing_kwargs") or {}
    job.reentrant_ckpt = w.grad_ckpt != "none" and as_bool(kwargs.get("use_reentrant", True)) if isinstance(
        kwargs, dict) else w.grad_ckpt != "none"
    job.find_unused = as_bool(cfg.get("ddp_find_unused_parameters", False))
    fsdp = cfg.get("fsdp") or []
    fsdp = fsdp.split() if isinstance(fsdp, str) else [str(x) for x in fsdp]
    fsdp_cfg = cfg.get("fsdp_config") or {}
    if cfg.get("deepspeed"):
        ds = load_deepspeed(str(cfg["deepspeed"]), path.parent, at("deepspeed"), shape.hidden, job.notes)
        job.engine, job.zero = "deepspeed", ds.zero
        take_deepspeed_keys(job, ds.keys, ds.not_modelled)
    elif fsdp or fsdp_cfg:
        offload = as_bool(fsdp_cfg.get("fsdp_offload_params", False)) or "offload" in fsdp
        grad_op = "shard_grad_op" in fsdp or "SHARD_GRAD_OP" in str(fsdp_cfg.get("fsdp_sharding_strategy", ""))
        job.engine = "fsdp_offload" if offload else "fsdp_shard_grad_op" if grad_op else "fsdp_full_shard"
    elif nproc and nproc > 1:
        job.engine = "ddp"
    # axolotl stores 4-bit weights in the compute dtype itself when it shards them (FSDP, ZeRO-3)
    job.quant_storage = method == "qlora" and job.engine != "ddp"
    modelled = {"adapter": method, "load_in_4bit": "4-bit NF4", "load_in_8bit": "planned as 4-bit", "bf16": precision,
                "fp16": precision, "sequence_len": "sequence length", "micro_batch_size": "micro-batch",
                "gradient_accumulation_steps": "grad_accum", "gradient_checkpointing": f"grad_ckpt {w.grad_ckpt}",
                "gradient_checkpointing_kwargs": "reentrant or not", "lora_r": "adapter size",
                "lora_target_linear": "adapters on every linear layer", "flash_attention": f"attention {attention}",
                "sdp_attention": f"attention {attention}", "flex_attention": f"attention {attention}",
                "liger_fused_linear_cross_entropy": "fused loss", "cut_cross_entropy": "fused loss",
                "deepspeed": "ZeRO settings", "fsdp": "FSDP", "fsdp_config": "FSDP", "optimizer": w.optimizer,
                "ddp_find_unused_parameters": "DDP", "liger_rms_norm": "no effect on memory",
                "liger_glu_activation": "no effect on memory", "liger_rope": "no effect on memory",
                "liger_layer_norm": "no effect on memory", "bnb_4bit_quant_storage": "quantized storage"}
    unplanned = set()
    if "lora_target_modules" in cfg and not as_bool(cfg.get("lora_target_linear", False)):
        unplanned.add("lora_target_modules")
        job.notes.append("lora_target_modules without lora_target_linear: planned as adapters on every linear "
                         "layer (an over-estimate)")
    if opt is None:
        unplanned.add("optimizer")
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in cfg and not as_bool(cfg[key]):
            modelled[key] = "off"
    record_keys(job, cfg.items(), modelled=modelled, no_effect=NO_EFFECT, not_modelled=unplanned)
    data, missing = [], []
    for d in cfg.get("datasets") or []:
        p = str(d.get("path", "")) if isinstance(d, dict) else str(d)
        hit = local_file(p, path.parent)
        (data if hit else missing).append(hit or p)
    job.data = data
    if missing:
        job.notes.append(f"datasets not found as local files (convert leaves them out): {', '.join(missing)}")
    out: dict[str, Any] = {"lora": {"rank": w.lora_rank, "alpha": as_int(cfg.get("lora_alpha", 16), "lora_alpha",
                                                                         at("lora_alpha")),
                                    "dropout": as_float(cfg.get("lora_dropout", 0.0), "lora_dropout",
                                                        at("lora_dropout")),
                                    "targets": "all-linear" if as_bool(cfg.get("lora_target_linear", True)) or
                                    not cfg.get("lora_target_modules") else list(cfg["lora_target_modules"])},
                           "packing": as_bool(cfg.get("sample_packing", False))}
    carry_settings(out, cfg, SETTINGS, at)
    if cfg.get("num_epochs") is not None:
        out["epochs"] = max(1, round(as_float(cfg["num_epochs"], "num_epochs", at("num_epochs"))))
    if cfg.get("output_dir"):
        out["output_dir"] = str(cfg["output_dir"])
    if as_bool(cfg.get("trust_remote_code", False)):
        out["trust_remote_code"] = True
    job.convert = out
    return job
