"""The key table of another tool's job, and the walk every reader shares.

A tool's table says, for each of its keys, what the key means to shardfit: the workload field it sets (`field`),
the shardfit config key it carries over to (`config`), the conversion of its value (`read`), the tool's own
default (`default`), and what the plan shows beside it (`effect`). A reader keeps its table as data and its
decisions (method, precision, engine: what needs several keys at once) in short functions beside it; this module
reads a job's file into a `Source`, takes the fields and config keys through the table, and files every key the
job gives under "modelled" or "not modelled", so that a key no table knows is shown rather than dropped."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import as_bool, as_float, as_int, check_bools, load_yaml, parse_json, read_text, record
from shardfit.foreign.deepspeed import DeepSpeedJob, load_deepspeed
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.shell import Command, parse_command

NO_EFFECT = "no effect on memory"

# A conversion of a tool's value: (value, tool key, where) -> shardfit's value; None leaves the setting out.
Read = Callable[[Any, str, str], Any]


@dataclass(frozen=True)
class Key:
    """What one key of a tool means to shardfit. `effect` is a template over the workload's fields
    ("grad_ckpt {grad_ckpt}"): what the plan shows beside the key's value. `field` is the Workload field the key
    sets and `config` the shardfit config key it carries over to ("lora.alpha": nested), each read with `read`;
    `default` is the tool's own value when the job does not give the key (None: nothing is set)."""

    effect: str = NO_EFFECT
    field: str = ""
    config: str = ""
    read: Read | None = None
    default: Any = None


Table = Mapping[str, Key]


def key_table(keys: Mapping[str, Key], no_effect: Collection[str] = ()) -> dict[str, Key]:
    """A tool's table: `keys` in their order (which is the order settings are read and carried over in), then every
    key of `no_effect` that `keys` does not name, as changing nothing the planner counts."""
    table = dict(keys)
    for name in sorted(no_effect):
        table.setdefault(name, Key())
    return table


@dataclass
class Source:
    """A tool's job file as read: its keys' values (`values`), the order they were given in, and the line of each
    where the file has lines (YAML)."""

    path: Path
    values: dict[str, Any]
    order: list[str]
    lines: dict[str, int] = field(default_factory=dict)
    # keys a file of arguments sets to null, kept as None (arg_nulls.py `NULL_KEYS`), each with that file and line
    null_at: dict[str, str] = field(default_factory=dict)
    # keys given in another file than `path` (a training script's TrainingArguments), each with that file and line
    given_at: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return str(self.path)

    def at(self, key: str) -> str:
        """The file, and the line where the key is given when that is known: where an error about it points."""
        if key in self.given_at:
            return self.given_at[key]
        return f"{self.where}:{self.lines[key]}" if key in self.lines else self.where

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def flag(self, key: str, default: Any = False) -> bool:
        """The key as a boolean (true, 1, yes, on), the tool's `default` when it is not given; a value that is no
        word for one ("maybe", a list) is a UserError naming the key, not silently true or false."""
        value = self.values.get(key, default)
        check_bools({key: value}, (key,), self.at)
        return as_bool(value)

    def items(self) -> Iterable[tuple[str, Any]]:
        return ((k, self.values[k]) for k in self.order)




def yaml_source(path: Path, parsed: tuple[dict[str, Any], dict[str, int]] | None = None) -> Source:
    """A tool's YAML config (LLaMA-Factory, axolotl), with the line of each top-level key; `parsed` is the file as
    common.load_yaml read it already, so it is not read twice."""
    cfg, lines = parsed or load_yaml(path)
    return Source(path, cfg, list(cfg), {k: line for k, line in lines.items() if "." not in k})


def command_source(path: Path, programs: tuple[str, ...]) -> tuple[Source, Command]:
    """A command line, or the shell script holding one, that runs one of `programs`: its options by name, and the
    command itself (its launcher and environment)."""
    cmd = parse_command(read_text(path), str(path), programs)
    return Source(path, cmd.args, cmd.order), cmd


def json_source(path: Path, what: str) -> Source:
    """A JSON object of arguments, every value as the command line would give it (text; objects as JSON)."""
    args = parse_json(read_text(path), str(path))
    if not isinstance(args, dict):
        raise UserError(f"{path}: {what} JSON must be an object of argument names.")
    args = {k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
            for k, v in args.items()}
    return Source(path, args, list(args))


