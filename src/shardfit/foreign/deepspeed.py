"""A DeepSpeed JSON: the ZeRO settings that decide memory, with "auto" values filled the way the HF Trainer
fills them (transformers' integrations/deepspeed.py), and every other key sorted into "no effect on memory" or
"not modelled"."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import parse_json, read_text
from shardfit.plan.deepspeed import (
    ALLGATHER_BUCKET,
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET,
    REDUCE_BUCKET,
    SUB_GROUP,
    ZeroSettings,
)
from shardfit.plan.optimizer_kinds import rmsprop_kind

# Keys that change nothing the planner counts (schedules, logging, clipping, checkpoint saving).
NO_MEMORY_EFFECT = {
    "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "scheduler", "train_batch_size",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "dump_state", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save", "zero_optimization.round_robin_gradients",
    "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.ignore_unused_parameters", "zero_optimization.elastic_checkpoint",
    "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.ratio",
    "fp16.loss_scale", "fp16.loss_scale_window", "fp16.initial_scale_power", "fp16.hysteresis",
    "fp16.min_loss_scale", "fp16.auto_cast", "fp16.consecutive_hysteresis", "bf16.immediate_grad_update",
    "optimizer.params", "amp",
}
MODELLED = {
    "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.device", "zero_optimization.offload_param.pin_memory",
    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
    "zero_optimization.allgather_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance", "zero_optimization.sub_group_size",
    "bf16.enabled", "fp16.enabled", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer.type",
}


@dataclass
class DeepSpeedJob:
    """What a DeepSpeed JSON says: ZeRO settings, and the training keys it may fix ("auto" leaves them to the
    tool)."""

    zero: ZeroSettings
    precision: str | None = None  # bf16 | fp16 | None (auto or unset: the tool decides)
    micro_batch: int | None = None
    grad_accum: int | None = None
    optimizer: str | None = None
    optimizer_type: str | None = None  # the optimizer section's `type` as written (None: no section)
    keys: dict[str, str] = field(default_factory=dict)
    not_modelled: dict[str, str] = field(default_factory=dict)
    source: str = ""  # the file, or what it was assumed to be
    # bf16.enabled and fp16.enabled as given: None when "auto" or absent (for tools that decide from them)
    bf16_on: bool | None = None
    fp16_on: bool | None = None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in NO_MEMORY_EFFECT:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# An optimizer section's `type` by the planner's optimizer (plan/optimizer_kinds.py): DeepSpeed's own names, matched
# in any case (runtime/config.py DEEPSPEED_OPTIMIZERS: FusedAdam or torch's AdamW, torch's Adagrad, FusedLamb,
# FusedLion, mup's MuAdam/MuAdamW), and any other a class of torch.optim by its exact name
# (runtime/engine.py `_configure_basic_optimizer`: `getattr(torch.optim, self.optimizer_name())`).
DS_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "cpuadam": "adamw", "fusedadam": "adamw", "muadam": "adamw",
                 "muadamw": "adamw", "adagrad": "adagrad", "lamb": "lamb", "lion": "lion"}
TORCH_OPTIMIZERS = {"Adam": "adamw", "AdamW": "adamw", "SGD": "sgd", "RMSprop": "rmsprop",
                    "Adafactor": "adafactor_torch"}


def section_optimizer(kind: str, params: Any) -> str | None:
    """The planner's optimizer for an optimizer section of type `kind` with `params` (SGD with a non-zero
    `momentum` keeps a momentum buffer, as does RMSprop's, whose `centered` keeps a gradient average), or None for
    one it does not model (Muon, MuSGD, OneBitAdam, ...)."""
    planned = DS_OPTIMIZERS.get(kind.lower()) or TORCH_OPTIMIZERS.get(kind)
    given = params if isinstance(params, dict) else {}
    momentum = isinstance(given.get("momentum"), (int, float)) and bool(given["momentum"])
    if planned == "sgd" and momentum:
        return "sgd_momentum"
    if planned == "rmsprop":
        return rmsprop_kind(momentum, given.get("centered") is True)
    return planned


def _torch_adam_foreach(kind: Any, params: Any) -> bool:
    """Whether an Adam/AdamW section (`kind` its type) has params that make DeepSpeed build torch's AdamW instead
    of its FusedAdam (`torch_adam: true`, runtime/engine.py `_configure_basic_optimizer`) with torch's default
    kernel on a GPU, the multi-tensor one (not `fused: true`, nor `foreach: false`)."""
    if str(kind).lower() not in ("adam", "adamw") or not isinstance(params, dict) or \
            _enabled(params.get("torch_adam", False)) is not True:
        return False
    return _enabled(params.get("fused", False)) is not True and _enabled(params.get("foreach", True)) is not False


def _number(v: Any, auto: float, key: str, where: str) -> int:
    if v == "auto":
        return int(auto)
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise UserError(f"{where}: '{key}' is {v!r}; DeepSpeed expects a number or \"auto\".") from None


def _enabled(v: Any) -> bool | None:
    if v == "auto":
        return None
    return bool(v) and str(v).lower() not in ("false", "0", "none")


def _switch(v: Any) -> bool | None:
    """An `enabled` key: None when "auto" or not given."""
    return None if v is None else _enabled(v)


def read_deepspeed(config: dict[str, Any], where: str, hidden: int) -> DeepSpeedJob:
    """The memory-relevant settings of a DeepSpeed JSON (already loaded). "auto" buckets are what the HF Trainer
    sets for a model of width `hidden`: reduce bucket hidden^2, prefetch 0.9 hidden^2, persistence 10 hidden."""
    if not isinstance(config, dict):
        raise UserError(f"{where}: a DeepSpeed config must be a JSON object with a zero_optimization section.")
    flat = _flatten(config)
    get = flat.get
    stage = _number(get("zero_optimization.stage", 0), 0, "zero_optimization.stage", where)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{where}: 'zero_optimization.stage' is {stage}; DeepSpeed's stages are 0, 1, 2 and 3.")
    off_opt = str(get("zero_optimization.offload_optimizer.device", "none")).lower() in ("cpu", "nvme")
    off_par = str(get("zero_optimization.offload_param.device", "none")).lower() in ("cpu", "nvme")
    if get("zero_optimization.cpu_offload") is True:  # the pre-0.3 spelling of offload_optimizer
        off_opt = True
        flat.pop("zero_optimization.cpu_offload")
        flat["zero_optimization.offload_optimizer.device"] = "cpu"
    pin = any(_enabled(get(f"zero_optimization.{k}.pin_memory", False)) for k in ("offload_optimizer", "offload_param"))
    overlap = get("zero_optimization.overlap_comm")
    zero = ZeroSettings(
        stage=stage, offload_optimizer=off_opt, offload_param=off_par and stage == 3, pin_memory=bool(pin),
        reduce_bucket_size=_number(get("zero_optimization.reduce_bucket_size", REDUCE_BUCKET), hidden * hidden,
                                   "zero_optimization.reduce_bucket_size", where),
        allgather_bucket_size=_number(get("zero_optimization.allgather_bucket_size", ALLGATHER_BUCKET),
                                      ALLGATHER_BUCKET, "zero_optimization.allgather_bucket_size", where),
        # DeepSpeed turns overlap_comm on by itself for ZeRO-3 when the JSON leaves it unset
        overlap_comm=bool(_enabled(overlap)) if overlap is not None else stage == 3,
        contiguous_gradients=_enabled(get("zero_optimization.contiguous_gradients", True)) is not False,
        prefetch_bucket_size=_number(get("zero_optimization.stage3_prefetch_bucket_size", PREFETCH_BUCKET),
                                     0.9 * hidden * hidden, "zero_optimization.stage3_prefetch_bucket_size", where),
        param_persistence_threshold=_number(
            get("zero_optimization.stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD), 10 * hidden,
            "zero_optimization.stage3_param_persistence_threshold", where),
        max_live_parameters=_number(get("zero_optimization.stage3_max_live_parameters", MAX_LIVE_PARAMETERS),
                                    MAX_LIVE_PARAMETERS, "zero_optimization.stage3_max_live_parameters", where),
        max_reuse_distance=_number(get("zero_optimization.stage3_max_reuse_distance", MAX_REUSE_DISTANCE),
                                   MAX_REUSE_DISTANCE, "zero_optimization.stage3_max_reuse_distance", where),
        sub_group_size=_number(get("zero_optimization.sub_group_size", SUB_GROUP), SUB_GROUP,
                               "zero_optimization.sub_group_size", where),
        # an optimizer section: DeepSpeed builds its own optimizer instead of stepping the tool's
        ds_optimizer=get("optimizer.type") is not None, torch_adam=_torch_adam_foreach(get("optimizer.type"),
                                                                             get("optimizer.params")),
    )
    precision = "bf16" if _enabled(get("bf16.enabled")) else "fp16" if _enabled(get("fp16.enabled")) else None
    if get("bf16.enabled") is False and get("fp16.enabled") in (False, None):
        precision = "fp32"
    opt_type = get("optimizer.type")
    optimizer = None if opt_type is None else section_optimizer(str(opt_type), get("optimizer.params"))
    job = DeepSpeedJob(zero, precision,
                       _maybe(get("train_micro_batch_size_per_gpu"), where, "train_micro_batch_size_per_gpu"),
                       _maybe(get("gradient_accumulation_steps"), where, "gradient_accumulation_steps"), optimizer,
                       None if opt_type is None else str(opt_type), source=where,
                       bf16_on=_switch(get("bf16.enabled")), fp16_on=_switch(get("fp16.enabled")))
    resolved = {"zero_optimization.reduce_bucket_size": zero.reduce_bucket_size,
                "zero_optimization.stage3_prefetch_bucket_size": zero.prefetch_bucket_size,
                "zero_optimization.stage3_param_persistence_threshold": zero.param_persistence_threshold}
    for key, value in flat.items():
        text = json.dumps(value) if not isinstance(value, str) else value
        if value == "auto" and key in resolved:
            text = f"auto = {resolved[key]:,}"
        if key == "optimizer.params" and zero.torch_adam:
            job.keys[key] = f"{text} (torch_adam: torch AdamW's multi-tensor step, one fp32 copy of the partition)"
        elif key in MODELLED and not (key == "optimizer.type" and optimizer is None):
            job.keys[key] = text
        elif key in NO_MEMORY_EFFECT or key.split(".")[0] in NO_MEMORY_EFFECT:
            job.keys[key] = f"{text} (no effect on memory)"
        else:
            job.not_modelled[key] = text
    return job


def _maybe(v: Any, where: str, key: str) -> int | None:
    if v is None or v == "auto":
        return None
    return _number(v, 0, key, where)


# What the tools ship, by the name a config refers to them with when the file is not at hand: (stage, offload
# optimizer, offload params). Their buckets are "auto" and overlap_comm off, as the shipped files set them.
_NAMED = re.compile(r"(?:ds_)?z(?:ero)?_?(\d)(.*)", re.IGNORECASE)


def named_settings(name: str) -> dict[str, Any] | None:
    """A DeepSpeed JSON reconstructed from a shipped config's name (ms-swift's `zero3_offload`, LLaMA-Factory's
    `ds_z3_offload_config.json`, axolotl's `zero3_bf16_cpuoffload_params.json`), or None."""
    m = _NAMED.search(Path(name).name)
    if not m:
        return None
    stage, rest = int(m.group(1)), m.group(2).lower()
    offload = "offload" in rest
    params_only = "offload_params" in rest or "cpuoffload_params" in rest
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_max_live_parameters": 1e9})
    if offload and not params_only:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto"}


def load_deepspeed(ref: str, base: Path, where: str, hidden: int, notes: list[str]) -> DeepSpeedJob:
    """A tool's `deepspeed` setting: a JSON file (relative to the tool's config, then the cwd), inline JSON, or
    the name of a config the tool ships (read from its name when the file is not here, with a note saying so)."""
    text = ref.strip()
    if text.startswith("{"):
        return read_deepspeed(parse_json(text, f"{where}: the inline DeepSpeed JSON"), f"{where}: deepspeed",
                              hidden)
    for p in (base / text, Path(text)):
        if p.is_file():
            return read_deepspeed(parse_json(read_text(p), str(p)), str(p), hidden)
    named = named_settings(text)
    if named is None:
        raise UserError(f"{where}: DeepSpeed config '{ref}' not found (looked in {base} and the current directory), "
                        f"and its name does not say a ZeRO stage. Give the path to the JSON file.")
    notes.append(f"DeepSpeed config '{ref}' is not here; read as the shipped config its name says "
                 f"(ZeRO-{named['zero_optimization']['stage']}, \"auto\" buckets)")
    job = read_deepspeed(named, text, hidden)
    job.source = f"{text} (by name)"
    return job
