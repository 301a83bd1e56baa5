"""What the tools share: the HF Trainer's arguments and memory behaviour (the loss of the installed transformers,
attention kernels, optimizers), YAML loading with line numbers, and local data paths."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from shardfit.config.load import read_yaml
from shardfit.errors import UserError
from shardfit.foreign.job import ForeignJob

# HF TrainingArguments that change nothing the planner counts (logging, saving, schedules, evaluation cadence,
# data loading, hub and reporting).
TRAINER_NO_EFFECT = {
    "output_dir", "overwrite_output_dir", "logging_steps", "logging_dir", "logging_strategy", "logging_first_step",
    "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_safetensors", "eval_steps",
    "eval_strategy", "evaluation_strategy", "do_train", "do_eval", "do_predict", "learning_rate", "lr_scheduler_type",
    "warmup_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "num_train_epochs", "max_steps", "seed", "data_seed", "report_to", "run_name", "ddp_timeout",
    "resume_from_checkpoint",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "remove_unused_columns",
    "push_to_hub", "hub_model_id", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "disable_tqdm", "log_level", "plot_loss", "lazy_preprocess", "group_by_length", "include_num_input_tokens_seen",
    "per_device_eval_batch_size", "eval_accumulation_steps", "prediction_loss_only", "local_rank", "tf32",
    "ddp_backend", "label_names", "save_on_each_node", "use_cpu", "torch_compile", "ignore_data_skip",
}


def transformers_version() -> str:
    """The installed transformers (what the tool would run here), without importing it."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "5.0"


def hf_loss(version: str, fused: bool) -> str:
    """The planner's loss for a run through transformers' own causal-LM loss at `version`: 4.46-4.48 copied the
    shifted fp32 logits (`full_shift`); before and after, `full`. A fused linear + cross-entropy kernel (Liger,
    Cut Cross-Entropy) never holds the full logits: closest is shardfit's chunked loss."""
    if fused:
        return "chunked"
    m = re.match(r"(\d+)\.(\d+)", version)
    major, minor = (int(m.group(1)), int(m.group(2))) if m else (5, 0)
    return "full_shift" if (major, minor) in ((4, 46), (4, 47), (4, 48)) else "full"


# Attention implementations by the names the tools use, onto the planner's three memory behaviours.
ATTENTION = {"fa2": "flash", "flash_attn": "flash", "flash_attention_2": "flash", "flash_attention_3": "flash",
             "fa3": "flash", "flex_attention": "flash", "sdpa": "sdpa", "auto": "sdpa", "eager": "eager",
             "disabled": "eager", "none": "sdpa"}
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adam8bit", "adamw8bit")


def optimizer(name: str) -> str | None:
    """adamw, adamw8bit, or None for an optimizer the planner does not model (paged AdamW counts as AdamW: its
    states are the same size, only their pages may move to the host under pressure)."""
    n = name.lower()
    if n in EIGHT_BIT_OPTIMIZERS:
        return "adamw8bit"
    if n.startswith(("adamw", "paged_adamw")) or n == "adam":
        return "adamw"
    return None


def as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes", "y", "on")
    return bool(v)


def as_int(v: Any, key: str, where: str) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise UserError(f"{where}: '{key}' is {v!r}; expected a whole number.") from None


def as_float(v: Any, key: str, where: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise UserError(f"{where}: '{key}' is {v!r}; expected a number.") from None


def load_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """A tool's YAML config and the line of each top-level key, read as strictly as shardfit's own configs
    (non-UTF-8 text, alias bombs and keys given twice are a UserError naming the file and line)."""
    data, lines = read_yaml(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys (model_name_or_path: ..., ...), got "
                        f"{type(data).__name__}.")
    return data, {k: line for k, line in lines.items() if "." not in k}


def local_file(name: str, *bases: Path) -> str | None:
    """`name` as an existing file, tried as given and under each base folder."""
    p = Path(name).expanduser()
    if p.is_file():
        return str(p)
    for b in bases:
        if not p.is_absolute() and (b / p).is_file():
            return str(b / p)
    return None


def record(job: ForeignJob, key: str, value: Any, modelled: bool = True, effect: str = "") -> None:
    """File a tool key under what was modelled (with its effect, if any) or under "not modelled"."""
    if isinstance(value, (dict, list)):
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    else:
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if modelled:
        job.keys[key] = f"{text} ({effect})" if effect else text
    else:
        job.not_modelled[key] = text
