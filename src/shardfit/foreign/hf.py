"""An HF Trainer job: TrainingArguments as JSON, or the command line (or shell script) that runs a training script
with them, e.g. Qwen's finetune.sh (`torchrun ... finetune.py --model_name_or_path ... --use_lora True
--deepspeed ds.json`). When the script itself is here, its `from_pretrained(..., device_map=...)` is read too:
a command line cannot show it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.accelerate import Accelerate, read_accelerate
from shardfit.foreign.arg_nulls import settle_nulls
from shardfit.foreign.common import ATTENTION, as_bool, as_float, hf_loss, local_file, optimizer_keys, record
from shardfit.foreign.hf_args import (
    TRL_CLI,
    config_env_notes,
    config_rank_env,
    script_settings,
    trl_cli_settings,
    trl_model_config,
)
from shardfit.foreign.hf_engine import plan_device_map, plan_engine
from shardfit.foreign.hf_keys import ENV, KEYS, UNMODELLED_ENV, plan_file_keys, words
from shardfit.foreign.hf_seq import plan_words, seq_note, unread_seq_keys
from shardfit.foreign.job import ForeignJob, ReferenceCopy
from shardfit.foreign.kbit import apply_load, job_load, load_keys, trl_kbit
from shardfit.foreign.keys import NO_EFFECT, Source, command_source, default_epochs, file_env, json_source, settings
from shardfit.foreign.preference import Preference, apply, refuse
from shardfit.foreign.script_ast import ScriptSettings
from shardfit.foreign.script_loop import HandLoop, hand_loop_job, loop_workload, refuse_unread
from shardfit.foreign.shell import Command, hides_every_gpu, visible_devices
from shardfit.foreign.trainer_checks import check_trainer_args, trainer_defaults
from shardfit.foreign.trainer_eval import hf_eval
from shardfit.plan.workload import Workload

# TRL's trainers (script_ast.TRAINERS) as shardfit's objectives; the rest are refused. CPO is planned as simpo.
TRAINERS = {"DPOTrainer": "dpo", "KTOTrainer": "kto", "ORPOTrainer": "orpo", "CPOTrainer": "cpo"}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")


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
    code = trl_cli_settings(cmd, src) if cmd is not None and cmd.program.startswith("trl ") else \
        script_settings(script, src, cmd)
    env = cmd.exported if cmd else {}  # what the launcher sees (under `trl <command>`, with the YAML's env)
    ran = {**env, **code.config_env}  # what the script's processes see once TrlParser has set the YAML's env
    trl_notes: list[str] = []
    program = cmd.program if cmd else path.name
    unread = unread_seq_keys(src, program)
    settle_nulls(src, seq, trl_notes, load_keys(code, program))
    seq_note(src, program, seq, trl_notes)
    trl_model_config(src, code, trl_notes)
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
        plan_engine(src, job, shape.hidden, version, acc, trl_bf16=_trl_bf16(src, code.trl_config))
    loaded = loop.loaded(loaded, job) if loop is not None and loaded is not None else loaded
    job.workload, load_note = apply_load(job.workload, job.engine, loaded)
    job.notes += [load_note] if load_note else []
    plan_device_map(src, job, script, ran)
    job.speech_outputs = "omni" in model.lower()
    job.quant_storage = "bnb_4bit_quant_storage" in src
    data = [src.get(k) for k in ("data_path", "train_file", "dataset") if src.get(k)]
    job.data = [hit for d in data if (hit := local_file(d, path.parent))]
    _convert_keys(src, job, loop)
    apply(job, _preference(src, code.trainer, job))
    plan_file_keys(src, job, job.workload, shape, version, code.model_config, loaded.key if loaded else None)
    for key, value in {**unread, **code.ignored_args}.items():
        record(job, key, value, modelled=False)
    for key in code.arg_file_keys & job.not_modelled.keys() - KEYS.keys():
        # a key no TrainingArguments field has: the file may not be arguments at all, so its value stays unshown
        job.not_modelled[key] = "(value not shown)"
    file_env(job, ran, {**ENV, **(acc.env_read if acc else {})}, unknown=NO_EFFECT, unmodelled=UNMODELLED_ENV)
    config_rank_env(job, code, cmd)
    config_env_notes(job, code, shell, cmd)
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
