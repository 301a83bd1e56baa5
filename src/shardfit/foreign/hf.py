"""An HF Trainer job: TrainingArguments as JSON, or the command line (or shell script) that runs a training script
with them, e.g. Qwen's finetune.sh (`torchrun ... finetune.py --model_name_or_path ... --use_lora True
--deepspeed ds.json`). When the script itself is here, its `from_pretrained(..., device_map=...)` is read too:
a command line cannot show it."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.accelerate import TRL_CONFIGS, Accelerate, read_accelerate
from shardfit.foreign.arg_files import follow_arg_file
from shardfit.foreign.arg_nulls import NULL_KEYS, settle_nulls
from shardfit.foreign.common import (
    ATTENTION,
    FALSE_WORDS,
    TRAINER_NO_EFFECT,
    as_bool,
    as_float,
    as_int,
    eight_bit_words,
    flat_params_of,
    fsdp_engine,
    fsdp_settings,
    fsdp_sharding,
    hf_loss,
    load_yaml,
    local_file,
    optimizer,
    optimizer_keys,
    parse_json,
    read_text,
    record,
    trainer_fsdp1,
)
from shardfit.foreign.deepspeed import DeepSpeedJob
from shardfit.foreign.hf_seq import ALL_SEQ_KEYS, plan_words, seq_note, unread_seq_keys
from shardfit.foreign.job import ForeignJob, ReferenceCopy, Words
from shardfit.foreign.kbit import LOAD_DTYPE_KEYS, TRL_DTYPE_EFFECT, apply_load, job_load, load_keys, trl_kbit
from shardfit.foreign.keys import (
    HF_TRAINER,
    NO_EFFECT,
    TF32,
    TORCH_COMPILE,
    Key,
    Source,
    command_source,
    default_epochs,
    file_env,
    file_keys,
    json_source,
    key_table,
    settings,
    use_deepspeed,
)
from shardfit.foreign.preference import Preference, apply, refuse
from shardfit.foreign.script_ast import ScriptSettings, read_script
from shardfit.foreign.script_loop import HandLoop, hand_loop_job, loop_workload, refuse_unread
from shardfit.foreign.shell import Command, hides_every_gpu, visible_devices
from shardfit.foreign.targets import plan_peft_default, plan_saved, plan_targets, saved_names
from shardfit.foreign.trainer_checks import check_fsdp2_options, check_trainer_args, trainer_defaults
from shardfit.foreign.trainer_eval import EVAL_KEYS, hf_eval
from shardfit.foreign.trl_env import trl_env
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload

# TRL's trainers (script_ast.TRAINERS) as shardfit's objectives; the rest are refused. CPO is planned as simpo.
TRAINERS = {"DPOTrainer": "dpo", "KTOTrainer": "kto", "ORPOTrainer": "orpo", "CPOTrainer": "cpo"}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")
# What each TrainingArguments (or training script) argument means to shardfit: the first sequence length given
# wins, then lora_r over lora_rank.
KEYS = key_table({
    "torch_compile": TORCH_COMPILE,
    "tf32": TF32,
    "use_lora": Key("{method}"), "q_lora": Key("4-bit NF4 frozen weights, fp32 embeddings/norms/head"),
    # TRL's ModelConfig (`_trl_model_config`)
    "use_peft": Key("{method}"), "load_in_4bit": Key("4-bit NF4 frozen weights beside --use_peft"),
    "bf16": Key("{precision}"), "fp16": Key("{precision}"),
    **{k: Key("sequence length", field="seq_len", read=as_int, default=2048) for k in ALL_SEQ_KEYS},
    "per_device_train_batch_size": Key("micro-batch", field="micro_batch", read=as_int, default=8),
    "lora_r": Key("adapter size", field="lora_rank", read=as_int),
    "lora_rank": Key("adapter size", field="lora_rank", read=as_int),
    "gradient_accumulation_steps": Key("grad_accum", field="grad_accum", read=as_int, default=1),
    "gradient_checkpointing": Key("grad_ckpt {grad_ckpt}"), "gradient_checkpointing_kwargs": Key("reentrant or not"),
    # transformers 5.x's names for them, which win where given (`ckpt_key`)
    "activation_checkpointing": Key("grad_ckpt {grad_ckpt}"),
    "activation_checkpointing_kwargs": Key("reentrant or not"),
    "attn_implementation": Key("attention {attention}"), "use_liger_kernel": Key("fused loss"),
    "deepspeed": Key("ZeRO settings"), "fsdp": Key("FSDP"), "device_map": Key("placement"),
    "fsdp_config": Key("FSDP1 or FSDP2, sharding"),
    "ddp_find_unused_parameters": Key("DDP"), "optim": Key("{optimizer}"), "optim_args": Key("{optimizer}"),
    "model": Key("model"),
    # carried over to the shardfit config (LoRA's rank and dropout default by whether LoRA trains: `_convert`)
    "lora_alpha": Key(config="lora.alpha", read=as_int, default=16),
    "lora_dropout": Key(config="lora.dropout", read=as_float),
    **HF_TRAINER, **EVAL_KEYS,
    "ref_model": Key("reference model given to the trainer"),
    # the script's own argument, and peft's LoraConfig(target_modules=...) read in the script (`_file_keys`)
    "lora_target_modules": Key(config="lora.targets", read=lambda v, k, at: target_names(v, k, at, True)),
    "target_modules": Key(config="lora.targets", read=lambda v, k, at: target_names(v, k, at, False)),
}, no_effect=TRAINER_NO_EFFECT | {"beta", "loss_type", "label_smoothing", "precompute_ref_log_probs", "rpo_alpha",
                                  "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight"} | {
                                  "model_name_or_path", "data_path", "eval_data_path", "cache_dir",
                                  "lora_weight_path", "lora_bias", "use_fast_tokenizer"})
# The environment of the command line: what decides the ranks and GPUs; any other variable changes nothing the
# planner counts.
ENV = {"CUDA_VISIBLE_DEVICES": "GPUs", "WORLD_SIZE": "ranks", "NPROC_PER_NODE": "ranks", "GPUS_PER_NODE": "ranks"}
# Variables that change the memory a rank holds in ways the planner does not count: the caching allocator's
# settings (expandable_segments changes the fragmentation reserve) and NCCL's buffers and transports.
# accelerate's and FSDP's variables count where the plan builds a plugin from them (`Accelerate.env_read`); any
# other (or these where a launch's own settings win) is not modelled, never "no effect".
UNMODELLED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NCCL_", "ACCELERATE_", "FSDP_",
                  "PYTORCH_NO_CUDA_MEMORY_CACHING")
_DEVICE_MAP = re.compile(r"device_map\s*=\s*(\"[^\"]*\"|'[^']*'|\{[^}]*\}|[A-Za-z_][\w.]*)")


def words() -> Words:
    return Words(zero={"zero2": "--deepspeed ds_config_zero2.json", "zero3": "--deepspeed ds_config_zero3.json",
                       "zero3_offload": "--deepspeed ds_config_zero3_offload.json"},
                 keys={**eight_bit_words("--optim {}"), "fused_loss": "--use_liger_kernel True",
                       "grad_ckpt": "--gradient_checkpointing True", "micro_batch": "--per_device_train_batch_size 1 "
                       "with --gradient_accumulation_steps", "seq": "--model_max_length", "lora": "--use_lora True",
                       # Qwen's finetune.py quantizes only with --use_lora
                       "qlora": "--use_lora True --q_lora True (4-bit base weights)",
                       "device_map": "device_map=None (or {'': int(os.environ['LOCAL_RANK'])}) in from_pretrained "
                       "when WORLD_SIZE > 1", "model_parallel": "one process (python, no torchrun) with "
                       "device_map='auto'", "reentrant": "--gradient_checkpointing_kwargs "
                       "'{\"use_reentrant\": false}'", "quant_storage": "bnb_4bit_quant_storage=torch.bfloat16 in "
                       "BitsAndBytesConfig", "ref_precompute": "precompute_ref_log_probs=True in DPOConfig/KTOConfig "
                       "(--precompute_ref_log_probs True)", "eval_accumulation": "--eval_accumulation_steps 1",
                       "eval_batch": "--per_device_eval_batch_size"})


def read_hf(path: Path, shape_of: Any, version: str, nproc: int | None, model: str | None,
            seq: int | None = None, batch: int | None = None, optimizer: str | None = None) -> ForeignJob:
    """TrainingArguments (.json) or a command line / script running a training script; `seq`, `batch` and
    `optimizer` are plan's --seq, --batch and --optimizer (a hand-written loop's refusals: script_loop.py)."""
    if path.suffix == ".json":
        src, cmd = json_source(path, "TrainingArguments"), None
    elif path.suffix == ".py":  # the training script itself: what it sets in code is all there is
        src, cmd = Source(path, {}, []), None
    else:
        src, cmd = command_source(path, (".py", *(f"trl {c}" for c in TRL_CLI)))
    script = path if path.suffix == ".py" else _script(cmd, path)
    shell = dict(cmd.exported) if cmd else {}
    code = _trl_cli(cmd, src) if cmd is not None and cmd.program.startswith("trl ") else \
        _script_settings(script, src, cmd)
    env = cmd.exported if cmd else {}  # what the launcher sees (under `trl <command>`, with the YAML's env)
    ran = {**env, **code.config_env}  # what the script's processes see once TrlParser has set the YAML's env
    trl_notes: list[str] = []
    program = cmd.program if cmd else path.name
    unread = unread_seq_keys(src, program)
    settle_nulls(src, seq, trl_notes, load_keys(code, program))
    seq_note(src, program, seq, trl_notes)
    _trl_model_config(src, code, trl_notes)
    check_trainer_args(src, "the HF Trainer" if code.trl_config is None else f"TRL's {code.trl_config}",
                       "--" if cmd else "", trainer_defaults(code.trl_config))
    if cmd is not None and hides_every_gpu(cmd.exported) and "CUDA_VISIBLE_DEVICES" not in code.config_env:
        raise UserError(f"{src.where}: CUDA_VISIBLE_DEVICES={cmd.exported['CUDA_VISIBLE_DEVICES']!r} leaves CUDA no "
                        f"GPU (it stops at the first entry that is not 0, 1, ... or a GPU-/MIG- id): the job would "
                        f"run on no GPU. List the GPUs to use (CUDA_VISIBLE_DEVICES=0,1), or remove it.")
    model = model or src.get("model_name_or_path") or src.get("model") or code.model
    if not model:
        unread = [f for f in code.found if "did not read it" in f]
        raise UserError(f"{src.where}: no --model_name_or_path; pass the model with --model ID_OR_PATH." +
                        "".join(f" The script's {f}." for f in unread))
    loop = code.hand_loop
    shape = shape_of(model)
    acc = read_accelerate(cmd, path.parent, src.where, in_process=code.config_env)
    launched = acc if cmd is not None and cmd.launcher == "accelerate" else None
    job = ForeignJob("hf", src.where, model, Workload(), words=words(), nproc=_ranks(cmd, env, nproc, launched),
                     nnodes=launched.nnodes if launched else cmd.nnodes if cmd else 1,
                     launcher=cmd.launcher if cmd else None)
    job.every_gpu = launched is not None and launched.every_gpu and job.nproc is None
    job.words.keys.update(plan_words(job.launcher, src, launched, code.model_config))
    job.notes += _assumptions(src, code) + trl_notes + (acc.notes if acc else [])
    w = job.workload = _job_workload(src, job, code, version, acc, batch, optimizer)
    loaded = job_load(src, code, version, program)
    job.workload, kbit_note = trl_kbit(w, code.trl_trainer, code.prepares_kbit, shape, version, loaded)
    job.notes += [kbit_note] if kbit_note else []
    job.reentrant_ckpt = w.grad_ckpt != "none" and "false" not in str(src.get(ckpt_key(src, "_kwargs"), "")).lower()
    if "activation_checkpointing" in src:  # the old name would lose to it
        job.words.keys["grad_ckpt"] = "--activation_checkpointing True"
    # The Trainer looks for unused parameters unless told otherwise or the model is a plain transformers model
    # with checkpointing on; a PEFT model is not one.
    fu = src.get("ddp_find_unused_parameters")
    job.find_unused = as_bool(fu) if fu is not None else (_lora(src) or w.grad_ckpt == "none")
    if loop is None or not hand_loop_job(job, loop, src, shape.hidden):
        _engine(src, job, shape.hidden, version, acc, trl_bf16=_trl_bf16(src, code.trl_config))
    loaded = loop.loaded(loaded, job) if loop is not None and loaded is not None else loaded
    job.workload, load_note = apply_load(job.workload, job.engine, loaded)
    job.notes += [load_note] if load_note else []
    _device_map(src, job, script, ran)
    job.speech_outputs = "omni" in model.lower()
    job.quant_storage = "bnb_4bit_quant_storage" in src
    data = [src.get(k) for k in ("data_path", "train_file", "dataset") if src.get(k)]
    job.data = [hit for d in data if (hit := local_file(d, path.parent))]
    _convert_keys(src, job, loop)
    apply(job, _preference(src, code.trainer, job))
    _file_keys(src, job, job.workload, shape, version, code.model_config, loaded.key if loaded else None)
    for key, value in {**unread, **code.ignored_args}.items():
        record(job, key, value, modelled=False)
    for key in code.arg_file_keys & job.not_modelled.keys() - KEYS.keys():
        # a key no TrainingArguments field has: the file may not be arguments at all, so its value stays unshown
        job.not_modelled[key] = "(value not shown)"
    file_env(job, ran, {**ENV, **(acc.env_read if acc else {})}, unknown=NO_EFFECT, unmodelled=UNMODELLED_ENV)
    _config_rank_env(job, code, cmd)
    _config_env_notes(job, code, shell, cmd)
    return job


def _job_workload(src: Source, job: ForeignJob, code: ScriptSettings, version: str, acc: Accelerate | None,
                  batch: int | None, optimizer: str | None) -> Workload:
    """The Trainer's workload with its evaluation; for a hand-written loop, none of the Trainer's defaults but what
    the loop runs, or exit 2 for what cannot be read (script_loop.py; `batch`, `optimizer`: plan's flags)."""
    w = _workload(src, job, version, acc, code.trl_config, code.hand_loop is not None)
    if code.hand_loop is not None:
        refuse_unread(code.hand_loop, src.where, batch, optimizer)
        return loop_workload(w, code.hand_loop, batch, optimizer, w.precision, job.notes)
    return dataclasses.replace(w, **hf_eval(src, code, code.trainer in TRAINERS,
                                            src.flag("predict_with_generate", "false"), job.notes))


def _convert_keys(src: Source, job: ForeignJob, loop: HandLoop | None) -> None:
    """The shardfit config keys the job carries over; its epochs the Trainer's default, or a hand loop's own."""
    job.convert = settings(src, KEYS, "config", **{"lora.dropout": 0.05 if _lora(src) else 0.0})
    if loop is None:
        default_epochs(job, src, KEYS, "the HF Trainer")
    else:
        loop.convert(job)
    if not _lora(src):
        job.convert.get("lora", {}).pop("targets", None)


# The variables torch's launchers set in each rank for its rendezvous: one a TrlParser YAML sets replaces the
# launcher's in every rank before the process group starts (and accelerate launch never reads NPROC_PER_NODE).
RANK_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NPROC_PER_NODE",
            "GPUS_PER_NODE")