def settings(src: Source, table: Table, kind: str, **defaults: Any) -> dict[str, Any]:
    """The workload fields (`kind` "field") or shardfit config keys (`kind` "config") the job's keys set, in the
    table's order. Where several keys set one name, the first the job gives wins; where it gives none, the tool's
    default (`defaults` overrides a key's own, by name) is read like a given value. A conversion that returns None
    sets nothing. Config names with a dot nest ("lora.alpha" -> {"lora": {"alpha": ...}})."""
    by_name: dict[str, list[str]] = {}
    for key, spec in table.items():
        name = getattr(spec, kind)
        if name:
            by_name.setdefault(name, []).append(key)
    out: dict[str, Any] = {}
    for name, keys in by_name.items():
        given = next((k for k in keys if k in src), None)
        key = given or keys[0]
        read = table[key].read or _as_given
        if given is not None:
            value = read(src.get(given), given, src.at(given))
            _same(src, table, keys, given, value)
        else:
            default = defaults.get(name, table[key].default)
            value = None if default is None else read(default, key, src.at(key))
        if value is not None:
            _put(out, name, value)
    return out


def _same(src: Source, table: Table, keys: list[str], given: str, value: Any) -> None:
    """A UserError when the job gives two names of one setting (a key and its old name) that disagree: which one
    the tool obeys depends on its version, so neither is planned silently."""
    for other in keys:
        if other != given and other in src:
            theirs = (table[other].read or _as_given)(src.get(other), other, src.at(other))
            if None not in (value, theirs) and theirs != value:
                raise UserError(f"{src.at(other)}: '{other}' is {src.get(other)!r} but '{given}' is "
                                f"{src.get(given)!r}; they set the same thing: keep one of them.")


def _as_given(value: Any, key: str, where: str) -> Any:
    return value


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    head, _, rest = name.partition(".")
    if rest:
        out.setdefault(head, {})[rest] = value
    else:
        out[head] = value


def file_keys(job: ForeignJob, items: Iterable[tuple[str, Any]], table: Table, values: Any, *,
              effects: Mapping[str, str] | None = None, unplanned: Collection[str] = ()) -> None:
    """File every key of the job: those in `unplanned` (known to matter, but not planned here) as not modelled,
    then each in the table with its effect (`effects` overrides the table's, by key), filled from `values` (the
    workload: "{method}" says its method); a key the table does not know is not modelled."""
    effects = effects or {}
    for key, value in items:
        if key in unplanned or (key not in table and key not in effects):
            record(job, key, value, modelled=False)
        else:
            effect = effects.get(key, table[key].effect if key in table else "")
            record(job, key, value, effect=effect.format_map(vars(values)))


def file_env(job: ForeignJob, env: Mapping[str, str], effects: Mapping[str, str], unknown: str | None,
             unmodelled: tuple[str, ...] = ()) -> None:
    """File the environment a command runs with as `env NAME`: with its effect, `unknown` for a variable
    `effects` does not name (None: not modelled); a name starting with one of `unmodelled` is not modelled."""
    for key, value in env.items():
        effect = None if key.startswith(unmodelled) and key not in effects else effects.get(key, unknown)
        if effect is None:
            record(job, f"env {key}", value, modelled=False)
        else:
            record(job, f"env {key}", value, effect=effect)


def use_deepspeed(job: ForeignJob, ref: str, base: Path, where: str, hidden: int, notes: list[str],
                  passes_optimizer: str | None = None) -> DeepSpeedJob:
    """Run the job under the DeepSpeed JSON `ref` names (deepspeed.load_deepspeed), its keys filed with the job's,
    prefixed so they read apart from the tool's own. `passes_optimizer`: the tool (by that name) hands accelerate
    a torch optimizer and scheduler of its own (LLaMA-Factory v1), which accelerate refuses beside the JSON's
    `optimizer` or `scheduler` section (accelerator.py `_prepare_deepspeed`: "You cannot specify an optimizer in
    the config file and in the code at the same time"): a UserError naming the section, since the job cannot
    start."""
    ds = load_deepspeed(ref, base, where, hidden, notes)
    if passes_optimizer:
        given = {k.split(".")[0] for k in (*ds.keys, *ds.not_modelled)}
        for section in ("optimizer", "scheduler"):
            if section in given:
                raise UserError(f"{ds.source}: the DeepSpeed JSON has a '{section}' section, but {passes_optimizer} "
                                f"builds its own {section} and passes it to accelerate, which refuses both at once "
                                f"(ValueError: \"You cannot specify {'an' if section == 'optimizer' else 'a'} "
                                f"{section} in the config file and in the code at the same time\"); the job cannot "
                                f"start: remove the '{section}' section from {ds.source}.")
    job.engine, job.zero = "deepspeed", ds.zero
    job.keys.update({f"deepspeed:{k}": v for k, v in ds.keys.items()})
    job.not_modelled.update({f"deepspeed:{k}": v for k, v in ds.not_modelled.items()})
    if ds.zero.ds_optimizer:
        deepspeed_builds_optimizer(job, ds, where)
    return ds


