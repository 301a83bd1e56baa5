"""What the tools share: the HF Trainer's arguments and memory behaviour (the loss of the installed transformers,
attention kernels, optimizers), YAML loading with line numbers, and local data paths."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from shardfit.config.load import read_yaml
from shardfit.errors import UserError
from shardfit.foreign.job import ForeignJob
from shardfit.plan.optimizer_kinds import DTYPE_BYTES, WEIGHT_DECAY_COPIES, anyprecision_kind, rmsprop_kind
from shardfit.plan.sdpa_classes import NO_SDPA, release_of, without_sdpa

# HF TrainingArguments that change nothing the planner counts (logging, saving, schedules, evaluation cadence,
# data loading, hub and reporting). Whether and how the job evaluates while training counts (foreign/trainer_eval.py).
TRAINER_NO_EFFECT = {
    "output_dir", "overwrite_output_dir", "logging_steps", "logging_dir", "logging_strategy", "logging_first_step",
    "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_safetensors", "eval_steps",
    "do_train", "do_eval", "do_predict", "learning_rate", "lr_scheduler_type",
    "warmup_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "num_train_epochs", "max_steps", "seed", "data_seed", "report_to", "run_name", "ddp_timeout",
    "resume_from_checkpoint",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "remove_unused_columns",
    "push_to_hub", "hub_model_id", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "disable_tqdm", "log_level", "plot_loss", "lazy_preprocess", "group_by_length", "include_num_input_tokens_seen",
    "local_rank", "tf32",
    "ddp_backend", "label_names", "save_on_each_node", "use_cpu", "ignore_data_skip",
}


def hf_loss(version: str, fused: bool) -> str:
    """The planner's loss for a run through transformers' own causal-LM loss at `version`: 4.46-4.48 copied the
    shifted fp32 logits (`full_shift`); before and after, `full`. A fused linear + cross-entropy kernel (Liger,
    Cut Cross-Entropy) never holds the full logits: closest is shardfit's chunked loss."""
    if fused:
        return "chunked"
    return "full_shift" if release_of(version) in ((4, 46), (4, 47), (4, 48)) else "full"


# Whether a class has SDPA under a release is plan/sdpa_classes.py's table (read in the published wheels), the one
# the rank and the planner read. Releases in which a class that has SDPA still defaults to eager attention: Gemma2's
# 4.45 to 4.47 overrode `_check_and_enable_sdpa` to swap the default SDPA for eager (its logit soft-capping); 4.48's
# attention interface dropped the override.
EAGER_DEFAULT = {"gemma2": ((4, 45), (4, 48))}


def default_attention(version: str, model_type: str, notes: list[str]) -> str:
    """The planner's attention for a job that names none (or leaves it to transformers: LLaMA-Factory's `auto`)
    under transformers `version` for a `model_type` model: `sdpa`, or `eager` where its class has no SDPA in that
    release (sdpa_classes.py `without_sdpa`: before it gained SDPA, or after it lost it) or the release defaulted it
    to eager, with a note saying so."""
    lacks = without_sdpa(model_type, version)
    if lacks is not None:
        notes.append(_eager_note(version, model_type, *lacks))
        return "eager"
    window, at = EAGER_DEFAULT.get(model_type), release_of(version)
    if window is not None and window[0] <= at < window[1]:
        notes.append(f"attention not set: transformers {version} defaults {model_type} models to eager attention "
                     f"({window[0][0]}.{window[0][1]} to {window[1][0]}.{window[1][1] - 1} do): planned with eager "
                     f"attention")
        return "eager"
    return "sdpa"


def _eager_note(version: str, model_type: str, first: tuple[int, int] | None, until: tuple[int, int] | None) -> str:
    """The note for a job planned eager because its class has no SDPA under `version`, in [first, until)."""
    if until is not None:
        return (f"attention not set: transformers {version} attends eagerly"
                f"{f' in {model_type} models' if model_type in NO_SDPA else ''} (SDPA is its default from "
                f"{until[0]}.{until[1]}): planned with eager attention")
    since = f"from {first[0]}.{first[1]} on; SDPA before" if first is not None else "in every release"
    return (f"attention not set: transformers {version} attends eagerly in {model_type} models (its class has no "
            f"SDPA, {since}): planned with eager attention")