def _config_rank_env(job: ForeignJob, code: ScriptSettings, cmd: Command | None) -> None:
    """A TrlParser YAML's rank variables (RANK_ENV, MASTER_*) count no ranks: filed as not modelled, with a note.
    Its WORLD_SIZE overrides the launcher's in every rank, so one other than the ranks the launch starts makes the
    rendezvous wait for ranks that never come: a UserError."""
    given = [k for k in code.config_env if k in RANK_ENV or k.startswith("MASTER_")]
    for key in given:
        job.keys.pop(f"env {key}", None)
        record(job, f"env {key}", code.config_env[key], modelled=False)
    if not given:
        return
    ranks = None  # one per GPU the machine shows, or a launcher's own default: not known here
    if job.nproc and not job.every_gpu:
        ranks = job.nproc * job.nnodes
    elif not job.every_gpu and (cmd is None or cmd.launcher is None):
        ranks = 1  # `python train.py`: one process
    world = code.config_env.get("WORLD_SIZE")
    if world is not None and ranks is not None and world.strip() != str(ranks):
        raise UserError(f"{code.config_file}: env.WORLD_SIZE is {world}, but the launch starts {ranks} rank(s): "
                        f"TrlParser sets it in every rank over the launcher's value, so the process group waits "
                        f"for {world} ranks and hangs. Remove WORLD_SIZE from env (the launcher sets it).")
    job.notes.append(f"{code.config_file}'s env: {', '.join(given)} replace the launcher's own in each rank; they "
                     f"count no ranks here (the launch does) and are best left to the launcher")


