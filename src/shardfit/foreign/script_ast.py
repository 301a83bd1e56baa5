"""What an HF training script sets in its own code, read from its syntax tree (ast): never imported, never run.

A script that trains LoRA through peft's `LoraConfig(r=16)` and passes `gradient_checkpointing=True` to
`TrainingArguments(...)` has none of it on its command line; without reading the code a plan assumes a full
fine-tune at the Trainer's defaults. Only literal values count (numbers, strings, True/False, and module-level
names bound once to one of them); anything computed is left to the command line and the defaults, and said.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.script_loads import (
    ModelLoad,
    TrainedLoad,
    called_name,
    cast_dtype,
    cast_said,
    trained_load,
    trainer_bases,
)
from shardfit.foreign.script_loop import HandLoop, read_loop
from shardfit.foreign.script_metrics import call_metrics

# Calls whose keyword arguments are TrainingArguments (the Trainer's own, TRL's configs, Seq2Seq's).
ARGUMENT_CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "DPOConfig", "ORPOConfig",
                    "KTOConfig", "RewardConfig", "GRPOConfig", "CPOConfig")
# TrainingArguments keywords read, as the command line would spell them.
TRAINING_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16",
                 "fp16", "learning_rate", "num_train_epochs", "max_steps", "optim", "optim_args", "deepspeed",
                 "output_dir", "max_seq_length", "max_length", "model_max_length", "warmup_ratio", "weight_decay",
                 "max_grad_norm", "seed", "save_steps", "logging_steps", "use_liger_kernel", "attn_implementation",
                 *("beta", "loss_type", "label_smoothing", "precompute_ref_log_probs", "rpo_alpha", "simpo_gamma",
                   "cpo_alpha", "desirable_weight", "undesirable_weight"))
HF_ARGUMENTS = ("TrainingArguments", "Seq2SeqTrainingArguments")
# TRL's trainers: what the script optimises (hf.py maps each to shardfit's objective, or refuses it).
TRAINERS = ("DPOTrainer", "KTOTrainer", "ORPOTrainer", "CPOTrainer", "GRPOTrainer", "PPOTrainer", "RewardTrainer",
            "RLOOTrainer", "OnlineDPOTrainer", "XPOTrainer", "NashMDTrainer", "GKDTrainer", "BCOTrainer", "PRMTrainer")
# Every trainer class whose call takes the model and the training arguments: the HF Trainer's and TRL's.
TRAINER_CLASSES = ("Trainer", "Seq2SeqTrainer", "SFTTrainer", *TRAINERS)
SEQ_KEYS = ("max_seq_length", "max_length", "model_max_length")
# TRL's config classes (TrainingArguments with TRL's own defaults, trainer_checks.py `trainer_defaults`).
TRL_CONFIGS = tuple(c for c in ARGUMENT_CLASSES if c not in HF_ARGUMENTS) + \
    ("RLOOConfig", "PPOConfig", "OnlineDPOConfig", "XPOConfig", "NashMDConfig", "GKDConfig", "BCOConfig",
     "PRMConfig")


@dataclass
class ScriptSettings:
    """What the script sets, as command-line arguments would say it (`args`), and where each came from."""

    args: dict[str, str] = field(default_factory=dict)
    # the script and line of each TrainingArguments keyword read into `args`, where an error about it points
    arg_at: dict[str, str] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)  # "LoraConfig(r=16) at train.py:12", for the report's notes
    model: str | None = None  # from_pretrained("...")'s literal first argument
    trainer: str | None = None  # the TRL trainer class the script builds (TRAINERS), e.g. "DPOTrainer"
    # the TRL trainer class that trains the model, SFTTrainer included (its 4-bit dtypes: foreign/kbit.py)
    trl_trainer: str | None = None
    # the script calls peft's prepare_model_for_kbit_training itself (fp32 frozen weights whatever its trainer does)
    prepares_kbit: bool = False
    # the TRL config class whose defaults its TrainingArguments take: one the script names (SFTConfig(...), or
    # TrlParser((ScriptArguments, SFTConfig, ModelConfig))), else its TRL trainer's (SFTTrainer: SFTConfig)
    trl_config: str | None = None
    # the script parses TRL's ModelConfig (TrlParser((..., ModelConfig)), get_peft_config): --use_peft,
    # --load_in_4bit, --lora_r and --lora_alpha are TRL's, with TRL's defaults (hf_args.py `trl_model_config`)
    model_config: bool = False
    # the script parses its arguments with TRL's TrlParser, which reads `--config FILE.yaml` (hf_args.py `_trl_yaml`)
    trl_parser: bool = False
    # the dtype the from_pretrained(...) that loads the trained model (`load_at`, script_loads.py) spells
    # (`torch_dtype=torch.bfloat16`, `dtype="bfloat16"`), or UNSET_DTYPE where it passes none (or None):
    # ModelConfig's --dtype then does not load it; None where it passes a computed value (model_args.dtype,
    # **kwargs), where the script loads no model itself, or where its loads disagree and none is tied to the trainer
    load_dtype: str | None = None
    load_at: str | None = None
    # where one load is tied and it is not a plain from_pretrained: what loads the model ("the script's from_config
    # at train.py:5 (dtype bfloat16)", a cast on its chain), and how the script would spell another dtype ("{}")
    load_said: str | None = None
    load_spell: str | None = None
    unsloth_at: str | None = None  # unsloth's FastLanguageModel.from_pretrained loads the model (its own dtype)
    # where the script hands its TRL trainer the model as a name (SFTTrainer(model="Qwen/...") or
    # model=model_args.model_name_or_path): the trainer loads it with its config's model_init_kwargs
    model_by_name: str | None = None
    # the dtype the model_init_kwargs the script's config call spells (SFTConfig(model_init_kwargs={...})) hold, as
    # `load_dtype` says one (UNSET_DTYPE: none, or None), and where; None where the script gives none or a computed one
    init_dtype: str | None = None
    init_at: str | None = None
    # the `env:` section of that YAML, which TrlParser exports into os.environ before it parses (trl_env.py `trl_env`)
    config_env: dict[str, str] = field(default_factory=dict)
    config_file: str | None = None  # that YAML, as `--config` names it
    arg_file: str | None = None  # the file of arguments parse_*_file reads (arg_files.py), as found
    # HfArgumentParser.parse_json_file / parse_yaml_file calls, each the file it reads as one of: a path in the
    # code, the script's sys.argv[N], or an option the script parsed itself (args.config): foreign/arg_files.py
    arg_files: list[ArgFile] = field(default_factory=list)
    # the script hands its command line to HfArgumentParser (parse_args_into_dataclasses, TRL's
    # parse_args_and_config): its options are the dataclasses' fields, beside any file it reads in another branch
    parses_command_line: bool = False
    # command-line options the parser never reads, as the script's arguments come from such a file alone
    ignored_args: dict[str, str] = field(default_factory=dict)
    arg_file_keys: set[str] = field(default_factory=set)  # the keys that file gives
    # the metric arguments the trainer call that trains passes (script_metrics.py `call_metrics`), or why they
    # cannot be told (no script read, a script that does not parse, arguments passed by position, ...)
    metrics: frozenset[str] = frozenset()
    metrics_unread: str | None = "no training script read"
    # the script trains with its own loop (`.backward()`, an optimizer's `.step()`) and no trainer: script_loop.py
    hand_loop: HandLoop | None = None


@dataclass(frozen=True)
class ArgFile:
    """One `parser.parse_json_file(...)` / `parse_yaml_file(...)` of the script: the format (json or yaml), how
    the path is given (`literal`, `argv` with `ref` the index, `option` with `ref` the option's name) and where."""

    kind: str
    given: str
    ref: str
    at: str


def _constants(tree: ast.Module) -> dict[str, Any]:
    """Module-level names bound exactly once, to a literal (MAX_LEN = 512)."""
    seen: dict[str, list[Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                value = _UNKNOWN
            seen.setdefault(node.targets[0].id, []).append(value)
    return {k: v[0] for k, v in seen.items() if len(v) == 1 and v[0] is not _UNKNOWN}


_UNKNOWN = object()


def _value(node: ast.expr, constants: dict[str, Any]) -> Any:
    """A literal, or a module constant's value; _UNKNOWN for anything computed."""
    if isinstance(node, ast.Name):
        return constants.get(node.id, _UNKNOWN)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _UNKNOWN


def _as_arg(value: Any) -> str:
    """A value as the command line spells it (True -> 'true')."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def read_script(path: Path, text: str) -> ScriptSettings:
    """The settings `text` (the script at `path`) makes in code; a script that does not parse sets nothing."""
    out = ScriptSettings()
    try:
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError):
        out.metrics_unread = f"{path.name} does not parse"
        return out
    except (MemoryError, RecursionError):  # nesting deeper than Python's parser goes
        raise UserError(f"{path}: nested too deeply for Python's parser to read (the script could not run either); "
                        f"is this the training script the command runs?") from None
    _refuse_lightning(tree, path)
    constants = _constants(tree)
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    bases = trainer_bases(tree, TRAINER_CLASSES)
    found = trained_load(tree, path.name, TRAINER_CLASSES)
    for node in calls:
        name, at = called_name(node.func), f"{path.name}:{node.lineno}"
        kind = bases.get(name)  # the trainer class a call builds, where it builds one (a subclass: its base)
        kwargs = {k.arg: _value(k.value, constants) for k in node.keywords if k.arg}
        known = {k: v for k, v in kwargs.items() if v is not _UNKNOWN}
        if name == "LoraConfig":
            out.args["use_lora"] = "true"
            if isinstance(known.get("r"), int):
                out.args["lora_r"] = str(known["r"])
            if "lora_alpha" in known:
                out.args["lora_alpha"] = _as_arg(known["lora_alpha"])
            targets = known.get("target_modules")
            if isinstance(targets, str) or isinstance(targets, list | tuple) and targets:
                out.args["target_modules"] = targets if isinstance(targets, str) else str(list(targets))
            saved = known.get("modules_to_save")
            if isinstance(saved, list | tuple) and saved and all(isinstance(t, str) for t in saved):
                out.args["lora_modules_to_save"] = " ".join(saved)  # as ModelConfig's flag spells it
            out.found.append(f"LoraConfig({_shown(known, ('r', 'lora_alpha'))}) at {at}: LoRA")
        elif name == "BitsAndBytesConfig" and known.get("load_in_4bit") is True:
            out.args["q_lora"] = "true"
            out.found.append(f"BitsAndBytesConfig(load_in_4bit=True) at {at}: 4-bit base weights")
        elif name in ARGUMENT_CLASSES or kind == "SFTTrainer" and _lends(node, found.trainer):
            keys = {k: v for k, v in known.items() if k in TRAINING_KEYS and not isinstance(v, (dict, list))}
            out.args.update({k: _as_arg(v) for k, v in keys.items()})
            out.arg_at.update({k.arg: f"{path}:{k.value.lineno}" for k in node.keywords if k.arg in keys})
            if keys:
                out.found.append(f"{name}({_shown(keys, tuple(keys))}) at {at}")
        elif kind in TRAINERS and out.trainer is None:
            out.trainer = kind  # its keywords are read once the trainer that trains is known (_trl_keywords)
        elif name in ARG_FILE_CALLS:
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg in (
                "json_file", "yaml_file")), None)
            ref = _file_ref(arg, constants) if arg is not None else None
            if ref is not None:
                out.arg_files.append(ArgFile(ARG_FILE_CALLS[name], *ref, at))
        elif name in COMMAND_LINE_CALLS:
            out.parses_command_line = True
        elif name == "prepare_model_for_kbit_training":
            out.prepares_kbit = True
            out.found.append(f"prepare_model_for_kbit_training() at {at}: fp32 frozen weights")
        elif name == "gradient_checkpointing_enable":
            out.args["gradient_checkpointing"] = "true"
            out.found.append(f"gradient_checkpointing_enable() at {at}")
        elif name == "from_pretrained":
            first = _value(node.args[0], constants) if node.args else None
            if out.model is None and isinstance(first, str) and "/" in first and \
                    "Tokenizer" not in ast.unparse(node.func):
                out.model = first
    out.trl_trainer = out.trainer or next((k for k in (bases.get(called_name(c.func)) for c in calls)
                                           if k == "SFTTrainer"), None)
    _by_name(out, tree, calls, bases, constants, path)
    out.trl_config = _trl_config(tree, out.trl_trainer)
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Name | ast.Attribute)}
    out.model_config = bool(names & {"ModelConfig", "get_peft_config"})
    out.trl_parser = "TrlParser" in names or "parse_args_and_config" in names
    _trained_load(out, found, constants, path)
    _chosen_trainer(out, tree, calls, bases, found.trainer)
    _trl_keywords(out, calls, bases, found.trainer, constants, path)
    _load_attention(out, found.tied or found.candidates, constants)
    out.metrics, out.metrics_unread = call_metrics(tree, found.trainer, path.name, found.untold)
    out.hand_loop = read_loop(tree, path, constants, bases)
    return out


LIGHTNING = ("lightning", "pytorch_lightning")


def _refuse_lightning(tree: ast.Module, path: Path) -> None:
    """Exit 2 for a script that trains with Lightning's Trainer (`_lightning_trainer`), saying how to plan it."""
    line = _lightning_trainer(tree)
    if line is not None:
        raise UserError(f"{path.name}:{line}: the script trains with Lightning's Trainer, whose loop `plan --from "
                        f"hf` does not read (it reads the HF Trainer's and TRL's scripts and hand-written loops). "
                        f"Plan the run from its settings instead: shardfit plan --model ID --method lora|full "
                        f"--seq N --batch N --gpus ...")


def _lightning_trainer(tree: ast.Module) -> int | None:
    """The line of a Lightning Trainer the script builds (`from lightning import Trainer`, `pl.Trainer(...)` with
    `import pytorch_lightning as pl`), or None: its name is the HF Trainer's, its loop is Lightning's."""
    modules = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and
                (n.module or "").split(".")[0] in LIGHTNING for a in n.names if a.name == "Trainer"}
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        f = c.func
        if isinstance(f, ast.Name) and f.id in imported or isinstance(f, ast.Attribute) and f.attr == "Trainer" and \
                ast.unparse(f.value).split(".")[0] in {k for k, v in modules.items()
                                                       if v.split(".")[0] in LIGHTNING} | set(LIGHTNING):
            return c.lineno
    return None


def _chosen_trainer(out: ScriptSettings, tree: ast.Module, calls: list[ast.Call], bases: dict[str, str],
                    trainer: ast.Call | None) -> None:
    """Of several trainer calls, the one that trains (`trainer`) says the objective, not the first: an unused
    DPOTrainer beside the Trainer that trains makes no preference run. Calls of the script's own subclasses count
    as their base class (`bases`)."""
    if trainer is None or len([c for c in calls if called_name(c.func) in bases]) < 2:
        return
    chosen = bases.get(called_name(trainer.func), "")
    out.trainer = chosen if chosen in TRAINERS else None
    out.trl_trainer = out.trainer or (chosen if chosen == "SFTTrainer" else None)
    out.trl_config = _trl_config(tree, out.trl_trainer)


def _trl_keywords(out: ScriptSettings, calls: list[ast.Call], bases: dict[str, str], trainer: ast.Call | None,
                  constants: dict[str, Any], path: Path) -> None:
    """The TrainingArguments keywords (beta, loss_type, ...) and the ref_model of the TRL trainer call that trains:
    the one `trainer` names where it is that class, else the first of its class. A DPOTrainer the script builds but
    never trains lends the run none of its settings."""
    if out.trainer is None:
        return
    node = trainer if trainer is not None and bases.get(called_name(trainer.func)) == out.trainer else \
        next(c for c in calls if bases.get(called_name(c.func)) == out.trainer)
    kwargs = {k.arg: _value(k.value, constants) for k in node.keywords if k.arg}
    keys = {k: v for k, v in kwargs.items() if v is not _UNKNOWN and k in TRAINING_KEYS and
            not isinstance(v, (dict, list))}
    out.args.update({k: _as_arg(v) for k, v in keys.items() if k not in out.args})  # TRL before configs
    name = called_name(node.func)
    out.found.append(f"{name}({_shown(keys, tuple(keys))}) at {path.name}:{node.lineno}"
                     f"{f', a {out.trainer}' if name != out.trainer else ''}")
    ref = next((k.value for k in node.keywords if k.arg == "ref_model"), None)
    if ref is not None and _value(ref, constants) is not None:
        out.args["ref_model"] = ast.unparse(ref)


def _load_attention(out: ScriptSettings, loads: list[ModelLoad], constants: dict[str, Any]) -> None:
    """The attention the trained model loads with, where its one load spells it: `attn_implementation="..."`, or
    transformers 4.34-4.35's `use_flash_attention_2=True` (flash-attention 2 before the key existed)."""
    if len(loads) != 1:
        return
    kwargs = {k.arg: _value(k.value, constants) for k in loads[0].call.keywords if k.arg}
    impl = kwargs.get("attn_implementation")
    if not isinstance(impl, str) and kwargs.get("use_flash_attention_2") is True:
        impl = "flash_attention_2"
    if isinstance(impl, str):
        out.args["attn_implementation"] = impl
        out.found.append(f"from_pretrained(attn_implementation={impl!r}) at {loads[0].at}")


# ScriptSettings.load_dtype of a from_pretrained that passes no dtype: transformers' own default loads the model.
UNSET_DTYPE = "unset"
# ScriptSettings.init_dtype of model_init_kwargs without a `dtype` key: TRL's own default loads the model.
ABSENT_DTYPE = "absent"
# What a from_pretrained's dtype spells, by TRL's --dtype names.
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
           "float": "float32", "auto": "auto"}


def _lends(call: ast.Call, trainer: ast.Call | None) -> bool:
    """Whether a trainer `call` lends the run its keywords: it is the call that trains (`trainer`), or no call is
    known to train and it is of that kind at all; an SFTTrainer built beside the DPOTrainer that trains lends
    nothing."""
    return call is trainer or trainer is None


def _trained_load(out: ScriptSettings, found: TrainedLoad, constants: dict[str, Any], path: Path) -> None:
    """The load dtype of the model the script's trainer trains (script_loads.py `trained_load`): the load its
    `model=` is tied to (a cast on the way setting the dtype), else the one load left that could be it, unless the
    `model=` comes from a call that cannot be followed. unsloth's loads pick their own dtype (`unsloth_at`); loads
    that disagree and cannot be told apart decide nothing; the findings say each (`found`: script_loads.py's
    reading of the script)."""
    tied = found.tied
    if tied and not tied[0].built and tied[0].call.args and \
            isinstance(first := _value(tied[0].call.args[0], constants), str) and "/" in first:
        out.model = first  # the trained model's name, not a reward or reference model's loaded before it
    fallback = "TRL's ModelConfig --dtype decides it" if out.model_config else "the plan keeps its precision"
    if found.untold:
        out.found.append(f"the script builds trainers at {', '.join(found.untold)} and which one trains cannot be "
                         f"told (not one alone has .train() called): each load that could be its model counts")
    if found.unfollowed:
        out.found.append(f"the trainer's model= comes from {found.unfollowed}, which shardfit cannot follow back to a "
                         f"load: {fallback}")
    unsloth = [ld for ld in tied if ld.unsloth] if tied else [] if found.candidates else found.unsloth
    if unsloth:
        out.unsloth_at = unsloth[0].at
        out.found.append(f"{unsloth[0].owner}.from_pretrained at {out.unsloth_at} loads the model: unsloth picks its "
                         f"own dtype (none given: bf16 where the GPU has it, else fp16), so the load dtype is not "
                         f"planned (the plan keeps its precision)")
        return
    loads = tied or found.candidates
    dtypes = {_load_dtype(ld, constants) for ld in loads}
    if len(dtypes) == 1:
        out.load_dtype, out.load_at = dtypes.pop(), ", ".join(ld.at for ld in loads)
        if len(loads) == 1 and (loads[0].built or loads[0].cast is not None) and out.load_dtype is not None:
            out.load_said, out.load_spell = _load_said(loads[0], out.load_dtype, path.name)
    elif loads:
        out.found.append(f"models load in different dtypes at {', '.join(ld.at for ld in loads)} and "
                         f"{'each may reach' if tied else 'none can be tied to'} the trainer's model=: {fallback}")


def _load_said(load: ModelLoad, dtype: str, file: str) -> tuple[str, str]:
    """What loads the model where a cast on its chain or a from_config decides the dtype, and how the script would
    spell another dtype (kbit.py `Loaded`)."""
    if load.cast is not None:
        cast = cast_said(load.cast)
        return (f"the script's {called_name(load.call.func)} at {load.at}, cast by {cast} at {file}:{load.cast.lineno} "
                f"(dtype {dtype})", f".to(torch.{{}}) in place of the script's {cast}")
    given = next((k for k in load.call.keywords if k.arg in ("torch_dtype", "dtype")), None)
    why = f"dtype {dtype}" if given is not None else "no dtype: the config's, read from the checkpoint" \
        if dtype == "auto" else f"no dtype: the config's, {dtype}"
    return f"the script's from_config at {load.at} ({why})", "dtype=\"{}\" in the script's from_config"


def _load_dtype(load: ModelLoad, constants: dict[str, Any]) -> str | None:
    """The dtype a load on its way to the trainer ends in, as TRL's --dtype names it: its last cast's (`.half()`);
    else for a from_pretrained the dtype it spells (`torch_dtype=` or `dtype=`: torch.bfloat16, "bfloat16",
    "auto"), UNSET_DTYPE where it passes none, or None (transformers' default then loads it); for a from_config
    its dtype argument, else its config's (transformers 5.23 `_from_config` takes config.dtype: a config read
    from a checkpoint holds the checkpoint's, "auto" here; a config class called without one, None), None
    standing for torch's default, float32. None where a computed value or **kwargs may give the dtype."""
    if load.cast is not None:
        return cast_dtype(load.cast)
    call = load.call
    if load.built and not any(kw.arg in ("torch_dtype", "dtype") for kw in call.keywords):
        if load.config is None or any(kw.arg is None for kw in (*call.keywords, *load.config.keywords)):
            return None
        call = load.config
        if called_name(call.func) == "from_pretrained" and not any(kw.arg in ("torch_dtype", "dtype") for kw in
                                                             call.keywords):
            return "auto"
    for kw in call.keywords:
        if kw.arg in ("torch_dtype", "dtype"):
            dtype = _dtype_named(kw.value, constants)
            return "float32" if dtype == UNSET_DTYPE and load.built else dtype
    if any(kw.arg is None for kw in call.keywords):
        return None
    return "float32" if load.built else UNSET_DTYPE


def _dtype_named(v: ast.expr, constants: dict[str, Any]) -> str | None:
    """A dtype argument's value by TRL's --dtype names; UNSET_DTYPE for None, None for anything computed."""
    if _value(v, constants) is None:
        return UNSET_DTYPE
    name = v.attr if isinstance(v, ast.Attribute) and called_name(v.value) == "torch" else \
        v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
    return _DTYPES.get(name or "")


# How a script names the model it hands a trainer by name (model_args.model_name_or_path, args.model_id).
_NAME_ATTRS = ("model_name_or_path", "model_name", "model_id", "model_path")


def _by_name(out: ScriptSettings, tree: ast.Module, calls: list[ast.Call], bases: dict[str, str],
             constants: dict[str, Any], path: Path) -> None:
    """Where the script's TRL trainer is given its model as a name (`model_by_name`; a literal one is the job's
    model where no from_pretrained named it), and the dtype of the model_init_kwargs its config call spells
    (`init_dtype`), with which TRL's trainers load such a model (trl trainer/sft_trainer.py, dpo_trainer.py)."""
    for call in calls:
        name, at = called_name(call.func), f"{path.name}:{call.lineno}"
        if bases.get(name) in (*TRAINERS, "SFTTrainer") and out.model_by_name is None:
            arg = next((k.value for k in call.keywords if k.arg == "model"), call.args[0] if call.args else None)
            value = _value(arg, constants) if arg is not None else None
            if isinstance(value, str) or isinstance(arg, ast.Attribute | ast.Name) and \
                    (arg.attr if isinstance(arg, ast.Attribute) else arg.id) in _NAME_ATTRS:
                out.model_by_name = at
                out.model = out.model or (value if isinstance(value, str) and "/" in value else None)
        init = next((k.value for k in call.keywords if k.arg == "model_init_kwargs"), None)
        if name in ARGUMENT_CLASSES and init is not None and out.init_at is None:
            out.init_dtype, out.init_at = _init_dtype(init, constants), at
    # `training_args.model_init_kwargs = model_kwargs` (TRL's own sft.py did so with ModelConfig's, 0.12 to 0.16)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and out.init_at is None and any(
                isinstance(t, ast.Attribute) and t.attr == "model_init_kwargs" for t in node.targets):
            out.init_dtype, out.init_at = _init_dtype(node.value, constants), f"{path.name}:{node.lineno}"


