"""A LLaMA-Factory training YAML (`llamafactory-cli train my.yaml`), read with LLaMA-Factory's defaults and memory
behaviour: gradient checkpointing on unless disabled, trainable weights upcast to fp32 unless `pure_bf16`, the
model's own loss (Liger's fused one with `use_liger_kernel`), data from `dataset_dir/dataset_info.json`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardfit import method as methods
from shardfit.errors import UserError
from shardfit.foreign.common import (
    ATTENTION,
    TRAINER_NO_EFFECT,
    as_float,
    as_int,
    eight_bit_words,
    hf_loss,
    lf_freeze_blocks,
    local_file,
    optimizer,
    optimizer_keys,
)
from shardfit.foreign.job import ForeignJob, ReferenceCopy, Words
from shardfit.foreign.keys import (
    HF_TRAINER,
    TF32,
    TORCH_COMPILE,
    TRUST_REMOTE_CODE,
    Key,
    Source,
    count,
    default_epochs,
    file_keys,
    flag,
    key_table,
    settings,
    use_deepspeed,
    yaml_source,
)
from shardfit.foreign.lf_columns import data_columns
from shardfit.foreign.preference import Preference, apply, choice, refuse
from shardfit.foreign.targets import plan_saved, plan_targets, saved_names
from shardfit.foreign.trainer_checks import check_trainer_args
from shardfit.foreign.trainer_eval import EVAL_KEYS, held_out_eval
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload


def lora_targets(value: Any, key: str, where: str) -> str | list[str]:
    """`lora_target`: `all`, or module names separated by commas, or a YAML list of them (LLaMA-Factory's
    split_arg takes either)."""
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        names = [t.strip() for t in value]
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        names = [t.strip() for t in str(value).split(",")]
    else:
        raise UserError(f"{where}: '{key}' is {value!r}; LLaMA-Factory takes all, or module names separated by "
                        f"commas (q_proj,v_proj) or as a list.")
    return "all-linear" if names == ["all"] else names


# Preference settings, carried over to shardfit's `dpo:` keys where it has one (`_preference`).
PREFERENCE_KEYS = {"pref_beta", "pref_loss", "pref_ftx", "pref_bco_weight", "simpo_gamma", "dpo_label_smoothing",
                   "kto_chosen_weight", "kto_rejected_weight", "ld_alpha", "ref_model_adapters"}
# LLaMA-Factory's stages: what shardfit trains, and what it cannot (`refuse`).
STAGES = {"sft": "sft", "pt": "sft", "dpo": "dpo", "kto": "kto", "rm": "rm", "ppo": "ppo"}
REFUSED = {"rm": "reward-model training", "ppo": "PPO, with a reward model and generation"}
PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "kto_pair": "kto_pair", "orpo": "orpo",
               "simpo": "simpo"}
# What each LLaMA-Factory key means to shardfit.
KEYS = key_table({
    "torch_compile": TORCH_COMPILE,
    "tf32": TF32,
    "finetuning_type": Key("{method}"), "quantization_bit": Key("4-bit NF4 frozen weights"),
    "pure_bf16": Key("16-bit adapters"), "bf16": Key("{precision}"), "fp16": Key("{precision}"),
    "cutoff_len": Key("sequence length", field="seq_len", read=count, default=2048),
    "per_device_train_batch_size": Key("micro-batch", field="micro_batch", read=count, default=1),
    "lora_rank": Key("adapter size", field="lora_rank", read=as_int, default=8),
    "gradient_accumulation_steps": Key("grad_accum", field="grad_accum", read=as_int, default=1),
    "disable_gradient_checkpointing": Key("grad_ckpt {grad_ckpt}"),
    "use_liger_kernel": Key("fused linear cross-entropy: no full logits"), "flash_attn": Key("attention {attention}"),
    "optim": Key("{optimizer}"), "deepspeed": Key("ZeRO settings"), "use_reentrant_gc": Key("reentrant checkpointing"),
    "ddp_find_unused_parameters": Key("DDP"), "freeze_vision_tower": Key("vision tower frozen"),
    "freeze_trainable_layers": Key("trainable blocks"), "quantization_method": Key("bitsandbytes"),
    "double_quantization": Key("NF4 constants"),
    # carried over to the shardfit config (`freeze_trainable` is decided in `_convert`): v0 runs the HF Trainer
    **HF_TRAINER, **EVAL_KEYS, "val_size": Key(config="eval_split", read=as_float),
    # LLaMA-Factory's default alpha is twice the rank (given in `_convert`)
    "lora_alpha": Key(config="lora.alpha", read=as_int), "lora_dropout": Key(config="lora.dropout", read=as_float),
    "lora_target": Key("adapters on every linear layer (all)", config="lora.targets", read=lora_targets,
                       default="all"),
    "packing": Key(config="packing", read=flag, default=False), "trust_remote_code": TRUST_REMOTE_CODE,
    # preference training (`_preference`): the stage decides the objective, a reference copy changes memory
    "stage": Key("objective {objective}"), "ref_model": Key("reference model loaded beside the policy"),
    "ref_model_quantization_bit": Key("reference model stored quantized"),
}, no_effect=TRAINER_NO_EFFECT | PREFERENCE_KEYS | {
    "template", "max_samples", "overwrite_cache", "preprocessing_num_workers", "eval_dataset",
    "loraplus_lr_ratio", "create_new_adapter", "mix_strategy", "streaming", "buffer_size",
    "tokenized_path", "default_system", "enable_thinking", "train_on_prompt", "mask_history", "finetuning_args",
    "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen",
    "export_dir", "export_size", "infer_backend", "adapter_name_or_path", "new_special_tokens",
    "use_fast_tokenizer", "split_special_tokens", "print_param_status", "freeze_multi_modal_projector", "cache_dir",
    "hf_hub_token", "ms_hub_token", "use_unsloth_gc", "dataset", "dataset_dir", "neat_packing",
    "model_name_or_path",
})
METHODS = {"lora": "lora", "full": "full", "freeze": "freeze", "oft": "lora"}
# LLaMA-Factory's shipped DeepSpeed configs and how they are named.
ZERO_FILES = {"zero2": "examples/deepspeed/ds_z2_config.json", "zero3": "examples/deepspeed/ds_z3_config.json",
              "zero3_offload": "examples/deepspeed/ds_z3_offload_config.json",
              "zero2_offload": "examples/deepspeed/ds_z2_offload_config.json"}


def words() -> Words:
    return Words(zero={k: f"deepspeed: {v}" for k, v in ZERO_FILES.items()},
                 keys={**eight_bit_words("optim: {}"), "fused_loss": "use_liger_kernel: true",
                       "grad_ckpt": "disable_gradient_checkpointing: false (remove the key)",
                       "micro_batch": "per_device_train_batch_size: 1 with gradient_accumulation_steps",
                       "seq": "cutoff_len: {}",
                       # LLaMA-Factory quantizes only under LoRA or OFT (its parser refuses it otherwise)
                       "qlora": "finetuning_type: lora with quantization_bit: 4", "lora": "finetuning_type: lora",
                       "device_map": "(LLaMA-Factory places the model itself; do "
                       "not pass device_map under torchrun)", "launch": "FORCE_TORCHRUN=1 llamafactory-cli train",
                       "nodes": "NNODES={} with NODE_RANK, MASTER_ADDR and MASTER_PORT on each node "
                       "(FORCE_TORCHRUN=1 llamafactory-cli train)",
                       "reentrant": "use_reentrant_gc: false"})


def read_llamafactory(path: Path, version: str, nproc: int | None, shape_of: Any,
                      parsed: tuple[dict[str, Any], dict[str, int]] | None = None) -> ForeignJob:
    """The job of a LLaMA-Factory YAML (`parsed`: its mapping and lines, when read already). `shape_of(model)`
    resolves the model's shape (for DeepSpeed's "auto" buckets and freeze layers); `nproc` the ranks it is launched
    with (LLaMA-Factory starts torchrun itself when several GPUs are visible)."""
    src = yaml_source(path, parsed)
    model = src.get("model_name_or_path")
    if not model:
        raise UserError(f"{src.where}: no 'model_name_or_path'; LLaMA-Factory needs it, and shardfit plans from it.")
    check_trainer_args(src, "LLaMA-Factory (its TrainingArguments are the HF Trainer's)", "")
    shape = shape_of(str(model))
    job = ForeignJob("llamafactory", src.where, str(model), Workload(), words=words(), nproc=nproc)
    w = job.workload = _own_kernel(src, job, _freeze(src, _workload(src, job, version), shape.layers), shape)
    w = job.workload = replace(w, **held_out_eval(src, share="val_size", data="eval_dataset", strategy_default=False,
                                                  batch_key="per_device_eval_batch_size", default_batch=8))
    job.reentrant_ckpt = w.grad_ckpt != "none" and src.flag("use_reentrant_gc", True)
    job.find_unused = src.flag("ddp_find_unused_parameters")
    if src.get("deepspeed"):
        use_deepspeed(job, str(src.get("deepspeed")), path.parent, src.at("deepspeed"), shape.hidden, job.notes)
    elif nproc and nproc > 1:
        job.engine = "ddp"
    job.quant_storage = w.method == "qlora" and job.engine == "deepspeed"  # LLaMA-Factory sets it under ZeRO-3
    job.speech_outputs = False  # LLaMA-Factory loads Qwen2.5-Omni's thinker only
    job.data, missing, columns = _datasets(src, job.notes)
    job.data_missing = missing
    if missing:
        job.notes.append(f"datasets not found as local files (convert leaves them out): {', '.join(missing)}")
    job.convert = _convert(src, w, shape)
    default_epochs(job, src, KEYS, "LLaMA-Factory (the HF Trainer)")
    if columns:
        job.convert["data_columns"] = columns
    apply(job, _preference(src, str(model)))
    _file_keys(src, job, job.workload, shape, version)
    return job


def _preference(src: Source, model: str) -> Preference:
    """The objective of `stage` (dpo with `pref_loss`, kto) and its settings in shardfit's keys. LLaMA-Factory
    loads the model a second time as the DPO/KTO reference unless LoRA trains (trainer_utils.create_ref_model), and
    always when `ref_model` names one; ORPO and SimPO use none."""
    stage = choice(src.get("stage", "sft"), "stage", src.at("stage"), STAGES)
    if stage in REFUSED:
        raise refuse(src.at("stage"), "stage", stage, REFUSED[stage])
    pref = Preference(objective=stage)
    if stage == "sft":
        return pref
    pref.number("beta", src.get("pref_beta", 0.1), "pref_beta", src.at("pref_beta"))
    if stage == "kto":
        pref.number("desirable_weight", src.get("kto_chosen_weight"), "kto_chosen_weight", src.at("kto_chosen_weight"))
        pref.number("undesirable_weight", src.get("kto_rejected_weight"), "kto_rejected_weight",
                    src.at("kto_rejected_weight"))
    else:
        loss = choice(src.get("pref_loss", "sigmoid"), "pref_loss", src.at("pref_loss"), PREF_LOSSES)
        pref.objective = loss if loss in ("orpo", "simpo") else "dpo"
        if loss == "kto_pair":
            pref.unconvertible = ("pref_loss: kto_pair (KTO's loss on pairs) has no shardfit objective; use pref_loss: "
                                  "sigmoid (objective dpo), or stage: kto with unpaired rows (objective kto)")
        elif pref.objective == "dpo":
            pref.dpo["loss"] = loss
        smoothing, gamma = src.get("dpo_label_smoothing"), src.get("simpo_gamma")
        if pref.objective == "dpo":
            pref.number("label_smoothing", smoothing, "dpo_label_smoothing", src.at("dpo_label_smoothing"))
        if pref.objective == "simpo":
            pref.number("simpo_gamma", gamma, "simpo_gamma", src.at("simpo_gamma"))
    _dropped(src, pref)
    if pref.objective in ("dpo", "kto"):
        pref.reference = _reference(src, model)
    return pref


def _dropped(src: Source, pref: Preference) -> None:
    """LLaMA-Factory's additions to the preference loss that shardfit's objectives do not have."""
    if as_float(src.get("pref_ftx", 0), "pref_ftx", src.at("pref_ftx")) > 0:
        pref.drop("pref_ftx", src.get("pref_ftx"), "an SFT term on the chosen answer added to the preference loss; "
                  "shardfit's dpo/kto have none (objective orpo has one built in)")
    if as_float(src.get("pref_bco_weight", 0), "pref_bco_weight", src.at("pref_bco_weight")) > 0:
        pref.drop("pref_bco_weight", src.get("pref_bco_weight"), "BCO's loss mixed into DPO's")
    if src.get("ld_alpha") is not None:
        pref.drop("ld_alpha", src.get("ld_alpha"), "LD-DPO's down-weighting of the longer answer's tokens")


def _reference(src: Source, model: str) -> ReferenceCopy:
    ref = src.get("ref_model")
    ft = str(src.get("finetuning_type", "lora")).lower()
    bits = src.get("ref_model_quantization_bit")
    why = f"ref_model: {ref} is loaded beside the policy" if ref else \
        f"finetuning_type: {ft} loads the model a second time as the reference"
    return ReferenceCopy(why, with_adapters=ref is not None or ft == "oft",
                         bits=None if bits is None else as_int(bits, "ref_model_quantization_bit",
                                                                src.at("ref_model_quantization_bit")),
                         model=str(ref) if ref else None)


def _method(src: Source, job: ForeignJob) -> str:
    ft = str(src.get("finetuning_type", "lora")).lower()
    method = METHODS.get(ft)
    if method is None:
        raise UserError(f"{src.at('finetuning_type')}: 'finetuning_type' is {ft!r}; LLaMA-Factory's are lora, full, "
                        f"freeze (and oft).")
    if src.get("quantization_bit") is not None:
        bits = as_int(src.get("quantization_bit"), "quantization_bit", src.at("quantization_bit"))
        if method == "lora":
            method = "qlora"
        if bits != 4:
            job.notes.append(f"quantization_bit: {bits} is planned as 4-bit NF4 (the planner models 4-bit only): "
                             "an under-estimate of the frozen weights")
    return method


def _workload(src: Source, job: ForeignJob, version: str) -> Workload:
    method = _method(src, job)
    pure = src.flag("pure_bf16")
    precision = "bf16" if src.flag("bf16") or pure else "fp16" if src.flag("fp16") else "fp32"
    given = src.get("flash_attn", "auto")
    # LLaMA-Factory 0.5 took a boolean (true: flash-attention 2, false: eager); 0.6-0.8's `off` reads as false too
    attn = ("fa2" if given else "disabled") if isinstance(given, bool) else str(given).lower()
    if attn not in ATTENTION:
        raise UserError(f"{src.at('flash_attn')}: 'flash_attn' is {attn!r}; LLaMA-Factory's are auto, disabled, sdpa, "
                        f"fa2.")
    job.attention_unset = attn == "auto"  # left to transformers: read.py decides it by version and model
    return Workload(method=method, precision=precision,
                    grad_ckpt="none" if src.flag("disable_gradient_checkpointing") else "full",
                    **optimizer_keys(src.get("optim"), version, job.notes, optim_args=src.get("optim_args"),
                                    weight_decay=src.get("weight_decay", 0.0), where=src.at("optim_args")),
                    loss=hf_loss(version, src.flag("use_liger_kernel")), attention=ATTENTION[attn],
                    frozen_fp32=False, adapters_16bit=pure and methods.get(method).adapters, quant_backend="bnb",
                    # init_adapter casts every trainable weight to fp32 after get_peft_model unless pure_bf16:
                    # additional_target's copies too, as the adapters
                    lora_saved_dtype="trainable",
                    **settings(src, KEYS, "field"))


def _own_kernel(src: Source, job: ForeignJob, w: Workload, shape: ModelShape) -> Workload:
    """The attention LLaMA-Factory picks itself for a model type (model_utils/attention.py
    `configure_attn_implementation`), over `flash_attn`: from 0.9.4 (#9354) gpt-oss loads the
    kernels-community/vllm-flash-attn3 kernel before `flash_attn` is read, so any value runs flash attention.
    Gemma 2 under `auto` runs flash-attention 2 where flash-attn is installed and eager where not; the plan keeps
    transformers' default and says so."""
    attn = str(src.get("flash_attn", "auto")).lower()
    if shape.model_type == "gpt_oss":
        job.attention_unset = False
        job.notes.append(f"{src.at('flash_attn')}: LLaMA-Factory 0.9.4 and later load gpt-oss with the "
                         "kernels-community/vllm-flash-attn3 kernel whatever flash_attn says: planned with flash "
                         "attention (an older checkout follows flash_attn)")
        return replace(w, attention="flash")
    if (shape.text_model_type or shape.model_type) == "gemma2" and attn == "auto":
        job.notes.append(f"{src.at('flash_attn')}: LLaMA-Factory runs Gemma 2 with flash-attention 2 where flash-attn "
                         "is installed and eager attention where not (never SDPA): planned as transformers "
                         "attends; --attention flash or eager plans the one that runs")
    return w


def _saved(src: Source, job: ForeignJob, effects: dict[str, str], unplanned: set[str]) -> None:
    """additional_target, or without it resize_vocab's embedding and head: LLaMA-Factory passes them to peft as
    modules_to_save (model/adapter.py, LLaMA-Factory 0.9.5), each trained whole beside the adapters."""
    names = saved_names(src.get("additional_target"))
    key = "additional_target" if names else "resize_vocab"
    if "resize_vocab" in src:
        effects["resize_vocab"] = ("off" if not src.flag("resize_vocab") else
                                   "additional_target says what trains whole" if names else "")
    if not names and src.flag("resize_vocab"):
        names = ["embed_tokens", "lm_head"]
    if not names:
        return
    if not job.workload.trains_adapters:
        effects[key] = "no effect on memory: every weight trains already"
        return
    effect = plan_saved(job, key, names)
    if effect:
        effects[key] = effect
    else:
        unplanned.add(key)


def _file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str) -> None:
    unplanned = {"optim"} if optimizer(str(src.get("optim", "adamw_torch"))) is None else set()
    effects = {}
    targets = lora_targets(src.get("lora_target", "all"), "lora_target", src.at("lora_target"))
    if targets != "all-linear":
        effect = plan_targets(job, "lora_target", targets, shape, version)
        if effect:
            effects["lora_target"] = effect
        else:
            unplanned.add("lora_target")
    _saved(src, job, effects, unplanned)
    if "freeze_vision_tower" in src:
        if w.method != "full":
            effects["freeze_vision_tower"] = "frozen either way"
        elif not src.flag("freeze_vision_tower"):
            unplanned.add("freeze_vision_tower")
    file_keys(job, src.items(), KEYS, w, effects=effects, unplanned=unplanned)