def _config_env_notes(job: ForeignJob, code: ScriptSettings, shell: dict[str, str], cmd: Command | None) -> None:
    """Say what the TrlParser YAML's `env:` set, over which of the shell's values, and what its
    CUDA_VISIBLE_DEVICES does: under `trl <command>` accelerate counts those GPUs; in a script TrlParser sets it in
    each rank after the launcher has counted, so a rank past the GPUs it leaves has no device of its own."""
    if not code.config_env:
        return
    trl_cli = cmd is not None and cmd.program.startswith("trl ")
    over = [f"{k}={shell[k]}" for k in code.config_env if k in shell and shell[k] != code.config_env[k]]
    job.notes.append(f"{code.config_file}'s env: sets " + ", ".join(f"{k}={v}" for k, v in code.config_env.items())
                     + (" before `trl` starts accelerate" if trl_cli else " in the script's processes") +
                     " (TrlParser exports it into os.environ" + (f", over the shell's {', '.join(over)}" if over
                                                                 else "") + ")")
    gpus = visible_devices(code.config_env)
    if not gpus:
        return
    value = code.config_env["CUDA_VISIBLE_DEVICES"]
    if trl_cli and job.nproc is not None and job.nproc > len(gpus):
        # the trl CLI exports it before accelerate starts the ranks: each sees these GPUs from its first line
        raise UserError(f"{code.config_file}: env.CUDA_VISIBLE_DEVICES is {value}, {len(gpus)} GPU(s), but "
                        f"--num_processes starts {job.nproc} ranks a machine: ranks {len(gpus)} and up have no GPU "
                        f"and fail (\"invalid device ordinal\"), so the job cannot start. Pass --num_processes "
                        f"{len(gpus)}, or list {job.nproc} GPUs in env.CUDA_VISIBLE_DEVICES.")
    if trl_cli:
        return
    if job.nproc is not None and job.nproc > len(gpus):
        job.notes.append(f"{code.config_file}'s env: CUDA_VISIBLE_DEVICES={value} leaves each of the {job.nproc} "
                         f"ranks {len(gpus)} GPU(s): a rank whose LOCAL_RANK is past them has no device (\"invalid "
                         f"device ordinal\") unless CUDA started before TrlParser ran")
    elif job.every_gpu:
        job.notes.append(f"{code.config_file}'s env: CUDA_VISIBLE_DEVICES={value} leaves each rank {len(gpus)} "
                         f"GPU(s), but the launch starts one rank per GPU the machine shows: on a machine with more, "
                         f"a rank whose LOCAL_RANK is past them has no device (\"invalid device ordinal\") unless "
                         f"CUDA started before TrlParser ran")