def _init_dtype(node: ast.expr, constants: dict[str, Any]) -> str | None:
    """The dtype a model_init_kwargs literal ({"dtype": torch.bfloat16}, dict(dtype="auto")) holds, as `_load_dtype`
    names it (UNSET_DTYPE: None, which TRL passes on); ABSENT_DTYPE where it has no `dtype` (TRL then sets its own
    default, a `torch_dtype` beside it losing to that); None where the mapping is computed."""
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        pairs = {k.value: v for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)}
    elif isinstance(node, ast.Call) and called_name(node.func) == "dict" and not node.args and \
            all(k.arg for k in node.keywords):
        pairs = {k.arg: k.value for k in node.keywords}
    else:
        return None
    return _dtype_named(pairs["dtype"], constants) if "dtype" in pairs else ABSENT_DTYPE


# HfArgumentParser's readers of a whole file of arguments (transformers hf_argparser.py), by the format each reads.
ARG_FILE_CALLS = {"parse_json_file": "json", "parse_yaml_file": "yaml"}
COMMAND_LINE_CALLS = ("parse_args_into_dataclasses", "parse_args_and_config")
# Calls that only turn a path into the same file's path (os.path.abspath(sys.argv[1]), Path(args.config)).
_PATH_WRAPPERS = ("abspath", "realpath", "normpath", "expanduser", "Path", "PurePath", "str", "fspath")


