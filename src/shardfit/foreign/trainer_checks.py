"""TrainingArguments that the HF Trainer refuses before it trains: read from transformers 5.23's training_args.py
(`TrainingArguments.__post_init__`, `_validate_args`, `_apply_legacy_fsdp_to_config`), and refused here the same
way, so that plan, check and convert say so (exit 2 naming the key and the fix) instead of planning a job that
never starts. Only refusals that hold whatever the machine (not bf16 support, not the torch version)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import FSDP2_DEFAULT_SINCE, STR_TO_BOOL_WORDS, TRUE_WORDS
from shardfit.foreign.keys import Source
from shardfit.foreign.trainer_eval import swift_val_data
from shardfit.plan.sdpa_classes import release_of

# FSDP options the Trainer's FSDP2 takes in `--fsdp`; the other sharding strategies are FSDP1's.
FSDP2_STRATEGIES = ("full_shard", "shard_grad_op")
FSDP1_ONLY = ("hybrid_shard", "hybrid_shard_zero2", "no_shard")


def trainer_defaults(trl_config: str | None) -> dict[str, Any]:
    """The TrainingArguments defaults the checks assume: the HF Trainer's, or where the script's arguments are a
    TRL config (script_ast.py `trl_config`), TRL's overrides of them: logging_steps 10 for every config,
    GRPOConfig and RLOOConfig included (trl 0.19.1, 0.23.0 and 1.16.0; only TRL's experimental async trainers log
    every step)."""
    if trl_config is None:
        return DEFAULTS
    return DEFAULTS | {"logging_steps": 10}


def check_trainer_args(src: Source, whose: str, option: str = "--", defaults: Mapping[str, Any] | None = None) \
        -> None:
    """A UserError for the first TrainingArguments combination the HF Trainer refuses at start; `whose` names the
    tool running it, `option` how it writes a key ("--" on a command line, "" in YAML), `defaults` the arguments'
    defaults (`trainer_defaults`; the HF Trainer's unless given)."""
    defaults = DEFAULTS if defaults is None else defaults
    values = {k: src.get(k) for k in src.values}
    if "evaluation_strategy" in values and "eval_strategy" not in values:
        values["eval_strategy"] = values["evaluation_strategy"]

    def say(key: str) -> str:
        return f"{option}{key} {_text(values.get(key, defaults.get(key)))}"

    def refuse(key: str, why: str, fix: str) -> UserError:
        return UserError(f"{src.at(key)}: {say(key)}: {why}; {whose} refuses it before training (transformers' "
                         f"TrainingArguments). {fix}")

    logging, eval_, save = (_word(values, k) for k in ("logging_strategy", "eval_strategy", "save_strategy"))
    steps = {k: _number(values, k, src, defaults) for k in ("logging_steps", "eval_steps", "save_steps")}
    if logging == "steps" and steps["logging_steps"] == 0:
        raise refuse("logging_steps", "logging every 0 steps with logging_strategy steps",
                     f"Set {option}logging_steps to a step count (or a fraction of the run below 1), or "
                     f"{option}logging_strategy to epoch or no.")
    if eval_ == "steps" and not steps["eval_steps"] and steps["logging_steps"] == 0:
        raise refuse("eval_steps", "evaluating with eval_strategy steps but neither eval_steps nor logging_steps "
                     "says how often", f"Give {option}eval_steps N.")
    for key, strategy in (("logging_steps", logging), ("eval_steps", eval_), ("save_steps", save)):
        n = steps[key]
        if strategy == "steps" and n is not None and n > 1 and n != int(n):
            raise refuse(key, "a step count above 1 must be whole (below 1 it is a fraction of the run)",
                         f"Give {option}{key} {int(n)} or a fraction below 1.")
    if _flag(values, "load_best_model_at_end") and save != "best":
        _check_best_model(values, steps, (eval_, save), refuse, option)
    if _flag(values, "fp16") and _flag(values, "bf16"):
        raise refuse("bf16", "with fp16 also true: at most one of fp16 and bf16", f"Keep one of {option}bf16 and "
                     f"{option}fp16.")
    if str(values.get("lr_scheduler_type", "")).lower() in ("reduce_lr_on_plateau", "greedy") and eval_ == "no":
        raise refuse("lr_scheduler_type", "this scheduler steps on evaluation results, and eval_strategy is no",
                     f"Set {option}eval_strategy steps (or epoch), or another scheduler.")
    warmup = _number(values, "warmup_steps", src)
    if warmup is not None and warmup < 0:
        raise refuse("warmup_steps", "a negative warmup", f"Give {option}warmup_steps 0 or more.")


def check_swift_args(src: Source) -> None:
    """The HF Trainer's refusals for an ms-swift job (`swift sft|pt|rlhf`): its arguments end in transformers'
    Seq2SeqTrainingArguments (or TRL's configs), built from every field as ms-swift resolved it
    (`TrainerFactory.get_training_args`, ms-swift 4.6), so TrainingArguments' `__post_init__` runs on ms-swift's
    values: logging_steps 5, eval_strategy that of saving, eval_steps save_steps, and evaluation off without
    validation data (no --val_dataset, --eval_dataset, --cached_val_dataset or --split_dataset_ratio above 0), and
    fp16/bf16 from --torch_dtype where not given (so --fp16 true beside a bfloat16 dtype sets both)."""
    values = dict(src.values)
    # fp16/bf16 left unset follow --torch_dtype (`_init_mixed_precision`: float16 and float32 train in fp16)
    dtype = str(values.get("torch_dtype", "")).strip().lower()
    if dtype in SWIFT_DTYPES:
        for key, on in zip(("fp16", "bf16"), SWIFT_DTYPES[dtype], strict=True):
            values.setdefault(key, on)
    # no refusal where ms-swift's version decides (split_dataset_ratio's default: swift_val_data None)
    evaluates = swift_val_data(values, src.at) is not False
    save = _word(values, "save_strategy")
    if not evaluates:
        if _flag(values, "load_best_model_at_end") and save != "best":
            raise UserError(f"{src.at('load_best_model_at_end')}: --load_best_model_at_end true without validation "
                            f"data: ms-swift then sets eval_strategy no, and the HF Trainer it runs refuses "
                            f"loading the best model without evaluating (transformers' TrainingArguments). Give "
                            f"--val_dataset or --split_dataset_ratio, or drop --load_best_model_at_end.")
        values["eval_strategy"] = "no"
    elif values.get("eval_strategy") is None:
        values["eval_strategy"] = save
    if _word(values, "eval_strategy") == "steps" and values.get("eval_steps") is None:
        values["eval_steps"] = values.get("save_steps", DEFAULTS["save_steps"])
    check_trainer_args(Source(src.path, values, list(values), src.lines),
                       "ms-swift (its arguments are the HF Trainer's)", "--", DEFAULTS | {"logging_steps": 5})


# ms-swift's --torch_dtype -> the (fp16, bf16) it sets where neither is given.
SWIFT_DTYPES = {"bfloat16": ("false", "true"), "bf16": ("false", "true"), "float16": ("true", "false"),
                "fp16": ("true", "false"), "float32": ("true", "false"), "fp32": ("true", "false")}


DEFAULTS = {"logging_strategy": "steps", "eval_strategy": "no", "save_strategy": "steps", "logging_steps": 500,
            "save_steps": 500}


def _check_best_model(values: Mapping[str, Any], steps: Mapping[str, float | None], strategies: tuple[str, str],
                      refuse: Any, option: str) -> None:
    """load_best_model_at_end: evaluation and saving on the same strategy, and under steps, saves on evaluation
    steps (save_steps a whole multiple of eval_steps, both counts or both fractions)."""
    eval_, save = strategies
    if eval_ != save:
        raise refuse("load_best_model_at_end", f"needs the save and eval strategies to match, and they are "
                     f"{save} and {eval_}", f"Set {option}eval_strategy {save} (or {option}save_strategy best).")
    if eval_ != "steps":
        return
    save_n = steps["save_steps"] if steps["save_steps"] is not None else 500
    eval_n = steps["eval_steps"] or steps["logging_steps"] or 500  # eval_steps falls back to logging_steps
    # as _validate_args tests it: a remainder, then for fractions one on a millionth's scale
    if save_n % eval_n == 0:
        return
    if (eval_n < 1 or save_n < 1) and (eval_n < 1) == (save_n < 1) and \
            (save_n * 1_000_000) % (eval_n * 1_000_000) == 0:
        return
    raise refuse("save_steps", f"is not a whole multiple of eval_steps {_text(eval_n)}, and "
                 f"load_best_model_at_end keeps only checkpoints saved at an evaluation",
                 f"Set {option}save_steps to a multiple of {option}eval_steps (e.g. {_multiple(save_n, eval_n)}), "
                 f"both step counts or both fractions.")


def _multiple(save: float, every: float) -> str:
    if every >= 1 and save >= 1:
        return _text(max(1, round(save / every)) * every)
    return _text(every)


def check_fsdp2_options(fsdp: str, cfg: Mapping[str, Any], version: str, fsdp1: bool, where: str) -> None:
    """`--fsdp` options and fsdp_config that the Trainer's FSDP2 refuses (transformers >= 5.10, which runs FSDP2
    unless fsdp_config's version is 1): a strategy other than full_shard / shard_grad_op in `--fsdp`
    (`_apply_legacy_fsdp_to_config`: "only available with FSDP1"), and a reshard_after_forward that is no
    boolean (`_process_fsdp_args` reads it with str_to_bool)."""
    if fsdp1 or release_of(version) < FSDP2_DEFAULT_SINCE:
        return
    for option in fsdp.lower().split():
        if option in FSDP1_ONLY:
            raise UserError(f"{where}: --fsdp {option} with FSDP2 (transformers {version}'s default): the Trainer "
                            f"refuses it before training (\"only available with FSDP1\"). Use --fsdp "
                            f"{' or '.join(FSDP2_STRATEGIES)}, or set \"version\": 1 in --fsdp_config (FSDP1).")
    value = cfg.get("reshard_after_forward")
    if value is not None and not isinstance(value, bool) and str(value).strip().lower() not in STR_TO_BOOL_WORDS:
        raise UserError(f"{where}: fsdp_config reshard_after_forward {value!r} with FSDP2: the Trainer reads it as "
                        f"true or false and refuses anything else (\"invalid truth value\"). Give true (full_shard) "
                        f"or false (shard_grad_op), or set \"version\": 1 for FSDP1's strategies.")


def _word(values: Mapping[str, Any], key: str) -> str:
    value = values.get(key)
    return DEFAULTS[key] if value is None else str(value).strip().lower()


def _flag(values: Mapping[str, Any], key: str) -> bool:
    value = values.get(key)
    return value is True or str(value).strip().lower() in TRUE_WORDS if value is not None else False


def _number(values: Mapping[str, Any], key: str, src: Source,
            defaults: Mapping[str, Any] = DEFAULTS) -> float | None:
    value = values.get(key, defaults.get(key))
    if value is None or str(value).strip().lower() in ("none", "null", ""):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{src.at(key)}: '{key}' is {value!r}; expected a number of steps.") from None
    if not math.isfinite(out):  # the Trainer's int() of it raises OverflowError or ValueError
        raise UserError(f"{src.at(key)}: '{key}' is {value!r}; give a whole number of steps (or a fraction of the "
                        f"run below 1).")
    return out


def _text(value: Any) -> str:
    """A value as the job gives it, booleans as true/false whichever way the file spelled them."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).lower() if str(value) in ("True", "False") else str(value)