def deepspeed_builds_optimizer(job: ForeignJob, ds: DeepSpeedJob, where: str) -> None:
    """Plan the optimizer DeepSpeed builds when its JSON has an `optimizer` section: transformers then hands the
    optimizer to DeepSpeed whatever the tool's `optim` (transformers/integrations/deepspeed.py
    `deepspeed_optim_sched`: with `optimizer` in the config it builds a DummyOptim and DeepSpeed makes FusedAdam or
    DeepSpeedCPUAdam, fp32 moments; or the section's other type, plan/optimizer_kinds.py, on its fp32 partitions),
    so an 8-bit or bitsandbytes `optim` the tool names is never stepped. Said in a note when the tool's own choice
    would have planned something else. A torch optimizer DeepSpeed builds by name steps with its default
    multi-tensor kernel on a GPU (`fused_adamw` off); its Adam: plan/deepspeed.py `step_copies`."""
    w = job.workload
    planned = ds.optimizer or "adamw"
    if w.optimizer != planned or w.bnb_optimizer:
        kind = f"its {ds.optimizer_type} (fp32 states)" if ds.optimizer else \
            f"type {ds.optimizer_type} (not modelled: planned as AdamW with fp32 moments)"
        job.notes.append(f"{where}: the DeepSpeed JSON has an optimizer section, so DeepSpeed builds the optimizer, "
                         f"{kind}, and the tool's optimizer setting is not used (transformers' "
                         "deepspeed_optim_sched); remove the section to run the tool's optimizer")
    fused = w.fused_adamw if planned == "adamw" else False
    job.workload = replace(w, optimizer=planned, bnb_optimizer=False, fused_adamw=fused, optimizer_dtypes=(),
                           no_8bit_form=True)


# Conversions the tables share beyond common.as_int / as_float.
def text(value: Any, key: str, where: str) -> str:
    return str(value)


def flag(value: Any, key: str, where: str) -> bool:
    return as_bool(value)


def epochs(value: Any, key: str, where: str) -> int:
    """Whole epochs, at least one (shardfit trains whole epochs), rounded up: the HF Trainer trains a fractional
    epoch count as that fraction of the last epoch's steps, so fewer whole epochs would train less than the job
    (convert says so in a comment: `fractional_epochs`)."""
    return max(1, math.ceil(as_float(value, key, where)))


# The tools' keys for the epochs to train, by which `fractional_epochs` finds the job's.
# the tools' epoch counts, and a hand-written loop's `for epoch in range(N)` (script_loop.py `HandLoop.convert`)
EPOCH_KEYS = ("num_train_epochs", "num_epochs", "for epoch in range")


def fractional_epochs(given: Mapping[str, Any]) -> str | None:
    """What converting a fractional epoch count (`given`: tool key -> value, as ForeignJob.keys files it) to whole
    ones does, or None
    when the count is whole (or not a number)."""
    for key in EPOCH_KEYS:
        value = str(given.get(key, "")).split(" ", 1)[0]  # a filed key reads "2.5 (its effect)"
        try:
            n = float(value)
        except ValueError:
            continue
        if n > 0 and not n.is_integer():
            return (f"{key} {value} -> epochs {math.ceil(n)}: shardfit trains whole epochs, rounded up so the "
                    f"run trains no less than the tool's {n} (set max_steps to the tool's step count to stop there)")
    return None


