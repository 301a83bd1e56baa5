"""Evaluation while training, as the tools built on transformers' Trainer set it: the Workload fields that
plan/evaluation.py plans (`eval_batch`, `eval_keeps_logits`, `eval_accumulation`, `eval_examples`) from a job's
keys, and what those keys show in the plan.

When each tool evaluates, with which batch, and whether it keeps logits (each tool's source):
- the HF Trainer and TRL: when `eval_strategy` (`evaluation_strategy` before transformers 4.41) is steps or epoch
  (training_args.py, default no), `per_device_eval_batch_size` rows (default 8; TRL's configs keep it). Logits are
  kept where the script passes a compute_metrics without a preprocess_logits_for_metrics and prediction_loss_only is
  off (Trainer.evaluate passes prediction_loss_only=True without compute_metrics; TRL's SFTTrainer passes none).
- LLaMA-Factory: with held-out data (`val_size` > 0 or `eval_dataset`) and an `eval_strategy`, the HF default
  batch. Its only metric over logits, compute_accuracy, reduces them to their argmax first
  (`eval_logit_processor`), and it refuses predict_with_generate while training: no logits kept.
- axolotl: with held-out data (`val_set_size` > 0 or `test_datasets`) unless `eval_strategy: no`; `eval_batch_size`
  defaults to `micro_batch_size` (utils/config `normalize_config`). No compute_metrics over logits.
- ms-swift: with held-out data (`split_dataset_ratio` > 0, default 0 in ms-swift 3's DataArguments, or
  `val_dataset`) unless `eval_strategy` no; `per_device_eval_batch_size` defaults to 1 (TrainArgumentsMixin). Its
  `acc` metric reduces the logits to their argmax first (`preprocess_logits_for_acc`): no logits kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import FALSE_WORDS, as_bool, as_float, as_int, check_bools
from shardfit.foreign.keys import Key

# What the eval keys show in the plan ("{...}": the planned workload's fields).
EVAL_KEYS = {
    "eval_strategy": Key("evaluation while training: {eval_batch} rows per eval forward (0: none)"),
    "evaluation_strategy": Key("evaluation while training: {eval_batch} rows per eval forward (0: none)"),
    "per_device_eval_batch_size": Key("eval forward of {eval_batch} rows per GPU, its loss upcast to fp32"),
    "eval_accumulation_steps": Key("eval logits moved to the CPU every {eval_accumulation} steps (0: at the end)"),
    "prediction_loss_only": Key("eval logits kept on the GPU: {eval_keeps_logits}"),
    "max_eval_samples": Key("eval set of {eval_examples} examples (bounds the logits kept)"),
}
_SET = re.compile(r"\b(compute_metrics|preprocess_logits_for_metrics)\s*=\s*(?!None\b)[A-Za-z_(\[]")


def strategy_evaluates(value: Any, default: bool) -> bool:
    """Whether an `eval_strategy` value evaluates while training (steps, epoch); `default` where it is not given."""
    if value is None:
        return default
    return str(value).strip().lower().removeprefix("intervalstrategy.") not in (*FALSE_WORDS, "no")


def held_out(fraction: Any, key: str, where: str) -> bool:
    """Whether a tool's held-out share (`val_size`, `val_set_size`, `split_dataset_ratio`) splits off any data."""
    return fraction is not None and as_float(fraction, key, where) > 0


def script_keeps_logits(script: Path | None) -> tuple[bool, str | None]:
    """(whether the training script's Trainer keeps the eval logits, a note where that is assumed): it passes a
    compute_metrics and no preprocess_logits_for_metrics. Without a script to read, none is assumed (what the
    causal-LM examples and TRL do)."""
    if script is None or not script.is_file():
        return False, ("evaluation planned without compute_metrics (no training script read): a script that passes "
                       "one keeps every eval step's logits on the GPU unless eval_accumulation_steps is set")
    given = {m.group(1) for m in _SET.finditer(script.read_text(errors="replace"))}
    return "compute_metrics" in given and "preprocess_logits_for_metrics" not in given, None


def trainer_eval(get: Callable[[str], Any], at: Callable[[str], str], *, evaluates: bool, batch_key: str,
                 default_batch: int, keeps_logits: bool) -> dict[str, Any]:
    """The Workload fields of a job's evaluation while training (none where it does not evaluate): `get` reads the
    job's keys, `at` says where one is given; `batch_key` is the tool's eval batch key and `default_batch` its
    default; `keeps_logits` whether the tool's metrics keep logits at all (prediction_loss_only then decides)."""
    if not evaluates:
        return {}
    given = get(batch_key)
    batch = default_batch if given is None else as_int(given, batch_key, at(batch_key))
    if batch < 1:
        raise UserError(f"{at(batch_key)}: '{batch_key}' is {given!r}; expected 1 or more rows per eval batch.")
    steps = get("eval_accumulation_steps")
    steps = 0 if steps is None or str(steps).strip().lower() in FALSE_WORDS else \
        as_int(steps, "eval_accumulation_steps", at("eval_accumulation_steps"))
    if steps < 0:
        raise UserError(f"{at('eval_accumulation_steps')}: 'eval_accumulation_steps' is {steps}; expected 1 or more "
                        "(or leave it out).")
    examples = get("max_eval_samples")
    examples = 0 if examples is None else max(0, as_int(examples, "max_eval_samples", at("max_eval_samples")))
    check_bools({"prediction_loss_only": get("prediction_loss_only")}, ("prediction_loss_only",), at)
    loss_only = as_bool(get("prediction_loss_only") or False)
    return {"eval_batch": batch, "eval_batch_key": batch_key, "eval_keeps_logits": keeps_logits and not loss_only,
            "eval_accumulation": steps, "eval_examples": examples}


def held_out_eval(src: Any, *, share: str, data: str, strategy_default: bool, batch_key: str,
                  default_batch: int) -> dict[str, Any]:
    """The evaluation of a tool that evaluates on held-out data (LLaMA-Factory, axolotl, ms-swift): some when the
    job splits a share off its data (`share` above 0) or names eval data (`data`), and its `eval_strategy` (given,
    else `strategy_default`) evaluates. None of them keeps logits (their metrics reduce them to argmax ids first)."""
    evaluates = held_out(src.get(share), share, src.at(share)) or bool(src.get(data))
    evaluates = evaluates and strategy_evaluates(src.get("eval_strategy"), strategy_default)
    return trainer_eval(src.get, src.at, evaluates=evaluates, batch_key=batch_key, default_batch=default_batch,
                        keeps_logits=False)


def hf_eval(src: Any, script: Path | None, preference: bool, generate: bool, notes: list[str]) -> dict[str, Any]:
    """The evaluation of an HF Trainer or TRL job (`script`: its training script, where there is one): when its
    eval_strategy evaluates; logits kept as `script_keeps_logits` finds, never for TRL's preference trainers
    (`preference`: their prediction_step returns the reward margins) or under predict_with_generate (`generate`:
    generated ids)."""
    if not strategy_evaluates(src.get("eval_strategy", src.get("evaluation_strategy")), False):
        return {}
    keeps, note = (False, None) if preference or generate else script_keeps_logits(script)
    if note and not as_bool(src.get("prediction_loss_only") or False):
        notes.append(note)
    return trainer_eval(src.get, src.at, evaluates=True, batch_key="per_device_eval_batch_size", default_batch=8,
                        keeps_logits=keeps)