def _file_ref(node: ast.expr, constants: dict[str, Any]) -> tuple[str, str] | None:
    """How a parse_*_file call names its file: ("literal", path), ("argv", "N") for sys.argv[N], ("option",
    name) for `args.name` (an option the script parsed itself); None for anything computed otherwise."""
    while isinstance(node, ast.Call):
        name = called_name(node.func)
        if name in ("resolve", "absolute", "expanduser") and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Call):
            node = node.func.value  # Path(x).resolve()
        elif name in _PATH_WRAPPERS and len(node.args) == 1:
            node = node.args[0]
        else:
            return None
    value = _value(node, constants)
    if isinstance(value, str):
        return "literal", value
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.argv":
        index = _value(node.slice, constants)
        return ("argv", str(index)) if isinstance(index, int) and index >= 1 else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return "option", node.attr
    return None


def _trl_config(tree: ast.Module, trainer: str | None) -> str | None:
    """The first TRL config class the script names (a call, or a class handed to TrlParser), else the config of
    its TRL trainer, unless the script builds the Trainer's own TrainingArguments: TRL's trainers turn those into
    their config through `to_dict()`, which carries every field as set, so none of TRL's defaults apply."""
    named = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Name | ast.Attribute)]
    found = next((n for n in named if n in TRL_CONFIGS), None)
    if found is None and trainer is not None and not any(n in HF_ARGUMENTS for n in named):
        found = trainer.removesuffix("Trainer") + "Config"
    return found


def _shown(values: dict[str, Any], keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={values[k]!r}" for k in keys if k in values)
