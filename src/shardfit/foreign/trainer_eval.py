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
- ms-swift: with validation data (`val_dataset`, `eval_dataset`, `cached_val_dataset`, or `split_dataset_ratio`
  > 0: DataArguments defaults it to 0.01 in ms-swift 3.0 to 3.5, to 0 from 3.6) unless `eval_strategy`, which
  follows `save_strategy` where not given, is no; `per_device_eval_batch_size` defaults to 1 (TrainArgumentsMixin).
  Its `acc` metric reduces the logits to their argmax first (`preprocess_logits_for_acc`): no logits kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import FALSE_WORDS, as_bool, as_float, as_int, check_bools
from shardfit.foreign.keys import Key
from shardfit.foreign.script_ast import ScriptSettings

# What the eval keys show in the plan ("{...}": the planned workload's fields).
EVAL_KEYS = {
    "eval_strategy": Key("evaluation while training: {eval_batch} rows per eval forward (0: none)"),
    "evaluation_strategy": Key("evaluation while training: {eval_batch} rows per eval forward (0: none)"),
    "per_device_eval_batch_size": Key("eval forward of {eval_batch} rows per GPU, its loss upcast to fp32"),
    "eval_accumulation_steps": Key("eval logits moved to the CPU every {eval_accumulation} steps (0: at the end)"),
    "prediction_loss_only": Key("eval logits kept on the GPU: {eval_keeps_logits}"),
    "max_eval_samples": Key("eval set of {eval_examples} examples (bounds the logits kept)"),
    "batch_eval_metrics": Key("eval logits kept on the GPU: {eval_keeps_logits}"),
    "eval_do_concat_batches": Key("eval logits concatenated step by step: {eval_concat}"),
}


def strategy_evaluates(value: Any, default: bool) -> bool:
    """Whether an `eval_strategy` value evaluates while training (steps, epoch); `default` where it is not given."""
    if value is None:
        return default
    return str(value).strip().lower().removeprefix("intervalstrategy.") not in (*FALSE_WORDS, "no")


def held_out(fraction: Any, key: str, where: str) -> bool:
    """Whether a tool's held-out share (`val_size`, `val_set_size`, `split_dataset_ratio`) splits off any data."""
    return fraction is not None and as_float(fraction, key, where) > 0


def script_keeps_logits(code: ScriptSettings) -> tuple[bool, str | None]:
    """(whether the training script's Trainer keeps the eval logits, a note where that is assumed): the trainer
    call that trains (script_ast.py `read_script`, `metrics`) passes a compute_metrics and no
    preprocess_logits_for_metrics. Where no script was read, or that call cannot be read, none is assumed (what the
    causal-LM examples and TRL do)."""
    if code.metrics_unread:
        return False, _ASSUMED.format(why=code.metrics_unread)
    return "compute_metrics" in code.metrics and "preprocess_logits_for_metrics" not in code.metrics, None


_ASSUMED = ("evaluation planned without compute_metrics ({why}): a script that passes one keeps every eval step's "
            "logits on the GPU unless eval_accumulation_steps is set")


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
    examples = get("max_eval_samples")
    examples = 0 if examples is None else max(0, as_int(examples, "max_eval_samples", at("max_eval_samples")))
    flags = ("prediction_loss_only", "batch_eval_metrics", "eval_do_concat_batches")
    check_bools({k: get(k) for k in flags}, flags, at)
    # batch_eval_metrics hands each step's logits to compute_metrics and drops them (no container, and
    # eval_accumulation_steps is not read); eval_do_concat_batches false appends each step's to a list
    drops = as_bool(get("prediction_loss_only") or False) or as_bool(get("batch_eval_metrics") or False)
    concat = get("eval_do_concat_batches")
    return {"eval_batch": batch, "eval_batch_key": batch_key, "eval_keeps_logits": keeps_logits and not drops,
            "eval_accumulation": _accumulation(get("eval_accumulation_steps"), at("eval_accumulation_steps")),
            "eval_examples": examples, "eval_concat": True if concat is None else as_bool(concat)}


def _accumulation(given: Any, at: str) -> int:
    """eval_accumulation_steps as evaluation_loop reads it: 0 where unset (None); 0 itself fails the first eval
    step, which tests `(step + 1) % eval_accumulation_steps` (ZeroDivisionError)."""
    if given is None or str(given).strip().lower() in ("none", "null"):
        return 0
    steps = as_int(given, "eval_accumulation_steps", at)
    if steps < 1:
        why = "the first eval step divides by it ((step + 1) % 0: ZeroDivisionError), so the job fails when it " \
            "first evaluates" if steps == 0 else "expected 1 or more"
        raise UserError(f"{at}: 'eval_accumulation_steps' is {given!r}: {why}. Set it to 1 or more (1 moves each "
                        f"step's logits to the CPU), or leave it out.")
    return steps