def _preference(src: Source, trainer: str | None, job: ForeignJob) -> Preference:
    """The TRL trainer the script builds, in shardfit's objectives, with its config's settings. TRL's DPO and KTO
    trainers copy the model as the reference unless it is a peft model or `precompute_ref_log_probs` is set
    (or a `ref_model` is passed: then that one, adapters or not)."""
    if trainer is None:
        if any(k in src for k in ("beta", "loss_type", "precompute_ref_log_probs")):
            job.notes.append("preference arguments given, but the script's TRL trainer is not here: planned as SFT")
        return Preference()
    kind = TRAINERS.get(trainer)
    if kind is None:
        raise refuse(src.where, "trainer", trainer, "a TRL trainer shardfit has no objective for")
    loss = src.get("loss_type", "simpo" if kind == "cpo" else "sigmoid")
    pref = Preference(objective="simpo" if kind == "cpo" else kind)
    pref.number("beta", src.get("beta", 0.1), "beta", src.where)
    if kind == "cpo":
        pref.objective = "simpo"
        if loss != "simpo":
            job.notes.append("CPOTrainer planned as simpo: the same memory (pairs, no reference model)")
            pref.unconvertible = f"CPOTrainer with loss_type {loss} has no shardfit objective; use loss_type simpo"
        pref.number("simpo_gamma", src.get("simpo_gamma"), "simpo_gamma", src.where)
        if as_float(src.get("cpo_alpha", 1.0), "cpo_alpha", src.where) > 0:
            pref.drop("cpo_alpha", src.get("cpo_alpha", "1.0 (TRL's default)"), "TRL's CPO trainer adds cpo_alpha "
                      "times the chosen answer's NLL; shardfit's simpo has none (cpo_alpha=0 is plain SimPO)")
    if kind == "dpo":
        if loss in DPO_LOSSES:
            pref.dpo["loss"] = loss
        else:
            pref.unconvertible = f"loss_type {loss}: shardfit's dpo losses are {', '.join(DPO_LOSSES)}"
    if kind in ("dpo", "cpo"):
        pref.number("label_smoothing", src.get("label_smoothing"), "label_smoothing", src.where)
    if kind == "kto":
        pref.number("desirable_weight", src.get("desirable_weight"), "desirable_weight", src.where)
        pref.number("undesirable_weight", src.get("undesirable_weight"), "undesirable_weight", src.where)
    rpo = src.get("rpo_alpha")
    if kind == "dpo" and rpo not in (None, "None") and as_float(rpo, "rpo_alpha", src.where) > 0:
        pref.drop("rpo_alpha", rpo, "RPO's NLL term on the chosen answer; shardfit's dpo has none")
    if kind in ("dpo", "kto"):
        pref.precompute = src.flag("precompute_ref_log_probs", "false") or None
        ref = src.get("ref_model")
        if ref is not None:
            pref.drop("ref_model", ref, "a reference model of its own; shardfit's reference is the model it starts "
                      "from (`model:`)")
        pref.reference = ReferenceCopy(f"{trainer} " + (f"is given ref_model={ref}" if ref else
                                                         "without peft copies the model as the reference"),
                                       with_adapters=ref is not None)
    return pref


