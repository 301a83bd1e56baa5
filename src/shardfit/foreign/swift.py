"""An ms-swift command line (`swift sft ...`), or the shell script holding it, with its environment:
NPROC_PER_NODE starts torchrun ranks, several CUDA_VISIBLE_DEVICES without it split one process over the GPUs
(device_map), ENABLE_AUDIO_OUTPUT decides whether an Omni model's talker is loaded. `--deepspeed` takes a JSON
path or ms-swift's built-in names (zero0 ... zero3_offload)."""

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
    local_file,
    optimizer,
    read_text,
    record,
    record_keys,
)
from shardfit.foreign.deepspeed import load_deepspeed
from shardfit.foreign.job import ForeignJob, Words
from shardfit.foreign.shell import parse_command, visible_devices
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

NO_EFFECT = TRAINER_NO_EFFECT | {
    "dataset", "val_dataset", "system", "model_author", "model_name", "split_dataset_ratio", "lora_alpha",
    "lora_dropout", "streaming", "dataset_num_proc", "template", "model_type", "add_version", "columns",
    "save_only_model", "load_from_cache_file", "truncation_strategy", "loss_scale", "use_hf", "packing",
    "padding_free", "model", "model_id_or_path", "freeze_aligner", "freeze_llm", "enable_channel_loss",
    "check_model", "create_checkpoint_symlink", "max_new_tokens", "quant_method",
}
ENV_MODELLED = {"NPROC_PER_NODE": "ranks", "CUDA_VISIBLE_DEVICES": "GPUs", "ENABLE_AUDIO_OUTPUT": "Omni talker",
                "NNODES": "nodes"}
ENV_NO_EFFECT = {"MASTER_PORT", "MASTER_ADDR", "NODE_RANK", "MAX_PIXELS", "VIDEO_MAX_PIXELS", "FPS_MAX_FRAMES",
                 "USE_AUDIO_IN_VIDEO", "SIZE_FACTOR", "PYTHONPATH", "OMP_NUM_THREADS", "NCCL_DEBUG", "HF_ENDPOINT",
                 "USE_HF", "WANDB_PROJECT", "MODELSCOPE_CACHE", "HF_HOME", "TOKENIZERS_PARALLELISM"}


def words() -> Words:
    return Words(zero={k: f"--deepspeed {k}" for k in ("zero2", "zero3", "zero3_offload", "zero2_offload")},
                 keys={"fused_loss": "--use_liger_kernel true",
                       "grad_ckpt": "--gradient_checkpointing true", "micro_batch": "--per_device_train_batch_size 1 "
                       "with --gradient_accumulation_steps", "seq": "--max_length", "qlora": "--quant_bits 4 "
                       "--quant_method bnb", "lora": "--train_type lora", "adamw8bit": "--optim adamw_8bit",
                       "device_map": "NPROC_PER_NODE=1 (one process over CUDA_VISIBLE_DEVICES) or drop "
                       "--device_map under NPROC_PER_NODE", "model_parallel": "no NPROC_PER_NODE, "
                       "CUDA_VISIBLE_DEVICES listing every GPU (ms-swift splits the model with device_map)",
                       "talker": "ENABLE_AUDIO_OUTPUT=0", "ranks": "NPROC_PER_NODE with --deepspeed zero3",
                       "quant_storage": "--bnb_4bit_quant_storage bfloat16",
                       "reentrant": "--gradient_checkpointing_kwargs '{\"use_reentrant\": false}'"})


