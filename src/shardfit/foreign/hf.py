"""An HF Trainer job: TrainingArguments as JSON, or the command line (or shell script) that runs a training script
with them, e.g. Qwen's finetune.sh (`torchrun ... finetune.py --model_name_or_path ... --use_lora True
--deepspeed ds.json`). When the script itself is here, its `from_pretrained(..., device_map=...)` is read too:
a command line cannot show it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import (
    ATTENTION,
    TRAINER_NO_EFFECT,
    Settings,
    as_bool,
    as_float,
    as_int,
    carry_settings,
    check_bools,
    hf_loss,
    local_file,
    optimizer,
    parse_json,
    read_text,
    record,
    record_keys,
    take_deepspeed_keys,
)
from shardfit.foreign.deepspeed import load_deepspeed
from shardfit.foreign.job import ForeignJob, Words
from shardfit.foreign.shell import parse_command, visible_devices
from shardfit.plan.workload import Workload

SETTINGS: Settings = (
    ("learning_rate", "lr", as_float), ("warmup_ratio", "warmup_ratio", as_float),
    ("weight_decay", "weight_decay", as_float), ("max_grad_norm", "max_grad_norm", as_float),
    ("max_steps", "max_steps", as_int), ("save_steps", "save_steps", as_int),
    ("eval_steps", "eval_steps", as_int), ("logging_steps", "log_steps", as_int),
    ("seed", "seed", as_int))

NO_EFFECT = TRAINER_NO_EFFECT | {"model_name_or_path", "data_path", "eval_data_path", "cache_dir", "lora_alpha",
                                 "lora_dropout", "lora_weight_path", "lora_bias", "use_fast_tokenizer"}
SEQ_KEYS = ("model_max_length", "max_seq_length", "max_length", "cutoff_len", "seq_length")
_DEVICE_MAP = re.compile(r"device_map\s*=\s*(\"[^\"]*\"|'[^']*'|\{[^}]*\}|[A-Za-z_][\w.]*)")


def words() -> Words:
    return Words(zero={"zero2": "--deepspeed ds_config_zero2.json", "zero3": "--deepspeed ds_config_zero3.json",
                       "zero3_offload": "--deepspeed ds_config_zero3_offload.json"},
                 keys={"fused_loss": "--use_liger_kernel True",
                       "grad_ckpt": "--gradient_checkpointing True", "micro_batch": "--per_device_train_batch_size 1 "
                       "with --gradient_accumulation_steps", "seq": "--model_max_length", "qlora": "--q_lora True "
                       "(4-bit base weights)", "lora": "--use_lora True", "adamw8bit": "--optim adamw_bnb_8bit",
                       "device_map": "device_map=None (or {'': int(os.environ['LOCAL_RANK'])}) in from_pretrained "
                       "when WORLD_SIZE > 1", "model_parallel": "one process (python, no torchrun) with "
                       "device_map='auto'", "reentrant": "--gradient_checkpointing_kwargs "
                       "'{\"use_reentrant\": false}'", "quant_storage": "bnb_4bit_quant_storage=torch.bfloat16 in "
                       "BitsAndBytesConfig"})


def read_hf(path: Path, shape_of: Any, version: str, nproc: int | None, model: str | None) -> ForeignJob:
    """TrainingArguments (.json) or a command line / script running a training script."""
    where = str(path)
    text = read_text(path)
    script: Path | None = None
    env: dict[str, str] = {}
    launcher, ranks, nnodes = None, nproc, 1
    if path.suffix == ".json":
        args = parse_json(text, where)
        if not isinstance(args, dict):
            raise UserError(f"{path}: TrainingArguments JSON must be an object of argument names.")
        args = {k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
                for k, v in args.items()}
        order = list(args)
    else:
        cmd = parse_command(text, where, (".py",))
        args, order, env = cmd.args, cmd.order, cmd.exported
        launcher, nnodes = cmd.launcher, cmd.nnodes
        ranks = nproc or cmd.nproc
        if launcher == "deepspeed" and ranks is None:
            ranks = len(visible_devices(env)) or None
        found = local_file(cmd.program, path.parent)
        script = Path(found) if found else None
    check_bools(args, ("bf16", "fp16", "gradient_checkpointing", "q_lora", "use_liger_kernel", "use_lora"),
                lambda _key: where)
    model = model or args.get("model_name_or_path") or args.get("model")
    if not model:
        raise UserError(f"{where}: no --model_name_or_path; pass the model with --model ID_OR_PATH.")
    shape = shape_of(model)
    job = ForeignJob("hf", where, model, Workload(), words=words(), nproc=ranks, nnodes=nnodes, launcher=launcher)
    q = as_bool(args.get("q_lora", "false"))
    lora = as_bool(args.get("use_lora", "false")) or q or "lora_r" in args
    method = "qlora" if q else "lora" if lora else "full"
    precision = "bf16" if as_bool(args.get("bf16", "false")) else "fp16" if as_bool(args.get("fp16", "false")) \
        else "fp32"
    seq_key = next((k for k in SEQ_KEYS if k in args), None)
    if seq_key is None:
        job.notes.append("no sequence length among the arguments: planned at 2048 tokens (pass --seq)")
    attn = args.get("attn_implementation", "sdpa")
    opt = optimizer(args.get("optim", "adamw_torch"))
    gc = as_bool(args.get("gradient_checkpointing", "false"))
    w = Workload(method=method, precision=precision,
                 seq_len=as_int(args[seq_key], seq_key, where) if seq_key else 2048,
                 micro_batch=as_int(args.get("per_device_train_batch_size", 8), "per_device_train_batch_size", where),
                 grad_ckpt="full" if gc else "none", optimizer=opt or "adamw",
                 lora_rank=as_int(args.get("lora_r", args.get("lora_rank", 64 if lora else 8)), "lora_r", where),
                 loss=hf_loss(version, as_bool(args.get("use_liger_kernel", "false"))),
                 attention=ATTENTION.get(attn, "sdpa"),
                 grad_accum=as_int(args.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", where),
                 frozen_fp32=q)
    job.workload = w
    job.reentrant_ckpt = gc and "false" not in args.get("gradient_checkpointing_kwargs", "").lower()
    # The Trainer looks for unused parameters unless told otherwise or the model is a plain transformers model
    # with checkpointing on; a PEFT model is not one.
    fu = args.get("ddp_find_unused_parameters")
    job.find_unused = as_bool(fu) if fu is not None else (lora or not gc)
    if args.get("deepspeed"):
        ds = load_deepspeed(args["deepspeed"], path.parent, f"{where}: --deepspeed", shape.hidden, job.notes)
        job.engine, job.zero = "deepspeed", ds.zero
        if ds.precision and not args.get("bf16") and not args.get("fp16"):  # the JSON decides, not "auto"
            job.workload = dataclasses.replace(w, precision=ds.precision)
        take_deepspeed_keys(job, ds.keys, ds.not_modelled)
    elif args.get("fsdp"):
        f = args["fsdp"]
        job.engine = "fsdp_offload" if "offload" in f else "fsdp_shard_grad_op" if "shard_grad_op" in f \
            else "fsdp_full_shard"
    elif job.distributed:
        job.engine = "ddp"
    dm = args.get("device_map")
    if dm is None and script is not None:
        dm = _script_device_map(script, q, job)
    if dm and dm.lower() not in ("none", "null"):
        job.device_map = dm
        if not job.distributed and job.engine == "single":
            job.engine = "device_map"
            job.gpus = len(visible_devices(env)) or None
    job.speech_outputs = "omni" in model.lower()
    job.quant_storage = "bnb_4bit_quant_storage" in args
    modelled = {"use_lora": method, "q_lora": "4-bit NF4 frozen weights, fp32 embeddings/norms/head",
                "bf16": precision, "fp16": precision, "per_device_train_batch_size": "micro-batch",
                "gradient_accumulation_steps": "grad_accum", "gradient_checkpointing": f"grad_ckpt {w.grad_ckpt}",
                "gradient_checkpointing_kwargs": "reentrant or not", "lora_r": "adapter size",
                "lora_rank": "adapter size", "attn_implementation": f"attention {w.attention}",
                "use_liger_kernel": "fused loss", "deepspeed": "ZeRO settings", "fsdp": "FSDP",
                "device_map": "placement", "ddp_find_unused_parameters": "DDP", "optim": w.optimizer,
                "model": "model"} | {k: "sequence length" for k in SEQ_KEYS}
    unplanned = {"lora_target_modules"} | ({"optim"} if opt is None else set())
    if "lora_target_modules" in args:
        job.notes.append("lora_target_modules planned as adapters on every linear layer (an over-estimate)")
    record_keys(job, ((k, args[k]) for k in order), modelled=modelled, no_effect=NO_EFFECT, not_modelled=unplanned)
    for key, value in env.items():
        effect = {"CUDA_VISIBLE_DEVICES": "GPUs", "WORLD_SIZE": "ranks", "NPROC_PER_NODE": "ranks",
                  "GPUS_PER_NODE": "ranks"}.get(key)
        record(job, f"env {key}", value, modelled=True, effect=effect or "no effect on memory")
    data = [args[k] for k in ("data_path", "train_file", "dataset") if args.get(k)]
    job.data = [hit for d in data if (hit := local_file(d, path.parent))]
    out: dict[str, Any] = {"lora": {"rank": w.lora_rank, "alpha": as_int(args.get("lora_alpha", 16), "lora_alpha",
                                                                         where),
                                    "dropout": as_float(args.get("lora_dropout", 0.05 if lora else 0.0),
                                                        "lora_dropout", where)}}
    carry_settings(out, args, SETTINGS, lambda _key: where)
    if out.get("max_steps", 1) < 1:
        out.pop("max_steps")
    if args.get("num_train_epochs"):
        out["epochs"] = max(1, round(as_float(args["num_train_epochs"], "num_train_epochs", where)))
    if args.get("output_dir"):
        out["output_dir"] = args["output_dir"]
    job.convert = out
    return job


def _script_device_map(script: Path, q_lora: bool, job: ForeignJob) -> str | None:
    """The device_map the training script loads with, when it names one outright (device_map="auto") or
    computes it as Qwen's finetune.py does (QLoRA: the rank's GPU under a launcher, "auto" without one)."""
    try:
        src = script.read_text(encoding="utf-8", errors="replace")  # searched for one call only
    except OSError:
        return None
    m = _DEVICE_MAP.search(src)
    if m is None:
        return None
    value = m.group(1).strip("\"'")
    if value in ("None", "device_map"):
        if "LOCAL_RANK" in src and q_lora:
            job.notes.append(f"{script.name} loads 4-bit models with the rank's own GPU under a launcher, "
                             "device_map='auto' without one")
            return None if job.distributed else "auto"
        return None
    job.notes.append(f"{script.name} loads the model with device_map={m.group(1)}")
    return value