def _script_settings(script: Path | None, src: Source, cmd: Command | None) -> ScriptSettings:
    """What the training script sets in code (script_ast.py, read, never run), added to `src` where the command
    line is silent. A script parsing with TRL's TrlParser reads `--config FILE.yaml` as TRL does first: the YAML's
    keys are its dataclasses' fields, below the command line's."""
    if script is None:
        return ScriptSettings()
    code = read_script(script, read_text(script))
    if code.trl_parser:
        code.config_file = src.get("config")
        code.config_env = _trl_yaml(src, cmd)
    follow_arg_file(code, src, script, cmd)
    for k, v in code.args.items():
        if k not in src:
            src.values[k] = v
            src.order.append(k)
            if k in code.arg_at:
                src.given_at[k] = code.arg_at[k]
    return code


def _assumptions(src: Source, code: ScriptSettings) -> list[str]:
    """What the plan takes from the script's code, and the defaults it assumes where neither says."""
    out = [f"read in the script: {'; '.join(code.found)}"] if code.found else []
    if not any(k in src for k in ("use_lora", "q_lora", "lora_r")):
        out.append("no LoRA (no --use_lora, no peft LoraConfig in the script): planned as a full fine-tune (pass "
                   "--method lora)")
    if code.hand_loop is not None:
        return out + code.hand_loop.assumptions(ckpt_key(src) in src)
    if "per_device_train_batch_size" not in src:
        out.append("per_device_train_batch_size not set: the Trainer's default, 8 (pass --batch)")
    unset = ckpt_key(src) not in src
    if unset and code.trl_config is not None:
        out.append(f"gradient checkpointing not set: on, TRL's {code.trl_config} default (TRL 0.23 and later; "
                   f"off before: pass --grad-ckpt none)")
    elif unset:
        out.append("gradient checkpointing not set: off, the Trainer's default (pass --grad-ckpt full)")
    return out


def ckpt_key(src: Source, suffix: str = "") -> str:
    """The key that decides checkpointing (`suffix` "_kwargs": its arguments): transformers 5.x's
    activation_checkpointing where given, else its deprecated alias gradient_checkpointing, which TrainingArguments
    `__post_init__` reads only where the new name is None (4.x has the old name alone)."""
    new = f"activation_checkpointing{suffix}"
    return new if src.get(new) is not None else f"gradient_checkpointing{suffix}"


def _ranks(cmd: Command | None, env: dict[str, str], nproc: int | None, acc: Accelerate | None) -> int | None:
    """Ranks per node: --nproc, else the launcher's (accelerate's: its flags, its config file, or None for one per
    visible GPU); the deepspeed launcher starts one per visible GPU."""
    if cmd is None:
        return nproc
    ranks = nproc or (acc.nproc if acc is not None else cmd.nproc)
    if cmd.launcher == "deepspeed" and ranks is None:
        ranks = len(visible_devices(env)) or None
    return ranks


# TRL's own command line (trl 1.16 cli/commands/training.py): `trl <command>` runs trl/scripts/<command>.py under
# `accelerate launch`, by the trainer and config classes that script builds (SFT: no preference trainer).
TRL_CLI = {"sft": (None, "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"), "kto": ("KTOTrainer", "KTOConfig"),
           "grpo": ("GRPOTrainer", "GRPOConfig"), "rloo": ("RLOOTrainer", "RLOOConfig"),
           "reward": ("RewardTrainer", "RewardConfig"), "distillation": ("DistillationTrainer", "DistillationConfig")}