# The keys by which the tools name transformers' SDPA (the values that do), and the eager setting each takes
# instead: a class without SDPA refuses it at load (`sdpa_refusal`).
SDPA_KEYS = {"attn_implementation": (("sdpa",), "attn_implementation eager (or leave it unset: eager then)"),
             "attn_impl": (("sdpa",), "--attn_impl eager"),
             "flash_attn": (("sdpa",), "flash_attn: disabled (LLaMA-Factory's eager attention)"),
             "sdp_attention": (("true", "1", "yes"), "attn_implementation: eager in place of sdp_attention")}


def named_sdpa(keys: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(key, its value, the eager fix) of the key that names transformers' SDPA among a job's read `keys` (as
    `record` files them: the value, then its effect in parentheses); None where none does."""
    for key, (words, fix) in SDPA_KEYS.items():
        value = keys.get(key, "").split(" (", 1)[0].strip()
        if value.lower() in words:
            return key, value, fix
    return None


# Attention implementations by the names the tools use, onto the planner's three memory behaviours.
ATTENTION = {"fa2": "flash", "flash_attn": "flash", "flash_attention_2": "flash", "flash_attention_3": "flash",
             "fa3": "flash", "flex_attention": "flash", "sdpa": "sdpa", "auto": "sdpa", "eager": "eager",
             "disabled": "eager", "none": "sdpa"}
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adam8bit", "adamw8bit")
# torchao's 8-bit AdamW (transformers' adamw_torch_8bit, axolotl's ao_adamw_8bit): two 8-bit states with an fp32
# scale per block of 256, the same bytes as bitsandbytes' (torchao subclass_8bit.py `OptimState8bit.zeros`).
TORCHAO_8BIT = ("adamw_torch_8bit", "ao_adamw_8bit")
TORCHAO_4BIT = ("adamw_torch_4bit", "ao_adamw_4bit")
# bitsandbytes' optimizers beyond AdamW by the HF Trainer's names: their 32-bit states are fp32 whatever the weights.
BNB_OTHERS = ("lion_", "paged_lion_", "ademamix", "paged_ademamix", "rmsprop_bnb")
# The HF Trainer's other `optim` names (transformers' trainer_optimizer.py `_OPTIMIZER_HANDLERS`) by the planner's
# optimizer (plan/optimizer_kinds.py): `adafactor` is transformers' Adafactor without beta1; `sgd`, `adagrad`,
# `rmsprop` torch's with their defaults (no momentum, not centered); the rest bitsandbytes' (BNB_OTHERS) or
# schedulefree's.
NAMED = {"adafactor": "adafactor", "sgd": "sgd", "adagrad": "adagrad", "rmsprop": "rmsprop",
         "lion_32bit": "lion", "paged_lion_32bit": "lion", "lion_8bit": "lion8bit", "paged_lion_8bit": "lion8bit",
         "rmsprop_bnb": "rmsprop", "rmsprop_bnb_32bit": "rmsprop", "rmsprop_bnb_8bit": "rmsprop8bit",
         "ademamix": "ademamix", "paged_ademamix_32bit": "ademamix", "ademamix_8bit": "ademamix8bit",
         "paged_ademamix_8bit": "ademamix8bit", "schedule_free_adamw": "schedule_free_adamw",
         "schedule_free_radam": "schedule_free_radam", "schedule_free_sgd": "schedule_free_sgd"}
# torch optimizers the Trainer builds with their default multi-tensor step on a GPU (`foreach`, copies of each
# param group: plan/optimizer_kinds.py `group_copies`), and schedulefree's (foreach by default).
MULTI_TENSOR = ("adamw_torch", "adagrad", "rmsprop", "sgd", "schedule_free_adamw", "schedule_free_radam",
                "schedule_free_sgd")


def optimizer(name: str, optim_args: Any = None) -> str | None:
    """The planner's optimizer (plan/optimizer_kinds.py) for the HF Trainer's `optim` = `name`, or None for one the
    planner does not model (paged AdamW counts as AdamW, from bitsandbytes: `bitsandbytes_optimizer`;
    `optimizer_stand_in` says what such a one is planned as). `optim_args` (the Trainer's `optim_args`, as its
    `sgd` and `rmsprop` read them, `torch_optim_args`): a non-zero `momentum` keeps a momentum buffer, RMSprop's
    `centered` a gradient average, AnyPrecision AdamW's `use_kahan_summation` a compensation buffer
    (`anyprecision_settings`)."""
    n = name.lower()
    if n == ANYPRECISION:
        return anyprecision_settings(optim_args)[0]
    if n in EIGHT_BIT_OPTIMIZERS or n in TORCHAO_8BIT:
        return "adamw8bit"
    if n in TORCHAO_4BIT:
        return None
    if n.startswith(("adamw", "paged_adamw")) or n == "adam":
        return "adamw"
    momentum = _optim_arg(optim_args, "momentum") not in (None, 0.0)
    if n == "sgd" and momentum:
        return "sgd_momentum"
    if n == "rmsprop":
        centered = str(_optim_value(optim_args, "centered")).lower() in ("true", "1", "yes")
        return rmsprop_kind(momentum, centered)
    return NAMED.get(n)


# transformers' `optim` for torchdistx's AnyPrecisionAdamW, and the optim_args its Trainer reads for the states'
# dtypes, with its defaults (trainer_optimizer.py `_get_adamw_anyprecision`, trainer.py's in 4.x alike): torch's
# names, `getattr(torch, name)`. The compensation buffer exists only with `use_kahan_summation` (default False).
ANYPRECISION = "adamw_anyprecision"
ANYPRECISION_DTYPES = (("momentum_dtype", "float32"), ("variance_dtype", "float32"),
                       ("compensation_buffer_dtype", "bfloat16"))


def anyprecision_settings(optim_args: Any, where: str = "optim_args") -> tuple[str, tuple[str, ...]]:
    """(planned optimizer, each state's dtype) of the AnyPrecision AdamW the HF Trainer builds from `optim_args`:
    Kahan summation on (transformers' `strtobool` of `use_kahan_summation`) adds its compensation buffer. A value
    the Trainer would refuse (a word strtobool does not take, a dtype torch has not: `getattr` fails) or one that
    is no floating-point dtype is a UserError naming `where` (the job's file and line)."""
    given = _optim_value(optim_args, "use_kahan_summation")
    word = str("False" if given is None else given).strip().lower()
    if word not in STR_TO_BOOL_WORDS:
        raise UserError(f"{where}: optim_args use_kahan_summation={word}: transformers reads it with strtobool, "
                        "which refuses that; give True or False.")
    kahan = word in ("y", "yes", "t", "true", "on", "1")
    dtypes = []
    for key, default in ANYPRECISION_DTYPES[:3 if kahan else 2]:
        given = _optim_value(optim_args, key)
        value = str(default if given is None else given).strip()
        if value not in DTYPE_BYTES:
            raise UserError(f"{where}: optim_args {key}={value}: transformers builds AnyPrecision AdamW's state with "
                            f"getattr(torch, '{value}'), not a floating-point dtype of torch's; give one of "
                            "float32, bfloat16, float16 (torch's names).")
        dtypes.append(value)
    return anyprecision_kind(kahan), tuple(dtypes)


# transformers' Trainer passes `optim_args` to torch's SGD, Adagrad and RMSprop from 5.3 (PR #44203,
# trainer_optimizer.py `_get_sgd`, `_get_rmsprop`); 4.x and 5.0-5.2 build them with the learning rate alone.
OPTIM_ARGS_SINCE = (5, 3)
TORCH_OPTIM_ARGS = {"sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
                    "adagrad": ("lr_decay", "weight_decay", "eps"),
                    "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered")}


def torch_optim_args(name: str, optim_args: Any, version: str) -> tuple[Any, str | None]:
    """The `optim_args` the HF Trainer of transformers `version` passes to the torch optimizer it builds for `optim`
    = `name` (TORCH_OPTIM_ARGS: none before OPTIM_ARGS_SINCE), with a note naming those it drops."""
    keys = TORCH_OPTIM_ARGS.get(name.lower())
    if keys is None or release_of(version) >= OPTIM_ARGS_SINCE:
        return optim_args, None
    dropped = [k for k in keys if _optim_value(optim_args, k) is not None]
    if not dropped:
        return None, None
    return None, (f"optim_args {', '.join(dropped)} ignored: transformers {version} builds torch's {name} with the "
                  "learning rate alone (it passes optim_args from 5.3, PR #44203); planned without them")


def _optim_value(optim_args: Any, key: str) -> Any:
    """The value of `key` in the Trainer's `optim_args` ("momentum=0.9,nesterov=True", or a mapping), or None."""
    pairs = optim_args.items() if isinstance(optim_args, dict) else (
        p.split("=", 1) for p in str(optim_args or "").replace(" ", "").split(",") if "=" in p)
    return next((v for k, v in pairs if str(k) == key), None)


def _optim_arg(optim_args: Any, key: str) -> float | None:
    """A number of the Trainer's `optim_args`, None where it is not given or not a number."""
    try:
        return float(_optim_value(optim_args, key))
    except (TypeError, ValueError):
        return None


# What the AdamW stand-in gets wrong for each optimizer the planner does not model (by the start of its name), and
# the plan closest to its states: transformers' trainer_optimizer.py builds them from galore_torch, apollo_torch,
# lomo_optim, grokadamw and optimi.
STAND_INS = {
    "adalomo": ("an over-estimate: AdaLomo keeps a factored second moment, Adafactor's rows and columns, and updates "
                "in backward", "--optimizer adafactor"),
    "lomo": ("a large over-estimate: LOMO keeps no optimizer state and updates each weight in backward",
             "--optimizer sgd"),
    "galore": ("an over-estimate: GaLore keeps Adam's states of rank-r projections (r 128 by default) of its target "
               "modules' gradients, full ones only for the rest", "no closer kind; the plan is an upper bound"),
    "apollo": ("an over-estimate: APOLLO keeps Adam's states of rank-r projections (r 256, 1 for APOLLO-Mini) of "
               "its target modules' gradients", "no closer kind; the plan is an upper bound"),
    "grokadamw": ("an under-estimate by one state: GrokAdamW keeps an EMA of the gradient beside Adam's two",
                  "--optimizer ademamix (three states)"),
    "stable_adamw": ("near: optimi's StableAdamW keeps Adam's two states, and a Kahan compensation buffer in the "
                     "weights' dtype for 16-bit weights", "--optimizer ademamix for an upper bound"),
}


def optimizer_stand_in(name: str) -> tuple[str, bool, str]:
    """(optimizer, bnb_optimizer, note) the plan runs for `name`, an optimizer `optimizer` does not model (GaLore,
    LOMO, APOLLO, torchao's 4-bit AdamW, GrokAdamW, StableAdamW, an axolotl or other tool's own): AdamW, 8-bit where
    the name says so, with a note naming the optimizer, which way the estimate errs (STAND_INS) and what to pass
    `shardfit plan` to plan the closest kind."""
    n = name.lower()
    if n in TORCHAO_4BIT:
        return "adamw8bit", False, (f"optim {name} (torchao's 4-bit AdamW: two 4-bit states and an fp32 scale per "
                                    "128, about 1.06 bytes per trained weight) is planned as 8-bit AdamW (2.03 "
                                    "bytes): an over-estimate of the optimizer states")
    planned, states = ("adamw8bit", "two 8-bit states") if "8bit" in n else ("adamw", "two states")
    sense, fix = next((v for k, v in STAND_INS.items() if n.startswith(k)),
                      ("its states are not known to shardfit", "--optimizer NAME for the closest kind"))
    return planned, False, (f"optim {name} is not modelled; planned as {'8-bit ' if '8bit' in n else ''}AdamW "
                            f"({states} per trained weight), {sense}; {fix}")


# The HF Trainer's `optim` for bitsandbytes' 8-bit form of each optimizer the planner offers one of (plan/plan.py
# `alternatives`), as the tools built on it take them.
TRAINER_8BIT = {"adamw8bit": "adamw_bnb_8bit", "rmsprop8bit": "rmsprop_bnb_8bit", "lion8bit": "lion_8bit",
                "ademamix8bit": "ademamix_8bit"}


def nodes_words(launcher: str | None, plugin: bool = False) -> str:
    """How a command line's launcher starts its ranks on several nodes, `{}` the count and `{ranks}` every node's
    processes together, for the plan's suggestions (job.py `Words`): torchrun's --nnodes with its per-node
    --nproc_per_node (also where it names none; default 1), accelerate's --num_machines with --num_processes, the
    total (each machine runs num_processes // num_machines, accelerate's commands/launch.py
    `prepare_multi_gpu_env`), and --multi_gpu, which accelerate infers without a config only from the GPUs of
    the machine it runs on; not where its config or flags build a DeepSpeed or FSDP `plugin`, which --multi_gpu
    would turn off (`_validate_launch_command` reads the config's distributed type only where no such flag is
    given). The DeepSpeed launcher's --num_nodes."""
    if launcher == "accelerate":
        return (f"accelerate launch{'' if plugin else ' --multi_gpu'} --num_machines {{}} --num_processes {{ranks}} "
                "--machine_rank <node> --main_process_ip <first node> --main_process_port 29500")
    if launcher == "deepspeed":
        return "deepspeed --num_nodes {} --hostfile HOSTFILE"
    return "torchrun --nnodes {} --nproc_per_node {per_node} --node_rank <node> --master_addr <first node>"


def eight_bit_words(form: str) -> dict[str, str]:
    """A tool's words (foreign/job.py `Words.keys`) for each 8-bit optimizer the planner offers: `form` with the
    Trainer's `optim` name in place of `{}` ("--optim {}")."""
    return {k: form.format(v) for k, v in TRAINER_8BIT.items()}


def bitsandbytes_optimizer(name: str) -> bool:
    """Whether the HF Trainer's `optim` = `name` is one of bitsandbytes' optimizers (its AdamW in 8 bits, the paged
    ones of either width, and Lion, RMSprop and AdEMAMix, BNB_OTHERS): the planner's `bnb_optimizer`, whose 32-bit
    states are fp32 whatever the weights' dtype and whose 8-bit ones the Trainer keeps in 32 bits for an embedding.
    Paged states live in CUDA managed memory (cudaMallocManaged), but only those of tensors of 100,000 elements or
    more (bitsandbytes/optim/optimizer.py `get_state_buffer`); they are counted on the card as the others are."""
    n = name.lower()
    return n in EIGHT_BIT_OPTIMIZERS or n.startswith(("paged_adamw", *BNB_OTHERS))


def multi_tensor_step(name: str) -> bool:
    """Whether the optimizer the HF Trainer builds for `optim` = `name` steps with one of torch's multi-tensor
    kernels (MULTI_TENSOR: `adamw_torch`, torch's default kernel on a GPU, and the other torch optimizers), which
    allocate copies of each param group; the fused kernels (`adamw_torch_fused`, apex's), bitsandbytes' 8-bit and
    paged optimizers update each tensor in place (the planner's `fused_adamw`)."""
    return name.lower() in MULTI_TENSOR


# transformers' Trainer defaults `optim` to adamw_torch_fused from 4.54 (PR #37358) when torch is 2.8 or newer;
# before, to adamw_torch from 4.32 (PR #25109: training_args.py `default_optim`, "adamw_hf" in 4.31.0 and
# "adamw_torch" in 4.32.0), and to adamw_hf, transformers' own AdamW, before (the only AdamW its Trainer built before
# `optim` came in 4.16). axolotl has defaulted to adamw_torch_fused since its PR #2293 (January 2025).
FUSED_DEFAULT_SINCE = (4, 54)
TORCH_ADAMW_DEFAULT_SINCE = (4, 32)
# The torch a job ran where it names none: the one current when its transformers came out. torch 2.0 (March 2023)
# with transformers 4.27, torch 1.10 (October 2021) with 4.12. Their defaults at the step (plan/step_ops.py): from
# 2.0 the optimizers' multi-tensor ops on a GPU, clip_grad_norm_'s foreach path and zero_grad dropping the
# gradients; before, one tensor at a time, a norm per gradient and zeros written; before 1.10 clipping also waited
# for the device.
TORCH_2_WITH = (4, 27)
TORCH_1_10_WITH = (4, 12)
# The Trainer's `optim` names whose step loop the name says (plan/optimizer_launches.py `implementation`): the
# others of torch (TORCH_OPTIMS) run the torch release's default loop; the rest their own library's (`auto`).
OPTIM_LOOPS = {"adamw_hf": "transformers", "adamw_torch_fused": "fused", "adamw_apex_fused": "fused",
               "adamw_anyprecision": "for_loop"}
TORCH_OPTIMS = ("adamw_torch", "adam", "sgd", "adagrad", "rmsprop")


def step_keys(optim: str, version: str, notes: list[str] | None = None) -> dict[str, Any]:
    """The Workload's `optimizer_loop`, `grad_clip` and `zero_grad_zeros` for a job whose Trainer builds `optim`
    under transformers `version`, on the torch of that release (TORCH_2_WITH); a note joins `notes` where that
    torch is older than 2.0."""
    at = release_of(version)
    loop, clip, zeros = ("foreach", "foreach", False) if at >= TORCH_2_WITH else \
        ("for_loop", "per_tensor" if at >= TORCH_1_10_WITH else "per_tensor_sync", True)
    n = optim.lower()
    loop = OPTIM_LOOPS.get(n, loop if n in TORCH_OPTIMS else "auto")
    if notes is not None and at < TORCH_2_WITH:
        wait = "" if at >= TORCH_1_10_WITH else ", reading the norm back before it scales"
        notes.append(f"transformers {version} came out before torch 2.0: planned on the torch of its day, whose "
                     f"optimizers step one tensor at a time, whose clipping takes a norm per gradient{wait} and "
                     "whose zero_grad writes zeros (host launches per tensor each step)")
    return {"optimizer_loop": loop, "grad_clip": clip, "zero_grad_zeros": zeros}


def default_optim(given: Any, version: str, tool_default: str | None = None) -> tuple[str, str | None]:
    """The optimizer a job runs: `given`, else the tool's own default (`tool_default`), else the default of the HF
    Trainer of transformers `version`; with a note saying which AdamW kernel was assumed when the job names none."""
    if given is not None:
        return str(given), None
    if tool_default is not None:
        return tool_default, f"optimizer not set: the tool's default {tool_default} (AdamW stepped in place)"
    if release_of(version) >= FUSED_DEFAULT_SINCE:
        return "adamw_torch_fused", (f"optim not set: transformers {version} defaults to adamw_torch_fused with torch "
                                     ">= 2.8 (stepped in place; an older torch runs adamw_torch, whose multi-tensor "
                                     "step adds one fp32 copy of what each GPU trains)")
    if release_of(version) < TORCH_ADAMW_DEFAULT_SINCE:
        return "adamw_hf", (f"optim not set: transformers {version} defaults to adamw_hf (transformers' own AdamW: "
                            "a Python loop over the tensors, each stepped in place)")
    return "adamw_torch", (f"optim not set: transformers {version} defaults to adamw_torch (torch's multi-tensor "
                           "AdamW: one fp32 copy of what each GPU trains at the step)")


def optimizer_keys(given: Any, version: str, notes: list[str], tool_default: str | None = None,
                   optim_args: Any = None, weight_decay: Any = 0.0, where: str = "optim_args") -> dict[str, Any]:
    """The Workload's `optimizer`, `fused_adamw`, `optimizer_dtypes` and step loop (`step_keys`) for a job whose
    optimizer setting is `given` (None when the config names none: `default_optim` decides, and its note joins
    `notes`) with the Trainer's `optim_args` (as transformers `version` passes them, `torch_optim_args`; given at
    `where`, the file and line an error names) and `weight_decay` (None where the tool's default is not known:
    `weight_decay_note`)."""
    optim, assumed = default_optim(given, version, tool_default)
    if assumed:
        notes.append(assumed)
    optim_args, dropped = torch_optim_args(optim, optim_args, version)
    dtypes = anyprecision_settings(optim_args, where)[1] if optim.lower() == ANYPRECISION else ()
    planned, bnb = optimizer(optim, optim_args), bitsandbytes_optimizer(optim)
    notes += [n for n in (dropped, weight_decay_note(optim, planned, weight_decay)) if n]
    # torch's Adam is planned as AdamW (the same two states): a stand-in too, whose 8-bit offer would be AdamW's
    stand_in = planned is None or optim.lower() == "adam"
    if planned is None:
        planned, bnb, note = optimizer_stand_in(optim)
        notes.append(note)
    return {"optimizer": planned, "fused_adamw": not multi_tensor_step(optim), "bnb_optimizer": bnb,
            "torchao_optimizer": optim.lower() in TORCHAO_8BIT, "optimizer_dtypes": dtypes,
            "no_8bit_form": stand_in, **step_keys(optim, version, notes)}


def weight_decay_note(optim: str, planned: str | None, weight_decay: Any) -> str | None:
    """A note where torch's multi-tensor SGD or RMSprop (WEIGHT_DECAY_COPIES) steps with weight decay, which the
    plan does not count: it first adds the decay into a copy of the gradients (`torch._foreach_add(grads, params,
    alpha=weight_decay)`), one more copy of the decayed weights (measured: 1.0 of the group more). `weight_decay`
    None: not given, where the tool's default is not known."""
    if planned not in WEIGHT_DECAY_COPIES or not multi_tensor_step(optim):
        return None
    try:
        decay = None if weight_decay is None else float(weight_decay)
    except (TypeError, ValueError):
        decay = None
    if decay == 0.0:
        return None
    said = "weight_decay not given" if weight_decay is None else f"weight_decay {weight_decay}"
    verb = "may add" if decay is None else "adds"
    return (f"optim {optim} with {said}: torch's multi-tensor step {verb} one copy of what each GPU trains (the "
            "gradients plus the decay, `torch._foreach_add(grads, params)`), not planned")


TRUE_WORDS = ("true", "1", "yes", "y", "on")
# The words transformers' and accelerate's str_to_bool take (each refuses any other: "invalid truth value").
STR_TO_BOOL_WORDS = ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")
FALSE_WORDS = ("false", "0", "no", "n", "off", "none", "null", "")


def as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in TRUE_WORDS
    return bool(v)


def check_bools(values: Mapping[str, Any], keys: Iterable[str], at: Callable[[str], str]) -> None:
    """A UserError naming the first of `keys` whose value is neither a boolean nor a word for one (a list, a
    number other than 0 and 1, "maybe"): read with `as_bool` it would silently count as true or false."""
    for key in keys:
        v = values.get(key)
        if v is None or isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            continue
        if isinstance(v, str) and v.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            continue
        raise UserError(f"{at(key)}: '{key}' is {v!r}; expected true or false.")


def as_int(v: Any, key: str, where: str) -> int:
    """A whole number a tool's key gives (`8`, `8.0`, "8"); anything else, an infinity or NaN included (YAML's
    `.inf`, JSON's `Infinity`), is a UserError naming the key."""
    try:
        return int(float(v))
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{where}: '{key}' is {v!r}; expected a whole number.") from None


def lf_freeze_blocks(n: int, layers: int) -> list[int]:
    """The decoder blocks LLaMA-Factory's `freeze_trainable_layers: n` trains, of `layers`: the last n (n > 0) or
    the first -n (n < 0)."""
    return list(range(max(0, layers - n), layers)) if n > 0 else list(range(min(-n, layers)))


def as_float(v: Any, key: str, where: str) -> float:
    """A number a tool's key gives; NaN (YAML's `.nan`, JSON's `NaN`) is a UserError naming the key, as no setting
    means it (an infinity passes: `max_grad_norm: .inf` is no clipping)."""
    try:
        out = float(v)
    except (TypeError, ValueError):
        raise UserError(f"{where}: '{key}' is {v!r}; expected a number.") from None
    if math.isnan(out):
        raise UserError(f"{where}: '{key}' is {v!r}; expected a number, not NaN.")
    return out


def read_text(path: Path) -> str:
    """A tool's file as UTF-8 text; a binary or Latin-1 file, or one that cannot be read, is a UserError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); give the tool's "
                        "config file or launch script, saved as UTF-8.") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}).") from None


def parse_json(text: str, where: str) -> Any:
    """JSON text; a syntax error, or nesting deeper than Python's parser goes, is a UserError naming `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}:{e.lineno}: not valid JSON: {e.msg}.") from None
    except RecursionError:
        raise UserError(f"{where}: the JSON is nested too deeply to be a config; is this the file you meant?") \
            from None


def load_yaml(path: Path, nested: bool = False, example: str = "model_name_or_path: ...") \
        -> tuple[dict[str, Any], dict[str, int]]:
    """A tool's YAML config and the line of each top-level key (`nested`: of nested keys too, as `a.b`), read as
    strictly as shardfit's own configs (non-UTF-8 text, alias bombs and keys given twice are a UserError naming the
    file and line). `example`: keys of that kind of file, shown when it holds no mapping."""
    data, lines = read_yaml(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys ({example}, ...), got {type(data).__name__}.")
    return data, lines if nested else {k: line for k, line in lines.items() if "." not in k}


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


def fsdp_settings(cfg: Any, where: str) -> dict[str, Any]:
    """An `fsdp_config` mapping by its keys without the old `fsdp_` prefix (accelerate and axolotl read both).
    A null value is the tool's default, so it is left out; both spellings of one key with different values are a
    UserError (which one wins depends on the tool's version)."""
    if not isinstance(cfg, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        name = str(key).removeprefix("fsdp_")
        if value is None:
            continue
        if name in out and out[name] != value:
            raise UserError(f"{where}: fsdp_config gives '{name}' twice ({out[name]!r}, and {value!r} as '{key}'); "
                            f"keep one spelling.")
        out[name] = value
    return out


# FSDP1's ShardingStrategy by name and by number (torch's enum), as accelerate and the HF Trainer store it under
# `sharding_strategy` or, for FSDP1, `reshard_after_forward`; FSDP2's reshard_after_forward is a boolean (true:
# resharded after forward, as full_shard; false: kept, as shard_grad_op), and 1 and 0 read the same either way.
SHARDING_STRATEGIES = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
                       "HYBRID_SHARD": "hybrid_shard", "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
                       "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2", "1": "full_shard", "2": "shard_grad_op",
                       "3": "no_shard", "4": "hybrid_shard", "5": "hybrid_shard_zero2"}


def fsdp_sharding(cfg: Mapping[str, Any], where: str) -> str:
    """How an fsdp_config (by fsdp_settings' names) shards: full_shard, shard_grad_op, no_shard, hybrid_shard or
    hybrid_shard_zero2. `sharding_strategy` wins over `reshard_after_forward` (accelerate's plugin takes it first);
    either may be a strategy's name or number, or a boolean. Anything else is a UserError naming the key."""
    key = "sharding_strategy" if "sharding_strategy" in cfg else "reshard_after_forward"
    value = cfg.get(key, True)
    text = str(value).strip().upper().removeprefix("SHARDINGSTRATEGY.")
    if text in SHARDING_STRATEGIES:
        return SHARDING_STRATEGIES[text]
    if isinstance(value, bool) or text.lower() in TRUE_WORDS + FALSE_WORDS:
        return "full_shard" if as_bool(value) else "shard_grad_op"
    raise UserError(f"{where}: fsdp_config '{key}' is {value!r}; give true or false (FSDP2), or an FSDP1 sharding "
                    f"strategy: {', '.join(k for k in SHARDING_STRATEGIES if k[0].isalpha())} (or 1-5).")


def fsdp_engine(sharding: str, offload: bool, distributed: bool) -> str:
    """The job's engine for an FSDP run sharding as `sharding` (fsdp_sharding): no_shard is plain data
    parallelism; a hybrid strategy shards as its within-node part (full_shard, or shard_grad_op for ZeRO-2's)."""
    if offload:
        return "fsdp_offload"
    if sharding == "no_shard":
        return "ddp" if distributed else "single"
    return "fsdp_shard_grad_op" if sharding in ("shard_grad_op", "hybrid_shard_zero2") else "fsdp_full_shard"


# transformers' Trainer runs FSDP2 unless fsdp_config's `version` is 1 from 5.10 on (its PR #45640); before, FSDP1
# unless it is 2.
FSDP2_DEFAULT_SINCE = (5, 10)


def trainer_fsdp1(cfg: Mapping[str, Any], version: str, where: str, notes: list[str]) -> bool:
    """Whether the HF Trainer of transformers `version` runs FSDP1 for `cfg` (an fsdp_config by `fsdp_settings`, so
    `fsdp_version` reads as `version`, as the Trainer strips the prefix too). FSDP1 wraps the blocks only, so an
    untied input embedding stays gathered in the root unit (the planner's `fsdp1`)."""
    given = cfg.get("version")
    if given is None:
        run = 2 if release_of(version) >= FSDP2_DEFAULT_SINCE else 1
        notes.append(f"fsdp_config gives no version: transformers {version} runs FSDP{run} (set \"version\": "
                     f"{3 - run} in fsdp_config for FSDP{3 - run})")
        return run == 1
    if str(given) not in ("1", "2"):
        raise UserError(f"{where}: fsdp_config's version is {given!r}; the HF Trainer runs FSDP 1 or 2.")
    return str(given) == "1"


def flat_params_of(cfg: Mapping[str, Any], fsdp1: bool, where: str, notes: list[str]) -> bool:
    """Whether an fsdp_config (by `fsdp_settings`' names) runs FSDP1 with `use_orig_params` false (the planner's
    `flat_params`: each flat parameter holds only trainable or only frozen weights). accelerate's plugin and the
    HF Trainer default it to true; FSDP2 has no flat parameters, so there the key changes nothing (said in
    `notes`). A UserError naming the key for a value that is not a boolean."""
    value = cfg.get("use_orig_params")
    check_bools({"fsdp_use_orig_params": value}, ("fsdp_use_orig_params",), lambda _: where)
    if value is None or as_bool(value):
        return False
    if not fsdp1:
        notes.append("fsdp_use_orig_params false with FSDP2: FSDP2 shards each parameter and has no flat "
                     "parameters, so it changes nothing here")
        return False
    notes.append("fsdp_use_orig_params false (FSDP1): each flat parameter holds only trainable or only frozen "
                 "weights, as planned")
    return True