def held_out_eval(src: Any, *, share: str, data: str, strategy_default: bool, batch_key: str,
                  default_batch: int) -> dict[str, Any]:
    """The evaluation of a tool that evaluates on held-out data (LLaMA-Factory, axolotl, ms-swift): some when the
    job splits a share off its data (`share` above 0) or names eval data (`data`), and its `eval_strategy` (given,
    else `strategy_default`) evaluates. None of them keeps logits (their metrics reduce them to argmax ids first)."""
    evaluates = held_out(src.get(share), share, src.at(share)) or bool(src.get(data))
    evaluates = evaluates and strategy_evaluates(src.get("eval_strategy"), strategy_default)
    return trainer_eval(src.get, src.at, evaluates=evaluates, batch_key=batch_key, default_batch=default_batch,
                        keeps_logits=False)


# ms-swift's validation data: named (`--val_dataset`, `--eval_dataset`, `--cached_val_dataset`), or split off the
# training set by `--split_dataset_ratio`, whose default DataArguments changed from 0.01 (3.0 to 3.5) to 0 (3.6 on).
SWIFT_VAL_KEYS = ("val_dataset", "eval_dataset", "cached_val_dataset")
SWIFT_SPLIT_NOTE = ("split_dataset_ratio not set: 0 as in ms-swift 3.6 and later (no validation data: no "
                    "evaluation); ms-swift 3.0 to 3.5 default it to 0.01 and evaluate at each save, "
                    "per_device_eval_batch_size 1 rows: pass --split_dataset_ratio 0.01 to plan that (--tuner_type, "
                    "ms-swift 4's name for --train_type, says 4)")


def swift_val_data(values: Mapping[str, Any], at: Callable[[str], str]) -> bool | None:
    """Whether an ms-swift job has validation data (`_val_dataset_exists`, or `eval_dataset`: sft_args.py, ms-swift
    3.x and 4.x), with which it evaluates: one named, or a split_dataset_ratio above 0 (`--streaming` sets it 0).
    None where ms-swift's version decides: no ratio given, and the job is not ms-swift 4's (`--tuner_type`)."""
    if any(_named(values.get(k)) for k in SWIFT_VAL_KEYS):
        return True
    if as_bool(values.get("streaming") or False):
        return False
    ratio = values.get("split_dataset_ratio")
    if ratio is None:
        return False if "tuner_type" in values else None
    return as_float(ratio, "split_dataset_ratio", at("split_dataset_ratio")) > 0


def swift_eval_strategy(values: Mapping[str, Any]) -> str:
    """ms-swift's eval_strategy: the one given, else its save_strategy (`_init_eval_strategy`), the HF default
    steps where neither is."""
    given = values.get("eval_strategy", values.get("save_strategy"))
    return "steps" if given is None else str(given).strip().lower()


def swift_eval(src: Any, notes: list[str]) -> dict[str, Any]:
    """The evaluation of an ms-swift job: with validation data (`swift_val_data`) on an eval_strategy that
    evaluates (`swift_eval_strategy`), per_device_eval_batch_size rows (default 1: TrainArgumentsMixin); no logits
    kept (its `acc` metric reduces them to argmax ids first). Where its version decides, planned as 3.6 and later
    do, with a note."""
    data = swift_val_data(src.values, src.at)
    on = strategy_evaluates(swift_eval_strategy(src.values), True)
    if data is None and on:
        notes.append(SWIFT_SPLIT_NOTE)
    return trainer_eval(src.get, src.at, evaluates=bool(data) and on, batch_key="per_device_eval_batch_size",
                        default_batch=1, keeps_logits=False)


def _named(value: Any) -> bool:
    """A dataset key given a name (not None, null, or an empty list)."""
    return value is not None and str(value).strip().strip("[]'\"") not in ("", "None", "null")


def hf_eval(src: Any, code: ScriptSettings, preference: bool, generate: bool, notes: list[str]) -> dict[str, Any]:
    """The evaluation of an HF Trainer or TRL job (`code`: what its training script sets, where there is one): when its
    eval_strategy evaluates; logits kept as `script_keeps_logits` finds, never for TRL's preference trainers
    (`preference`: their prediction_step returns the reward margins) or under predict_with_generate (`generate`:
    generated ids)."""
    if not strategy_evaluates(src.get("eval_strategy", src.get("evaluation_strategy")), False):
        return {}
    keeps, note = (False, None) if preference or generate else script_keeps_logits(code)
    if note and not as_bool(src.get("prediction_loss_only") or False):
        notes.append(note)
    return trainer_eval(src.get, src.at, evaluates=True, batch_key="per_device_eval_batch_size", default_batch=8,
                        keeps_logits=keeps)