# `accelerate launch` options, which `trl <command>` passes to accelerate (its script does not take them).
ACCELERATE_OPTIONS = ("config_file", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                      "main_process_port", "mixed_precision", "multi_gpu", "use_deepspeed", "use_fsdp", "gpu_ids",
                      "fsdp_version", "zero_stage", "deepspeed_config_file", "dynamo_backend")


def _trl_cli(cmd: Command, src: Source) -> ScriptSettings:
    """Read `trl <command> ...` as the `accelerate launch trl/scripts/<command>.py ...` it runs: accelerate's options
    (and `--accelerate_config`, its config file) move to the launch; the script's arguments are TRL's config's."""
    cmd.launcher = "accelerate"
    config_file = src.get("config")
    config_env = _trl_yaml(src, cmd)
    # the trl CLI parses the YAML in its own process, which then starts accelerate: the launch sees the variables
    cmd.exported = {**cmd.exported, **config_env}
    for name in (*ACCELERATE_OPTIONS, "accelerate_config"):
        if name in src.values:
            value = src.values.pop(name)
            src.order.remove(name)
            cmd.launcher_args[_trl_accelerate_config(value, src) if name == "accelerate_config" else
                              f"--{name}"] = value
    trainer, config = TRL_CLI[cmd.program.split(" ", 1)[1]]
    return ScriptSettings(trainer=trainer, trl_trainer=trainer or "SFTTrainer", trl_config=config, model_config=True,
                          found=[f"{cmd.program}: TRL's {config} and ModelConfig, launched by accelerate"],
                          config_env=config_env, config_file=config_file)


def _trl_yaml(src: Source, cmd: Command | None) -> dict[str, str]:
    """`--config FILE` to TrlParser (`trl <command>`, or a script that parses with it): the YAML's keys become the
    defaults of the script's dataclass fields, so the command line's flags win over them (trl 1.16
    scripts/utils.py `parse_args_and_config`, `set_defaults_with_config`); under `trl <command>` its accelerate
    keys go to the launch as the command line's do (cli/commands/training.py). Said in `src` as if given on the
    command line. Returns the YAML's `env:` section (trl_env.py `trl_env`), which is no argument. TrlParser finds the
    option only as the word `--config` (`args.index("--config")`): `--config=FILE` never reaches it, and the
    dataclasses' parser then refuses the word, so that spelling is a UserError."""
    ref = src.values.pop("config", None)
    if ref is None:
        return {}
    if cmd is not None and "config" in cmd.joined:
        raise UserError(f"{src.where}: --config={ref}: TrlParser reads the YAML only from `--config {ref}`, two "
                        f"words; written with '=' it is left to the arguments parser, which refuses it "
                        f"(\"Some specified arguments are not used by the HfArgumentParser: ['--config={ref}']\"), "
                        f"so the job never starts. Write --config {ref}.")
    src.order.remove("config")
    hit = local_file(str(ref), src.path.parent)
    if hit is None:
        raise UserError(f"{src.where}: --config {ref}: no such YAML file here; TRL reads the job's arguments from "
                        f"it. Give its path (relative to the command's file), or the arguments on the command line.")
    data, lines = load_yaml(Path(hit), nested=True)
    for key, value in data.items():
        if key in src.values or key == "env" or value is None and key not in NULL_KEYS:
            continue
        if value is None:  # arg_nulls.py `settle_nulls`, kbit.py `job_load`
            src.null_at[key] = f"{hit}:{lines.get(key, '?')}"
        src.values[key] = None if value is None else " ".join(map(str, value)) if isinstance(value, list) else \
            str(value).lower() if isinstance(value, bool) else str(value)
        src.order.append(key)
    return trl_env(data, lines, Path(hit)) if "env" in data else {}


def _trl_accelerate_config(value: str, src: Source) -> str:
    """The launch option `trl --accelerate_config VALUE` becomes (trl 1.16 cli/accelerate_config.py): a file's
    path, else the name of a config TRL ships (zero3, fsdp2, ...); any other name (or none) TRL refuses."""
    if local_file(value, src.path.parent) is not None or value not in TRL_CONFIGS and \
            ("/" in value or value.endswith((".yaml", ".yml", ".json"))):
        return "--config_file"  # a path, here or on the machine that runs it (the launch notes which)
    if value in TRL_CONFIGS:
        return "--trl_accelerate_config"
    raise UserError(f"{src.at('accelerate_config')}: --accelerate_config {value} is neither a file here nor a config "
                    f"TRL ships; TRL refuses it (\"neither a file nor a valid config in the `trl` package\"). Give "
                    f"the file's path or one of {', '.join(TRL_CONFIGS)}.")


