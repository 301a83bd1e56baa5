"""axolotl's refusals of a YAML's saving, evaluation and warmup schedule, as its own config schema makes them before
anything loads (axolotl 0.19.0, utils/schemas/validation.py: `check_warmup`, `check_saves`, `check_evals`,
`check_early_stopping`), so that plan, check and convert exit 2 naming the key instead of planning a job axolotl
never starts. Only these: axolotl validates its YAML with its own schema, and the HF Trainer's checks
(trainer_checks.py) are not assumed to hold for it."""

from __future__ import annotations

from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.keys import Source
from shardfit.foreign.trainer_checks import _number as steps_of


def check_axolotl_schedule(src: Source) -> None:
    """A UserError for the first schedule combination axolotl's schema refuses. The schema tests the YAML as
    written (truthy values), except early stopping, which it tests on the parsed config."""
    get = src.get

    def refuse(key: str, why: str, fix: str) -> UserError:
        return UserError(f"{src.at(key)}: {why}; axolotl's config validation refuses it before training. {fix}")

    if get("warmup_steps") and get("warmup_ratio"):
        raise refuse("warmup_ratio", "'warmup_steps' and 'warmup_ratio' are both set (they exclude each other)",
                     "Keep one of them.")
    if get("save_strategy") and get("save_steps") and get("save_strategy") != "steps":
        raise refuse("save_steps", f"'save_steps: {get('save_steps')}' with 'save_strategy: "
                     f"{get('save_strategy')}'", "Set save_strategy: steps, or remove save_steps.")
    if get("saves_per_epoch") and get("save_steps"):
        raise refuse("save_steps", "'save_steps' and 'saves_per_epoch' are both set (they exclude each other)",
                     "Keep one of them.")
    if get("eval_strategy") and get("eval_steps") and get("eval_strategy") != "steps":
        raise refuse("eval_steps", f"'eval_steps: {get('eval_steps')}' with 'eval_strategy: "
                     f"{get('eval_strategy')}'", "Set eval_strategy: steps, or remove eval_steps.")
    if _zero(get("val_set_size")) and (get("eval_steps") or get("eval_strategy")) and not get("test_datasets") \
            and get("eval_strategy") != "no":
        key = "eval_steps" if get("eval_steps") else "eval_strategy"
        raise refuse(key, f"'{key}' with 'val_set_size: 0' and no test_datasets: nothing to evaluate",
                     "Give val_set_size above 0 (or test_datasets), or remove the evaluation settings.")
    if get("evals_per_epoch") and get("eval_steps"):
        raise refuse("eval_steps", "'eval_steps' and 'evals_per_epoch' are both set (they exclude each other)",
                     "Keep one of them.")
    if get("evals_per_epoch") and get("eval_strategy") and get("eval_strategy") != "steps":
        raise refuse("eval_strategy", f"'eval_strategy: {get('eval_strategy')}' with 'evals_per_epoch'",
                     "Leave eval_strategy out or set it to steps.")
    if get("early_stopping_patience"):
        save, every = get("save_steps"), get("eval_steps")
        steps = {"save_steps": save, "eval_steps": every}
        # read as the Trainer's step counts are (trainer_checks.py): a non-number or inf is exit 2, "none" is unset
        save_n, every_n = steps_of(steps, "save_steps", src, {}), steps_of(steps, "eval_steps", src, {})
        if not save_n or not every_n:
            raise refuse("early_stopping_patience", "'early_stopping_patience' without both save_steps and "
                         "eval_steps", "Set save_steps and eval_steps, eval_steps dividing save_steps.")
        if save_n % every_n:
            raise refuse("save_steps", f"'early_stopping_patience' with save_steps {save} not a multiple of "
                         f"eval_steps {every}", "Make eval_steps divide save_steps.")


def check_fp32_norms(src: Source) -> None:
    """A UserError where `fp32_norms` is on without FSDP2, which axolotl's schema refuses (axolotl 0.17.0 to 0.19.0
    utils/schemas/config.py `check_fp32_norms`: an fsdp_config block and fsdp_version 2, as FSDP1's flat
    parameters hold one dtype per wrapped unit). The version is read where the reader reads it: top level, else
    fsdp_config's `version`/`fsdp_version`."""
    if not src.flag("fp32_norms", "false"):
        return
    cfg = src.get("fsdp_config")
    if not cfg:
        raise UserError(f"{src.at('fp32_norms')}: 'fp32_norms: true' without an fsdp_config block; axolotl's config "
                        f"validation refuses it (\"fp32_norms requires FSDP to be enabled\"). Add fsdp_config with "
                        f"fsdp_version: 2, or remove fp32_norms.")
    inner = cfg if isinstance(cfg, dict) else {}
    version = src.get("fsdp_version", inner.get("fsdp_version", inner.get("version")))
    if str(version) != "2":
        raise UserError(f"{src.at('fp32_norms')}: 'fp32_norms: true' with fsdp_version {version}; axolotl's config "
                        f"validation refuses it (\"fp32_norms requires fsdp_version: 2\"). Set fsdp_version: 2, or "
                        f"remove fp32_norms.")


def _zero(value: Any) -> bool:
    return value is not None and not isinstance(value, bool) and isinstance(value, int | float) and value == 0
