"""The engine and placement an HF Trainer job runs with: DeepSpeed, FSDP or DDP from its arguments or
the plugin accelerate builds, and the device map the model loads with (an argument, or the training
script's own)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.accelerate import Accelerate
from shardfit.foreign.common import (
    FALSE_WORDS,
    as_bool,
    flat_params_of,
    fsdp_engine,
    fsdp_settings,
    fsdp_sharding,
    local_file,
    parse_json,
    read_text,
    record,
    trainer_fsdp1,
)
from shardfit.foreign.deepspeed import DeepSpeedJob
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.keys import Source, use_deepspeed
from shardfit.foreign.shell import visible_devices
from shardfit.foreign.trainer_checks import check_fsdp2_options

_DEVICE_MAP = re.compile(r"device_map\s*=\s*(\"[^\"]*\"|'[^']*'|\{[^}]*\}|[A-Za-z_][\w.]*)")


def plan_engine(src: Source, job: ForeignJob, hidden: int, version: str, acc: Accelerate | None,
            trl_bf16: bool = False) -> None:
    """DeepSpeed (whose JSON decides the precision where the arguments leave it, and TRL's default does not),
    FSDP, or DDP under a launcher."""
    if src.get("deepspeed"):
        ds = use_deepspeed(job, src.get("deepspeed"), src.path.parent, f"{src.where}: --deepspeed", hidden, job.notes)
        _refuse_precision_mismatch(ds, src, trl_bf16, f"{src.at('deepspeed')}: --deepspeed {src.get('deepspeed')}")
        if ds.precision and not src.get("bf16") and not src.get("fp16") and not trl_bf16:  # the JSON, not "auto"
            job.workload = dataclasses.replace(job.workload, precision=ds.precision)
    elif str(src.get("fsdp") or "").strip().lower() not in FALSE_WORDS:  # options, or true (fsdp_config decides)
        f = str(src.get("fsdp")).lower()
        cfg = _fsdp_config(src)
        offload = "offload" in f or as_bool(cfg.get("cpu_offload", cfg.get("offload_params", False)))
        fsdp1 = trainer_fsdp1(cfg, version, f"{src.where}: --fsdp_config", job.notes)
        check_fsdp2_options(f, cfg, version, fsdp1, src.at("fsdp"))
        sharding = "shard_grad_op" if "shard_grad_op" in f else fsdp_sharding(cfg, f"{src.where}: --fsdp_config")
        job.engine = fsdp_engine(sharding, offload, job.distributed)
        flat = flat_params_of(cfg, fsdp1, f"{src.where}: --fsdp_config", job.notes)
        job.workload = dataclasses.replace(job.workload, fsdp1=fsdp1, flat_params=flat)
    elif not _accelerate_plugin(src, job, acc, hidden, version, trl_bf16) and job.distributed:
        job.engine = "ddp"


def _refuse_precision_mismatch(ds: DeepSpeedJob, src: Source, trl_bf16: bool, where: str) -> None:
    """A DeepSpeed JSON's fp16.enabled or bf16.enabled given as true or false (not "auto") must equal what the
    arguments resolve to (fp16 or fp16_full_eval; bf16, bf16_full_eval, or TRL's bf16 default): transformers'
    HfTrainerDeepSpeedConfig records any difference and `trainer_config_finalize` raises before step 1, so the
    job never trains."""
    for kind, ds_on in (("fp16", ds.fp16_on), ("bf16", ds.bf16_on)):
        hf_on = src.flag(kind, "false") or src.flag(f"{kind}_full_eval", "false") or (kind == "bf16" and trl_bf16)
        if ds_on is None or ds_on == hf_on:
            continue
        why = "TRL's default, as neither bf16 nor fp16 is given" if kind == "bf16" and trl_bf16 and \
            not src.get("bf16") else "the arguments" if src.get(kind) else "not set among the arguments"
        raise UserError(f"{where}: {kind}.enabled is {str(ds_on).lower()} while --{kind} resolves to "
                        f"{str(hf_on).lower()} ({why}); transformers refuses the mismatch before the first step "
                        f"(\"DeepSpeed config values that mismatch TrainingArguments values\"). Set {kind}.enabled "
                        f"to \"auto\" in the JSON, or pass --{kind} {str(ds_on).lower()}.")


def _accelerate_plugin(src: Source, job: ForeignJob, acc: Accelerate | None, hidden: int, version: str,
                       trl_bf16: bool = False) -> bool:
    """The DeepSpeed or FSDP plugin accelerate builds for the Trainer when its arguments name neither (the Trainer's
    Accelerator takes it from the environment the launch sets: accelerate/accelerator.py, transformers'
    TrainingArguments `__post_init__` for DeepSpeed): ZeRO as the plugin's JSON says; FSDP1 unless fsdp_version is
    2, FSDP2 resharding after forward unless told not to, FSDP1 by its sharding strategy."""
    if acc is None or (acc.fsdp is None and acc.deepspeed is None and acc.deepspeed_file is None):
        return False
    job.keys.update({f"accelerate:{k}": v for k, v in acc.keys.items()})
    if acc.fsdp is not None:
        cfg = acc.fsdp
        job.engine = fsdp_engine(fsdp_sharding(cfg, acc.source), as_bool(cfg.get("offload_params", False)),
                                 job.distributed)
        fsdp1 = str(cfg["version"]) == "1"
        flat = flat_params_of(cfg, fsdp1, acc.source, job.notes)
        job.workload = dataclasses.replace(job.workload, fsdp1=fsdp1, flat_params=flat)
        record(job, "accelerate:fsdp_version", cfg["version"], effect=f"FSDP{cfg['version']}")
        return True
    ref = acc.deepspeed_file or json.dumps(acc.deepspeed)
    ds = use_deepspeed(job, ref, src.path.parent, f"{acc.source}: deepspeed_config", hidden, job.notes)
    if acc.deepspeed_file:  # accelerate's own JSON follows its mixed_precision; a file is checked as the Trainer does
        _refuse_precision_mismatch(ds, src, trl_bf16, f"{acc.source}: deepspeed_config_file {acc.deepspeed_file}")
    if ds.precision and not src.get("bf16") and not src.get("fp16") and not trl_bf16:
        job.workload = dataclasses.replace(job.workload, precision=ds.precision)
    if acc.deepspeed is not None:
        stage = acc.deepspeed["zero_optimization"]["stage"]
        job.notes.append(f"accelerate's DeepSpeed plugin builds its own JSON: ZeRO-{stage}"
                         + (" (zero_stage not set: accelerate's default)" if "deepspeed_config.zero_stage"
                            not in acc.keys else ""))
    return True


def _fsdp_config(src: Source) -> dict[str, Any]:
    """`--fsdp_config`: a JSON file (beside the script, or as given) or a JSON object, by fsdp_settings' names."""
    ref = src.get("fsdp_config")
    if not ref:
        return {}
    text = str(ref).strip()
    if not text.startswith("{"):
        hit = local_file(text, src.path.parent)
        if hit is None:
            raise UserError(f"{src.at('fsdp_config')}: --fsdp_config {text}: no such JSON file here; give its path "
                            f"(relative to the script) or the settings as a JSON object.")
        text = read_text(Path(hit))
    raw = parse_json(text, f"{src.where}: --fsdp_config")
    if not isinstance(raw, dict):
        raise UserError(f"{src.at('fsdp_config')}: --fsdp_config must hold one JSON object of FSDP settings.")
    return fsdp_settings(raw, f"{src.where}: --fsdp_config")


def plan_device_map(src: Source, job: ForeignJob, script: Path | None, env: dict[str, str]) -> None:
    """The device map the model loads with (an argument, else the training script's); one process with one
    splits the model over the visible GPUs."""
    dm = src.get("device_map")
    if dm is None and script is not None:
        dm = _script_device_map(script, src.flag("q_lora", "false"), job)
    if dm and dm.lower() not in ("none", "null"):
        job.device_map = dm
        if not job.distributed and job.engine == "single":
            job.engine = "device_map"
            job.gpus = len(visible_devices(env)) or None


def _script_device_map(script: Path, q_lora: bool, job: ForeignJob) -> str | None:
    """The device_map the training script loads with, when it names one outright (device_map="auto") or
    computes it as Qwen's finetune.py does (QLoRA: the rank's GPU under a launcher, "auto" without one)."""
    src = read_text(script)
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