def _trl_model_config(src: Source, code: ScriptSettings, notes: list[str]) -> None:
    """Read TRL's ModelConfig arguments as TRL does (trl 1.16 trainer/model_config.py, `get_peft_config`): LoRA only
    with --use_peft (then --lora_r 16 and --lora_alpha 32 by default), 4-bit base weights with --load_in_4bit
    beside it; without --use_peft the script trains every weight, whatever --lora_r says. Said in `src` as the
    Trainer scripts' own keys (use_lora, q_lora, lora_r), which the rest of the reader plans."""
    if not code.model_config:
        return
    if not src.flag("use_peft", "false"):
        for key in ("lora_r", "lora_rank"):
            if key in src.values:
                src.values.pop(key)
                src.order.remove(key)
                notes.append(f"--{key} without --use_peft: TRL's ModelConfig builds no LoRA, the script trains "
                             f"every weight (pass --use_peft for LoRA)")
        return
    src.values.setdefault("use_lora", "true")
    src.values.setdefault("lora_r", "16")
    src.values.setdefault("lora_alpha", "32")
    if src.flag("load_in_4bit", "false"):
        src.values.setdefault("q_lora", "true")
    notes.append("--use_peft: LoRA through TRL's ModelConfig (lora_r 16, lora_alpha 32 unless given" +
                 ("; --load_in_4bit: 4-bit NF4 base weights)" if src.flag("load_in_4bit", "false") else ")"))


def _script(cmd: Command | None, path: Path) -> Path | None:
    """The training script the command runs, when it is here."""
    found = local_file(cmd.program, path.parent) if cmd else None
    return Path(found) if found else None


def _lora(src: Source) -> bool:
    return src.flag("use_lora", "false") or src.flag("q_lora", "false") or "lora_r" in src


def _trl_bf16(src: Source, trl_config: str | None) -> bool:
    """Whether the job trains in bf16 by TRL's default: its arguments are a TRL config and set neither bf16 nor
    fp16 (TRL >= 0.19 resolves `bf16=None` to `not fp16` in the config's `__post_init__`, before the
    TrainingArguments' own, so it also wins over accelerate's mixed precision)."""
    return trl_config is not None and src.get("bf16") in (None, "None") and not src.flag("fp16", "false")


def _workload(src: Source, job: ForeignJob, version: str, acc: Accelerate | None, trl_config: str | None,
              hand_loop: bool = False) -> Workload:
    """The Trainer's workload; for a `hand_loop`, the fields script_loop.py `loop_workload` replaces are said by it,
    not here (its precision: accelerate's, which only the script's Accelerator applies)."""
    q, lora = src.flag("q_lora", "false"), _lora(src)
    precision = "bf16" if src.flag("bf16", "false") else "fp16" if src.flag("fp16", "false") else "fp32"
    if _trl_bf16(src, trl_config) and not hand_loop:
        precision = "bf16"
        # transformers 5's TrainingArguments checks bf16 with torch.cuda.is_bf16_supported(), which a GPU before
        # Ampere passes wherever it can hold a bf16 tensor (torch's emulation check); an older torch asked for
        # compute capability 8 and transformers then raised
        job.notes.append(f"neither bf16 nor fp16 set: bf16, TRL's {trl_config} default (TRL 0.19 and later). On a "
                         f"GPU without bf16 arithmetic (T4, V100) transformers lets it run, as torch.cuda."
                         f"is_bf16_supported() counts the emulation, so it trains slowly; with an older torch it "
                         f"raises \"Your setup doesn't support bf16/gpu\". Set fp16 true there")
    elif precision == "fp32" and acc is not None and acc.mixed_precision in ("bf16", "fp16"):
        # TrainingArguments takes ACCELERATE_MIXED_PRECISION, which the launch sets, unless --bf16/--fp16 say
        # otherwise (transformers' training_args.py `__post_init__`, `self.mixed_precision`)
        precision = acc.mixed_precision
        job.notes += [] if hand_loop else [f"neither --bf16 nor --fp16: the Trainer runs accelerate's mixed "
                                           f"precision {precision} ({acc.source})"]
    return Workload(method="qlora" if q else "lora" if lora else "full", precision=precision,
                    grad_ckpt="full" if src.flag(ckpt_key(src), "true" if trl_config else "false")
                    else "none",
                    # a hand-written loop builds its own optimizer: the Trainer's optim_args reach nothing
                    **optimizer_keys(src.get("optim"), version, [] if hand_loop else job.notes,
                                    optim_args=None if hand_loop else src.get("optim_args"),
                                    weight_decay=src.get("weight_decay", 0.0),
                                    where=src.at("optim_args")),
                    loss=hf_loss(version, src.flag("use_liger_kernel", "false")),
                    attention=_attention(src.get("attn_implementation"), job), frozen_fp32=q,
                    quant_backend="bnb",  # transformers' 4-bit loading is bitsandbytes'
                    **settings(src, KEYS, "field", lora_rank=64 if lora else 8))


def _attention(impl: Any, job: ForeignJob) -> str:
    """The planner's attention for `attn_implementation` = `impl`; unset, transformers' default (read.py decides it
    by version and model)."""
    if impl is None or str(impl).lower() == "auto":
        job.attention_unset = True
        return "sdpa"
    return ATTENTION.get(str(impl).lower(), "sdpa")