def _datasets(src: Source, notes: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """Local files of `dataset`, through dataset_info.json in `dataset_dir` (LLaMA-Factory's registry), and the
    data_columns their `columns` come to (what cannot be carried goes to `notes`)."""
    names = [n.strip() for n in str(src.get("dataset", "")).split(",") if n.strip()]
    base = Path(str(src.get("dataset_dir", "data")))
    folders = [src.path.parent / base, base]
    info: dict[str, Any] = {}
    for folder in folders:
        f = folder / "dataset_info.json"
        if f.is_file():
            try:
                info = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{f}:{e.lineno}: not valid JSON: {e.msg}.") from None
            folders = [folder]
            break
    found: list[str] = []
    missing: list[str] = []
    maps: dict[str, dict[str, str]] = {}
    for name in names:
        entry = info.get(name, {})
        file_name = entry.get("file_name") if isinstance(entry, dict) else None
        hit = local_file(file_name, *folders) if file_name else None
        if hit is None:
            hit = local_file(name, *folders) or next(
                (h for ext in (".json", ".jsonl") if (h := local_file(name + ext, *folders))), None)
        (found if hit else missing).append(hit or name)
        if hit and isinstance(entry, dict):
            maps[name] = data_columns(entry, name, notes)
    distinct = {tuple(sorted(m.items())) for m in maps.values()}
    if len(distinct) > 1:  # one data_columns for every file
        notes.append(f"datasets {', '.join(maps)} name their columns differently; data_columns carries the first's")
    return found, missing, next(iter(maps.values()), {})


def _convert(src: Source, w: Workload, shape: ModelShape) -> dict[str, Any]:
    """shardfit config keys of the same job (beyond the workload and the strategy)."""
    out = settings(src, KEYS, "config", **{"lora.alpha": 2 * w.lora_rank})
    out["packing"] = out["packing"] or src.flag("neat_packing")
    if w.method == "freeze":
        out["freeze_trainable"] = [f"layers.{i}" for i in w.trained_blocks(shape.layers)]
    return out


def _freeze(src: Source, w: Workload, layers: int) -> Workload:
    """Under `freeze`, the blocks `freeze_trainable_layers` trains (default the last 2), which the plan counts."""
    if w.method != "freeze":
        return w
    n = as_int(src.get("freeze_trainable_layers", 2), "freeze_trainable_layers", src.at("freeze_trainable_layers"))
    return replace(w, freeze_blocks=tuple(lf_freeze_blocks(n, layers)))