def default_epochs(job: ForeignJob, src: Source, table: Table, whose: str) -> None:
    """Say, for a job that names no epoch count, the tool's own default from `table` (which the converted config
    and the step counts take): the HF Trainer's num_train_epochs 3.0 (transformers' TrainingArguments, which
    LLaMA-Factory v0's and ms-swift's arguments extend without changing it), axolotl's num_epochs 1.0
    (utils/schemas/training.py)."""
    key = next((k for k in EPOCH_KEYS if k in table and table[k].default is not None), None)
    if key is None or key in src:
        return
    n = table[key].default
    job.notes.append(f"{key} not set: {whose}'s default, {n:g} epoch{'s' * (n != 1)} (the converted config trains "
                     f"epochs: {math.ceil(n)})")


def positive(value: Any, key: str, where: str) -> int | None:
    """A count that is unset unless it is above 0 (max_steps: -1 is the tools' "no limit")."""
    if value is None:
        return None
    n = as_int(value, key, where)
    return n if n > 0 else None


def count(value: Any, key: str, where: str) -> int:
    """A whole number of at least 1 (a sequence length, a batch size, a rank count): 0, a negative or a fraction is
    a UserError naming the key, not a division by zero or an empty plan later."""
    n = as_float(value, key, where)
    if n != int(n) or n < 1:
        raise UserError(f"{where}: '{key}' is {value!r}; expected a whole number of at least 1.")
    return int(n)


def if_set(read: Read) -> Read:
    """`read`, except that a null value sets nothing (a YAML `key:` left empty)."""
    return lambda value, key, where: None if value is None else read(value, key, where)


def if_truthy(read: Read) -> Read:
    """`read`, except that an empty or false value sets nothing."""
    return lambda value, key, where: read(value, key, where) if value else None


def only_true(value: Any, key: str, where: str) -> bool | None:
    """True when the value is true; otherwise nothing is set (shardfit's default stands)."""
    return True if as_bool(value) else None


# transformers' TrainingArguments.torch_compile (also axolotl's key): the whole model goes through torch.compile,
# which fuses the elementwise ops as shardfit's `compile: true` does per block; not given, shardfit keeps `auto`.
TORCH_COMPILE = Key("compiled {compile}", field="compile", config="compile", read=flag)
# TrainingArguments.tf32 (axolotl and ms-swift pass it through): TF32 for fp32 matmuls, which a bitsandbytes QLoRA
# of a mixture runs its fp32 expert stacks as (plan/flops.py `fp32_experts_s`); not given, `Workload.tf32` None.
TF32 = Key("fp32 matmuls in TF32: {tf32}", field="tf32", read=flag)


# transformers' TrainingArguments that shardfit carries over to its config, read as the HF Trainer reads them: each
# tool that runs the Trainer (LLaMA-Factory v0, a training script's HfArgumentParser) takes this table as it is, and
# one with a trainer of its own (LLaMA-Factory v1) the subset it keeps. A step count below 1 is unset (the Trainer's
# -1 is "no limit", a fraction below 1 of save/eval/logging steps is a ratio of the whole run: neither is a step
# count), as is an epoch count of 0; a seed of 0 is a seed.
HF_TRAINER: dict[str, Key] = {
    "learning_rate": Key(config="lr", read=as_float),
    # transformers' TrainingArguments.num_train_epochs defaults to 3.0 (training_args.py)
    "num_train_epochs": Key(config="epochs", read=if_truthy(epochs), default=3.0),
    "max_steps": Key(config="max_steps", read=positive), "save_steps": Key(config="save_steps", read=positive),
    "eval_steps": Key(config="eval_steps", read=positive), "logging_steps": Key(config="log_steps", read=positive),
    "seed": Key(config="seed", read=as_int), "warmup_ratio": Key(config="warmup_ratio", read=as_float),
    "weight_decay": Key(config="weight_decay", read=as_float),
    "max_grad_norm": Key(config="max_grad_norm", read=as_float),
    "output_dir": Key(config="output_dir", read=if_truthy(text)),
}
# The model argument both LLaMA-Factory versions read: remote code is carried over only when it is asked for.
TRUST_REMOTE_CODE = Key(config="trust_remote_code", read=only_true)


def hf_trainer(*left_out: str) -> dict[str, Key]:
    """HF_TRAINER without the arguments of `left_out` (those a tool's own trainer does not take)."""
    unknown = set(left_out) - set(HF_TRAINER)
    assert not unknown, f"not HF_TRAINER keys: {unknown}"
    return {k: v for k, v in HF_TRAINER.items() if k not in left_out}