def _engine(src: Source, job: ForeignJob, hidden: int, version: str, acc: Accelerate | None,
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


def _device_map(src: Source, job: ForeignJob, script: Path | None, env: dict[str, str]) -> None:
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


def target_names(value: Any, key: str, where: str, names: bool) -> str | list[str]:
    """LoRA's target modules as given: a JSON or Python list of module names, or text. A script's own argument
    (`names`, e.g. Qwen's `lora_target_modules: List[str]`) is module names, on the command line separated by
    spaces (HfArgumentParser's nargs) or commas; peft's `target_modules` as a string is one regular expression over
    module names, or all-linear."""
    text = str(value).strip()
    if text.startswith("["):
        try:
            items = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            items = None
        if not isinstance(items, list) or not items or not all(isinstance(t, str) for t in items):
            raise UserError(f"{where}: '{key}' is {text!r}; give module names (q_proj v_proj), not this.")
        return [t.strip() for t in items]
    if not names:
        return text
    parts = [t for t in re.split(r"[,\s]+", text) if t]
    if not parts:
        raise UserError(f"{where}: '{key}' is empty; give module names (q_proj v_proj) or leave it out.")
    return "all-linear" if parts == ["all-linear"] else parts


def _file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str,
               model_config: bool = False, load_key: str | None = None) -> None:
    """Plan the LoRA targets and modules_to_save given, and record every key's effect. Under TRL's ModelConfig
    (`model_config`, trl 1.16 `get_peft_config`), --use_peft without targets builds a LoraConfig without
    target_modules, so peft takes its default for the model's type, and one --lora_target_modules entry reaches
    peft as a string (ModelConfig's `__post_init__` unwraps a list of one), which peft reads as a regular
    expression over whole module names."""
    unplanned = {"optim"} if optimizer(src.get("optim", "adamw_torch")) is None else set()
    effects = {}
    if model_config:
        _plan_peft_default(src, job, w, shape, version)
    for key in ("lora_target_modules", "target_modules"):
        if key not in src:
            continue
        # no adapters train: the targets change nothing
        effect = _plan_target_key(src, job, key, shape, version, model_config) if w.trains_adapters else ""
        if effect:
            effects[key] = effect
        else:
            unplanned.add(key)
    # ModelConfig's --lora_modules_to_save goes to peft's modules_to_save (trl `get_peft_config`), as LF's,
    # axolotl's and ms-swift's do: planned alike
    saved = saved_names(src.get("lora_modules_to_save"))
    if saved and job.workload.trains_adapters:
        effect = plan_saved(job, "--lora_modules_to_save", saved)
        if effect:
            effects["lora_modules_to_save"] = effect
        else:
            unplanned.add("lora_modules_to_save")
    # foreign/kbit.py `job_load`, `trl_kbit`, `apply_load`; `load_key`: the argument that gave the load's dtype
    for key in (*(LOAD_DTYPE_KEYS if model_config else ()), *((load_key,) if load_key else ())):
        effects[key] = TRL_DTYPE_EFFECT.get(w.method, "")
    file_keys(job, src.items(), KEYS, job.workload, effects=effects, unplanned=unplanned)


def _plan_peft_default(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str) -> None:
    """TRL's ModelConfig with --use_peft and no targets: peft's default targets for the model's type, planned
    (`plan_peft_default`, whose note says them) and kept for the converted config."""
    if w.trains_adapters and src.flag("use_peft", "false") and \
            not {"lora_target_modules", "target_modules", "lora_target_parameters"} & set(src.values):
        _, targets = plan_peft_default(job, "--use_peft", shape, version)
        if targets:
            job.convert.setdefault("lora", {})["targets"] = targets


def _one_entry(src: Source, job: ForeignJob, key: str, model_config: bool) -> str | None:
    """The string peft gets where TRL's ModelConfig unwraps a --lora_target_modules of one entry (a regular
    expression over whole module names), with a note saying so; None where the targets reach peft as a list.
    argparse splits on spaces only, so `q_proj,v_proj` is that one entry whole, which no module name matches:
    exit 2 naming the fix."""
    raw = src.get(key)
    one_raw = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw if isinstance(raw, str) and \
        len(raw.split()) == 1 else None
    if not (model_config and key == "lora_target_modules" and isinstance(one_raw, str)):
        return None
    targets = one_raw.strip()
    if "," in targets:  # no module name holds a comma: peft raises "Target modules ... not found"
        raise UserError(f"{src.at(key)}: --lora_target_modules {targets} is one entry: TRL's ModelConfig "
                        f"hands peft one entry as this string, a regular expression over whole module "
                        f"names, and no name holds a comma, so peft raises \"Target modules {{'{targets}'}} "
                        f"not found in the base model\". Separate the names with spaces "
                        f"(--lora_target_modules {' '.join(targets.split(','))}).")
    job.notes.append(f"--lora_target_modules {targets}: TRL's ModelConfig hands peft one entry as a "
                     f"string, a regular expression over whole module names")
    return targets


def _plan_target_key(src: Source, job: ForeignJob, key: str, shape: ModelShape, version: str,
                     model_config: bool) -> str:
    """Plan the LoRA targets of `key` (`plan_targets`; all-linear: every linear layer) and return their effect,
    "" where not modelled. A pattern of one entry under TRL's ModelConfig (`_one_entry`) that peft would refuse
    says how to write it as whole names."""
    targets = KEYS[key].read(src.get(key), key, src.at(key))
    one = _one_entry(src, job, key, model_config)
    if one is not None:
        targets = one
    try:
        return "adapters on every linear layer" if targets == "all-linear" else \
            plan_targets(job, key, targets, shape, version)
    except UserError as e:
        if one is None:
            raise
        raise UserError(f"{e} TRL's ModelConfig hands peft a --lora_target_modules of one entry as this "
                        f"string, not as a list of one name: give a pattern of whole names "
                        f"('.*\\.{targets}').") from None


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