def read_swift(path: Path, shape_of: Any, version: str, nproc: int | None) -> ForeignJob:
    """The job of an ms-swift `swift sft` command line or script."""
    where = str(path)
    text = read_text(path)
    cmd = parse_command(text, where, ("swift sft", "swift pt", "swift rlhf"))
    a = cmd.args
    check_bools(a, ("ddp_find_unused_parameters", "freeze_vit", "gradient_checkpointing", "packing",
                    "use_liger_kernel"), lambda key: f"{where}: --{key}")
    model = a.get("model") or a.get("model_id_or_path") or (cmd.positional[0] if cmd.positional else None)
    if not model:
        raise UserError(f"{where}: the swift command has no --model; shardfit plans from it.")
    shape: ModelShape = shape_of(model)
    gpus = visible_devices(cmd.env)
    ranks = nproc or cmd.nproc
    job = ForeignJob("swift", where, model, Workload(), words=words(), nproc=ranks, nnodes=cmd.nnodes,
                     launcher="torchrun" if cmd.nproc else None)
    where_arg = f"{where}: --"
    train_type = a.get("train_type", a.get("sft_type", "lora")).lower()
    method = {"lora": "lora", "full": "full", "longlora": "lora", "adalora": "lora", "dora": "lora"}.get(train_type)
    if method is None:
        raise UserError(f"{where}: --train_type {train_type}: shardfit plans lora and full (and LoRA variants).")
    bits = a.get("quant_bits")
    if bits is not None and method == "lora":
        method = "qlora"
        if as_int(bits, "quant_bits", where) != 4:
            job.notes.append(f"--quant_bits {bits} planned as 4-bit NF4 (an under-estimate of the frozen weights)")
    dtype = a.get("torch_dtype", "bfloat16").lower()
    precision = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32",
                 "fp32": "fp32"}.get(dtype, "bf16")
    attn = a.get("attn_impl", "sdpa").lower()
    if attn not in ATTENTION:
        raise UserError(f"{where_arg}attn_impl {attn}: choose flash_attn, sdpa or eager.")
    liger = as_bool(a.get("use_liger_kernel", "false"))
    if "max_length" not in a:
        job.notes.append("--max_length not given: ms-swift then uses the model's context; planned at 2048 tokens "
                         "(pass --seq to plan another)")
    opt = optimizer(a.get("optim", "adamw_torch"))
    w = Workload(method=method, precision=precision,
                 seq_len=as_int(a.get("max_length", 2048), "max_length", where),
                 micro_batch=as_int(a.get("per_device_train_batch_size", 1), "per_device_train_batch_size", where),
                 grad_ckpt="full" if as_bool(a.get("gradient_checkpointing", "true")) else "none",
                 optimizer=opt or "adamw", lora_rank=as_int(a.get("lora_rank", 8), "lora_rank", where),
                 loss=hf_loss(version, liger), attention=ATTENTION[attn],
                 grad_accum=as_int(a.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", where))
    job.workload = w
    gc_kwargs = a.get("gradient_checkpointing_kwargs", "")
    job.reentrant_ckpt = w.grad_ckpt != "none" and "false" not in gc_kwargs.lower()
    job.find_unused = as_bool(a.get("ddp_find_unused_parameters", "false"))
    ds = a.get("deepspeed")
    if ds:
        dsj = load_deepspeed(ds, path.parent, f"{where}: --deepspeed", shape.hidden, [])
        job.engine, job.zero = "deepspeed", dsj.zero
        for k, v in dsj.keys.items():
            job.keys[f"deepspeed:{k}"] = v
        for k, v in dsj.not_modelled.items():
            job.not_modelled[f"deepspeed:{k}"] = v
    elif job.distributed:
        job.engine = "ddp"
    elif len(gpus) > 1 or a.get("device_map"):
        job.engine = "device_map"
        job.gpus = len(gpus) or None
    if a.get("device_map"):
        job.device_map = a["device_map"]
    elif job.engine == "device_map":
        job.device_map = "auto"
    audio = cmd.env.get("ENABLE_AUDIO_OUTPUT")
    job.speech_outputs = "omni" in model.lower() and (audio is None or as_bool(audio))
    job.quant_storage = a.get("bnb_4bit_quant_storage") is not None
    modelled = {"train_type": method, "sft_type": method, "quant_bits": "4-bit NF4 frozen weights",
                "torch_dtype": precision, "attn_impl": f"attention {w.attention}", "use_liger_kernel": "fused loss",
                "max_length": "sequence length", "per_device_train_batch_size": "micro-batch",
                "gradient_accumulation_steps": "grad_accum", "gradient_checkpointing": f"grad_ckpt {w.grad_ckpt}",
                "gradient_checkpointing_kwargs": "reentrant or not", "lora_rank": "adapter size",
                "deepspeed": "ZeRO settings", "device_map": "placement", "ddp_find_unused_parameters": "DDP",
                "target_modules": "adapters on every linear layer", "bnb_4bit_quant_storage": "quantized storage",
                "freeze_vit": "vision tower frozen", "optim": w.optimizer}
    unplanned = {"optim"} if opt is None else set()
    if "target_modules" in a and a["target_modules"] != "all-linear":
        unplanned.add("target_modules")
        job.notes.append("--target_modules is not all-linear: planned as adapters on every linear layer")
    if "freeze_vit" in a and not as_bool(a["freeze_vit"]) and method == "full":
        unplanned.add("freeze_vit")
    record_keys(job, ((k, a[k]) for k in cmd.order), modelled=modelled, no_effect=NO_EFFECT, not_modelled=unplanned)
    for key, value in cmd.exported.items():
        if key in ENV_MODELLED:
            record(job, f"env {key}", value, effect=ENV_MODELLED[key])
        elif key in ENV_NO_EFFECT:
            record(job, f"env {key}", value, effect="no effect on memory")
        else:
            record(job, f"env {key}", value, modelled=False)
    data = [d for d in a.get("dataset", "").split() if d]
    job.data = [hit for d in data if (hit := local_file(d.split("#")[0], path.parent))]
    missing = [d for d in data if not local_file(d.split("#")[0], path.parent)]
    if missing:
        job.notes.append(f"datasets not found as local files (hub ids; convert leaves them out): {', '.join(missing)}")
    job.convert = _convert(a, job, where)
    return job


def _convert(a: dict[str, str], job: ForeignJob, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for src, dst, fn in (("learning_rate", "lr", as_float), ("warmup_ratio", "warmup_ratio", as_float),
                         ("weight_decay", "weight_decay", as_float), ("max_grad_norm", "max_grad_norm", as_float),
                         ("split_dataset_ratio", "eval_split", as_float), ("max_steps", "max_steps", as_int),
                         ("save_steps", "save_steps", as_int), ("eval_steps", "eval_steps", as_int),
                         ("logging_steps", "log_steps", as_int), ("seed", "seed", as_int)):
        if src in a:
            out[dst] = fn(a[src], src, where)
    if "num_train_epochs" in a:
        out["epochs"] = max(1, round(as_float(a["num_train_epochs"], "num_train_epochs", where)))
    if "max_steps" in out and out["max_steps"] < 1:
        out.pop("max_steps")
    lora: dict[str, Any] = {"rank": job.workload.lora_rank,
                            "alpha": as_int(a.get("lora_alpha", 32), "lora_alpha", where)}
    if "lora_dropout" in a:
        lora["dropout"] = as_float(a["lora_dropout"], "lora_dropout", where)
    targets = a.get("target_modules", "all-linear")
    lora["targets"] = "all-linear" if targets == "all-linear" else targets.split()
    out["lora"] = lora
    out["packing"] = as_bool(a.get("packing", "false"))
    if "output_dir" in a:
        out["output_dir"] = a["output_dir"]
    if job.speech_outputs or "omni" in job.model.lower():
        out["drop_modules"] = ["talker", "token2wav"]
    return out
