"""An ms-swift command line (`swift sft ...`), or the shell script holding it, with its environment:
NPROC_PER_NODE starts torchrun ranks, several CUDA_VISIBLE_DEVICES without it split one process over the GPUs
(device_map), ENABLE_AUDIO_OUTPUT decides whether an Omni model's talker is loaded. `--deepspeed` takes a JSON
path or ms-swift's built-in names (zero0 ... zero3_offload)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.accelerate import read_accelerate
from shardfit.foreign.common import (
    ATTENTION,
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
    local_file,
    optimizer,
    optimizer_keys,
    parse_json,
    read_text,
    record,
    trainer_fsdp1,
)
from shardfit.foreign.job import ForeignJob, ReferenceCopy, Words
from shardfit.foreign.kbit import swift_compute_fp32
from shardfit.foreign.keys import (
    NO_EFFECT,
    TF32,
    TORCH_COMPILE,
    Key,
    Source,
    command_source,
    default_epochs,
    epochs,
    file_env,
    file_keys,
    flag,
    key_table,
    positive,
    settings,
    text,
    use_deepspeed,
)
from shardfit.foreign.preference import Preference, apply, choice, refuse
from shardfit.foreign.shell import visible_devices
from shardfit.foreign.targets import plan_saved, plan_targets, saved_names
from shardfit.foreign.trainer_checks import check_swift_args
from shardfit.foreign.trainer_eval import EVAL_KEYS, swift_eval
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.shapes import local_config
from shardfit.plan.workload import Workload


def lora_targets(value: Any, key: str, where: str) -> str | list[str]:
    """`--target_modules`: all-linear, or module names separated by spaces."""
    return "all-linear" if value == "all-linear" else value.split()


# `swift rlhf` settings, carried over to shardfit's `dpo:` keys where it has one (`_preference`).
PREFERENCE_KEYS = {"beta", "loss_type", "label_smoothing", "rpo_alpha", "cpo_alpha", "simpo_gamma", "desirable_weight",
                   "undesirable_weight", "ref_model_type", "ref_model_revision", "ref_adapters", "ld_alpha",
                   "loss_weights", "discopop_tau"}
RLHF_TYPES = {k: k for k in ("dpo", "orpo", "simpo", "kto", "cpo", "rm", "ppo", "grpo", "gkd")}
REFUSED = {"rm": "reward-model training", "ppo": "PPO, with reward and value models and generation",
           "grpo": "GRPO, online with generation", "gkd": "GKD, distillation from a teacher model"}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")
# What each `swift sft` option means to shardfit.
KEYS = key_table({
    "torch_compile": TORCH_COMPILE,
    "tf32": TF32,
    "tuner_type": Key("{method}"), "train_type": Key("{method}"), "sft_type": Key("{method}"),
    "quant_bits": Key("4-bit NF4 frozen weights"),
    "torch_dtype": Key("{precision}"), "attn_impl": Key("attention {attention}"), "use_liger_kernel": Key("fused loss"),
    "max_length": Key("sequence length", field="seq_len", read=as_int, default=2048),
    "per_device_train_batch_size": Key("micro-batch", field="micro_batch", read=as_int, default=1),
    "gradient_checkpointing": Key("grad_ckpt {grad_ckpt}"),
    "gradient_checkpointing_kwargs": Key("reentrant or not"),
    "lora_rank": Key("adapter size", field="lora_rank", read=as_int, default=8),
    "gradient_accumulation_steps": Key("grad_accum", field="grad_accum", read=as_int, default=1),
    # Ulysses (ms-swift's sequence_parallel/ulysses.py): each of N ranks holds 1/N of every row's tokens
    "sequence_parallel_size": Key("sequence parallel", field="sequence_parallel", config="sequence_parallel",
                                  read=as_int),
    "deepspeed": Key("ZeRO settings"), "fsdp": Key("FSDP"), "device_map": Key("placement"),
    "ddp_find_unused_parameters": Key("DDP"),
    "bnb_4bit_quant_storage": Key("quantized storage"), "bnb_4bit_compute_dtype": Key("4-bit compute dtype"),
    "quant_method": Key("4-bit kernels ({quant_backend})"), "freeze_vit": Key("vision tower frozen"),
    "optim": Key("{optimizer}"),
    # carried over to the shardfit config (drop_modules is decided in `_convert`)
    "learning_rate": Key(config="lr", read=as_float), "warmup_ratio": Key(config="warmup_ratio", read=as_float),
    "weight_decay": Key(config="weight_decay", read=as_float),
    "max_grad_norm": Key(config="max_grad_norm", read=as_float),
    **EVAL_KEYS,
    "split_dataset_ratio": Key(config="eval_split", read=as_float), "max_steps": Key(config="max_steps", read=positive),
    "save_steps": Key(config="save_steps", read=as_int), "eval_steps": Key(config="eval_steps", read=as_int),
    "logging_steps": Key(config="log_steps", read=as_int), "seed": Key(config="seed", read=as_int),
    "num_train_epochs": Key(config="epochs", read=epochs, default=3.0),  # HF's: swift keeps it
    "lora_alpha": Key(config="lora.alpha", read=as_int, default=32),
    "lora_dropout": Key(config="lora.dropout", read=as_float),
    # ms-swift replaces --target_modules with --target_regex when both are given (TunerArguments; `_convert`)
    "target_regex": Key("adapters on the modules it names"),
    "target_modules": Key("adapters on every linear layer", config="lora.targets", read=lora_targets,
                          default="all-linear"),
    # the micro-batch's rows flattened into one without padding (flash attention's varlen): no more tokens than
    # the planned micro-batch x max_length, which is what the plan counts either way; unlike --packing (shardfit's
    # `packing`) it does not fill rows with more examples, so it is not carried over as packing
    # transformers' experts_implementation: grouped_mm (shardfit's own) or eager's loop over the experts hold what
    # the plan counts; batched_mm copies each token's expert weights (`_file_keys`)
    "experts_impl": Key("routed experts computed as planned"),
    "padding_free": Key("rows without padding: at most micro-batch x max_length tokens, as planned"),
    "packing": Key(config="packing", read=flag, default="false"), "output_dir": Key(config="output_dir", read=text),
    # `swift rlhf` (`_preference`): the objective, and the reference model a full fine-tune loads beside the policy
    "rlhf_type": Key("objective {objective}"), "ref_model": Key("reference model loaded beside the policy"),
}, no_effect=TRAINER_NO_EFFECT | PREFERENCE_KEYS | {
    "dataset", "val_dataset", "system", "model_author", "model_name", "streaming", "dataset_num_proc", "template",
    "model_type", "add_version", "columns", "save_only_model", "load_from_cache_file", "truncation_strategy",
    "loss_scale", "use_hf", "model", "model_id_or_path", "freeze_aligner", "freeze_llm",
    "enable_channel_loss", "check_model", "create_checkpoint_symlink", "max_new_tokens",
})
# The environment of the command: what it decides, and what changes nothing the planner counts; any other variable
# is not modelled.
ENV = {"NPROC_PER_NODE": "ranks", "CUDA_VISIBLE_DEVICES": "GPUs", "ENABLE_AUDIO_OUTPUT": "Omni talker",
       "NNODES": "nodes"} | {k: NO_EFFECT for k in (
        "MASTER_PORT", "MASTER_ADDR", "NODE_RANK", "MAX_PIXELS", "VIDEO_MAX_PIXELS", "FPS_MAX_FRAMES",
        "USE_AUDIO_IN_VIDEO", "SIZE_FACTOR", "PYTHONPATH", "OMP_NUM_THREADS", "NCCL_DEBUG", "HF_ENDPOINT", "USE_HF",
        "WANDB_PROJECT", "MODELSCOPE_CACHE", "HF_HOME", "TOKENIZERS_PARALLELISM")}
# ms-swift's entry scripts, run by a launcher as `swift sft` runs them (`accelerate launch swift/cli/sft.py ...`,
# `torchrun ... -m swift.cli.sft`), and the command each one is.
SCRIPTS = {"swift/cli/sft.py": "swift sft", "swift/cli/pt.py": "swift pt", "swift/cli/rlhf.py": "swift rlhf"}
METHODS = {"lora": "lora", "full": "full", "longlora": "lora", "adalora": "lora", "dora": "lora"}
PRECISIONS = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}


def words() -> Words:
    return Words(zero={k: f"--deepspeed {k}" for k in ("zero2", "zero3", "zero3_offload", "zero2_offload")},
                 keys={**eight_bit_words("--optim {}"), "fused_loss": "--use_liger_kernel true",
                       "grad_ckpt": "--gradient_checkpointing true", "micro_batch": "--per_device_train_batch_size 1 "
                       "with --gradient_accumulation_steps", "seq": "--max_length", "qlora": "--tuner_type lora "
                       "--quant_bits 4 --quant_method bnb", "lora": "--tuner_type lora",
                       "device_map": "NPROC_PER_NODE=1 (one process over CUDA_VISIBLE_DEVICES) or drop "
                       "--device_map under NPROC_PER_NODE", "model_parallel": "no NPROC_PER_NODE, "
                       "CUDA_VISIBLE_DEVICES listing every GPU (ms-swift splits the model with device_map)",
                       "talker": "ENABLE_AUDIO_OUTPUT=0",
                       "nodes": "NNODES={} with NODE_RANK, MASTER_ADDR and NPROC_PER_NODE on each node",
                       "ranks": "NPROC_PER_NODE with --deepspeed zero3",
                       "quant_storage": "--bnb_4bit_quant_storage bfloat16",
                       "reentrant": "--gradient_checkpointing_kwargs '{\"use_reentrant\": false}'"})


def read_swift(path: Path, shape_of: Any, version: str, nproc: int | None) -> ForeignJob:
    """The job of an ms-swift `swift sft` command line or script."""
    try:
        src, cmd = command_source(path, ("swift sft", "swift pt", "swift rlhf", *SCRIPTS))
    except UserError:
        _refuse_megatron(path)
        raise
    cmd.program = SCRIPTS.get(cmd.program, cmd.program)
    check_swift_args(src)
    model = src.get("model") or src.get("model_id_or_path") or (cmd.positional[0] if cmd.positional else None)
    if not model:
        raise UserError(f"{src.where}: the swift command has no --model; shardfit plans from it.")
    shape = shape_of(model)
    # `accelerate launch swift/cli/sft.py`: the ranks accelerate starts (its config file's, or one per visible GPU)
    acc = read_accelerate(cmd, path.parent, src.where) if cmd.launcher == "accelerate" else None
    ranks = nproc or (acc.nproc if acc is not None else cmd.nproc)
    job = ForeignJob("swift", src.where, model, Workload(), words=words(), nproc=ranks,
                     nnodes=acc.nnodes if acc is not None else cmd.nnodes,
                     launcher=(cmd.launcher or "torchrun") if acc is not None or cmd.nproc else None)
    if acc is not None:
        job.every_gpu = acc.every_gpu and ranks is None
        job.notes += acc.notes
    w = job.workload = _workload(src, job, version)
    w = job.workload = dataclasses.replace(w, **swift_eval(src, job.notes))
    job.reentrant_ckpt = w.grad_ckpt != "none" and "false" not in src.get("gradient_checkpointing_kwargs", "").lower()
    job.find_unused = src.flag("ddp_find_unused_parameters", "false")
    _engine(src, job, visible_devices(cmd.env), shape.hidden, version)
    audio = cmd.env.get("ENABLE_AUDIO_OUTPUT")
    job.speech_outputs = "omni" in model.lower() and (audio is None or as_bool(audio))
    job.quant_storage = src.get("bnb_4bit_quant_storage") is not None
    job.data = _datasets(src, job)
    job.convert = _convert(src, job)
    default_epochs(job, src, KEYS, "ms-swift")
    apply(job, _preference(src, cmd.program, job))
    _file_keys(src, job, job.workload, shape, version)
    file_env(job, cmd.exported, ENV, unknown=None)
    return job


def _refuse_megatron(path: Path) -> None:
    """A script whose trainer is ms-swift's `megatron sft|pt|rlhf` (Megatron-LM's tensor, pipeline and expert
    parallelism, not the HF Trainer this reader models): say so, and how to plan the same split, rather than that
    no command was found."""
    try:
        src, cmd = command_source(path, ("megatron sft", "megatron pt", "megatron rlhf"))
    except UserError:
        return
    # Megatron's context parallelism splits each row over ranks: planned as shardfit's (Ulysses) row split
    split = {"tensor_model_parallel_size": "", "pipeline_model_parallel_size": " --pipeline-parallel ",
             "expert_model_parallel_size": " --expert-parallel ", "context_parallel_size": " --sequence-parallel "}
    given = [f"--{k} {src.get(k)}" for k in split if k in src]
    flags = "".join(f"{flag}{src.get(k)}" for k, flag in split.items() if flag and k in src)
    model = src.get("model", "MODEL")
    method = "lora" if src.get("tuner_type", "full").startswith("lora") else "full"  # Megatron's default: full
    unplanned = any(k in src and src.get(k) != "1" for k, flag in split.items() if not flag)
    seq, batch = src.get("max_length", "2048"), src.get("micro_batch_size", "1")
    # the launch's ranks, on a card the script does not name (said in the message), so the command runs as printed
    gpus = f"{cmd.nproc or 1}xH100" + (f" --nodes {cmd.nnodes}" if cmd.nnodes > 1 else "")
    raise UserError(f"{src.where}: `{cmd.program}` is ms-swift's Megatron-LM trainer"
                    f"{' (' + ', '.join(given) + ')' if given else ''}, which --from swift does not read (it reads "
                    f"`swift sft|pt|rlhf`, the HF Trainer). Plan the split with `shardfit plan --model {model} --gpus "
                    f"{gpus} --method {method}{flags} --seq {seq} --batch {batch}` (H100: name your card)"
                    f"{'; tensor parallelism is not planned' if unplanned else ''}, or "
                    f"give the job's `swift sft` form.")


def _preference(src: Source, program: str, job: ForeignJob) -> Preference:
    """`swift rlhf --rlhf_type ...` (dpo when not given) in shardfit's objectives. ms-swift loads `--ref_model`
    (default: `--model`) beside the policy for DPO and KTO with `--tuner_type full` (RLHFArguments); LoRA switches
    its adapters off instead. Its `simpo` is TRL's CPO trainer with the SimPO loss: beta 2 and gamma 1 by default,
    and `cpo_alpha` (1 by default) times the chosen answer's NLL added."""
    if program != "swift rlhf":
        return Preference()
    kind = choice(src.get("rlhf_type", "dpo"), "--rlhf_type", src.where, RLHF_TYPES)
    if kind in REFUSED:
        raise refuse(src.where, "--rlhf_type", kind, REFUSED[kind])
    pref = Preference(objective="simpo" if kind == "cpo" else kind)
    pref.number("beta", src.get("beta", 2.0 if kind == "simpo" else 0.1), "--beta", src.where)
    if kind == "cpo":
        job.notes.append("--rlhf_type cpo planned as simpo: the same memory (pairs, no reference model)")
        pref.unconvertible = ("--rlhf_type cpo (CPO: a sigmoid loss on the summed log-probabilities plus an NLL term) "
                              "has no shardfit objective; use --rlhf_type simpo (objective simpo) or orpo")
    elif kind == "dpo":
        losses = src.get("loss_type", "sigmoid").split()
        if len(losses) == 1 and losses[0] in DPO_LOSSES:
            pref.dpo["loss"] = losses[0]
        else:
            pref.unconvertible = (f"--loss_type {' '.join(losses)}: shardfit's dpo losses are "
                                  f"{', '.join(DPO_LOSSES)} (one at a time)")
    if kind in ("dpo", "simpo"):
        pref.number("label_smoothing", src.get("label_smoothing"), "--label_smoothing", src.where)
    if kind == "simpo":
        pref.number("simpo_gamma", src.get("simpo_gamma", 1.0), "--simpo_gamma", src.where)
        if as_float(src.get("cpo_alpha", 1.0), "--cpo_alpha", src.where) > 0:
            pref.drop("--cpo_alpha", src.get("cpo_alpha", "1.0 (the default)"), "ms-swift's simpo adds cpo_alpha "
                      "times the chosen answer's NLL (CPO-SimPO); shardfit's simpo has none (--cpo_alpha 0 is plain "
                      "SimPO)")
    if kind == "kto":
        pref.number("desirable_weight", src.get("desirable_weight"), "--desirable_weight", src.where)
        pref.number("undesirable_weight", src.get("undesirable_weight"), "--undesirable_weight", src.where)
    rpo = src.get("rpo_alpha")
    if kind == "dpo" and rpo not in (None, "None", "none") and as_float(rpo, "--rpo_alpha", src.where) > 0:
        pref.drop("--rpo_alpha", rpo, "RPO's NLL term on the chosen answer added to DPO's loss; shardfit's dpo has "
                  "none")
    if kind in ("dpo", "kto"):
        ref = src.get("ref_model")
        pref.reference = ReferenceCopy(f"--tuner_type full with --rlhf_type {kind} loads "
                                       + (f"--ref_model {ref}" if ref else "the model a second time")
                                       + " as the reference", model=ref)
    return pref


def _method(src: Source, job: ForeignJob) -> str:
    """`--tuner_type` (ms-swift 4's name; `--train_type` and `--sft_type` before it), LoRA by default."""
    names = [k for k in ("tuner_type", "train_type", "sft_type") if k in src]
    key = names[0] if names else "tuner_type"
    train_type = src.get(key, "lora").lower()
    for other in names[1:]:  # old and new names that disagree: which one wins depends on ms-swift's version
        if src.get(other).lower() != train_type:
            raise UserError(f"{src.where}: --{key} {train_type} and --{other} {src.get(other)} both name the "
                            f"method; keep one (--tuner_type in ms-swift 4).")
    method = METHODS.get(train_type)
    if method is None:
        raise UserError(f"{src.where}: --{key} {train_type}: shardfit plans lora and full (and LoRA variants).")
    # a LoRA offer in the name the job gives: an ms-swift without that argument stops on it (remaining_argv)
    job.words.keys.update(lora=f"--{key} lora", qlora=f"--{key} lora --quant_bits 4 --quant_method bnb")
    bits = src.get("quant_bits")
    if bits is not None and method == "lora":
        method = "qlora"
        if as_int(bits, "quant_bits", src.where) != 4:
            job.notes.append(f"--quant_bits {bits} planned as 4-bit NF4 (an under-estimate of the frozen weights)")
    return method


def _precision(src: Source, job: ForeignJob) -> str:
    """The run's dtype: `--torch_dtype` (a UserError naming it for a value ms-swift's parser refuses), else, as
    ms-swift takes it, the model's config.json `torch_dtype` (float32 or none: bf16, as ms-swift picks on a GPU
    with bf16) where the model is a local folder or config.json, or a download in the local Hugging Face cache
    (plan/shapes.py `local_config`); the catalog records no dtype, so a catalog model never downloaded here is
    planned in bf16 under a note saying so."""
    given = src.get("torch_dtype")
    if given is not None:
        precision = PRECISIONS.get(str(given).strip().lower())
        if precision is None:
            raise UserError(f"{src.at('torch_dtype')}: --torch_dtype {given}: ms-swift takes bfloat16, float16 or "
                            f"float32; use one of those.")
        return precision
    raw = local_config(job.model)
    if raw is not None:
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "").lower()
        precision = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "bf16")
        job.notes.append(f"--torch_dtype not given: ms-swift takes the model's config.json torch_dtype "
                         f"({dtype or 'unset'}): planned in {precision}")
        return precision
    job.notes.append(f"--torch_dtype not given: ms-swift takes it from {job.model}'s config.json, which shardfit's "
                     f"catalog does not record: planned in bf16 (give --torch_dtype float16 in the job for an fp16 "
                     f"model such as Llama-2, or name the model by its local folder)")
    return "bf16"


def _workload(src: Source, job: ForeignJob, version: str) -> Workload:
    method = _method(src, job)
    precision = _precision(src, job)
    # ms-swift 2.x spelt flash-attention `--use_flash_attn true`; unset, transformers' default (read.py)
    attn = str(src.get("attn_impl", "flash_attn" if src.flag("use_flash_attn", "false") else "auto")).lower()
    job.attention_unset = attn == "auto"
    if attn not in ATTENTION:
        raise UserError(f"{src.where}: --attn_impl {attn}: choose flash_attn, sdpa or eager.")
    if "max_length" not in src:
        job.notes.append("--max_length not given: ms-swift then uses the model's context; planned at 2048 tokens "
                         "(pass --seq to plan another)")
    return Workload(method=method, precision=precision,
                    grad_ckpt="full" if src.flag("gradient_checkpointing", "true") else "none",
                    **optimizer_keys(src.get("optim"), version, job.notes, optim_args=src.get("optim_args"),
                                    weight_decay=src.get("weight_decay"), where=src.at("optim_args")),
                    loss=hf_loss(version, src.flag("use_liger_kernel", "false")), attention=ATTENTION[attn],
                    # --modules_to_save's copies stay as loaded, but fp16 trainables go to fp32 (swift's tuner
                    # prepare, after the adapters are made)
                    lora_saved_dtype="fp16_upcast", **_bnb(src, method, precision), **settings(src, KEYS, "field"))


def _bnb(src: Source, method: str, precision: str) -> dict[str, Any]:
    """bitsandbytes' 4-bit settings of a `--quant_method bnb` job: its kernels, and whether they compute in fp32
    (`--bnb_4bit_compute_dtype`, whose default follows `--torch_dtype` but is fp32 under float16 and float32:
    kbit.py `swift_compute_fp32`). Empty for another method, whose kernels shardfit plans as torchao's."""
    if method != "qlora" or str(src.get("quant_method", "")).strip().lower() != "bnb":
        return {}
    return {"quant_backend": "bnb", "bnb_compute_fp32": swift_compute_fp32(
        src.get("bnb_4bit_compute_dtype"), precision, src.at("bnb_4bit_compute_dtype"))}


def _engine(src: Source, job: ForeignJob, gpus: list[str], hidden: int, version: str) -> None:
    """DeepSpeed, DDP under a launcher, or one process split over the visible GPUs (device_map)."""
    if src.get("deepspeed") and src.get("fsdp"):
        raise UserError(f"{src.where}: --deepspeed {src.get('deepspeed')} and --fsdp {src.get('fsdp')} both choose "
                        f"the sharding; the HF Trainer runs one of them: keep one.")
    if src.get("deepspeed"):
        use_deepspeed(job, src.get("deepspeed"), src.path.parent, f"{src.where}: --deepspeed", hidden, [])
    elif src.get("fsdp"):
        _fsdp(src, job, version)
    elif job.distributed:
        job.engine = "ddp"
    elif len(gpus) > 1 or src.get("device_map"):
        job.engine = "device_map"
        job.gpus = len(gpus) or None
    if src.get("device_map"):
        job.device_map = src.get("device_map")
    elif job.engine == "device_map":
        job.device_map = "auto"


# ms-swift's built-in `--fsdp fsdp2` (swift/config/fsdp2.json): FSDP2, full_shard, resharded after forward, FSDP's
# own activation checkpointing on.
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                                                         "activation_checkpointing": True}}


def _fsdp(src: Source, job: ForeignJob, version: str) -> None:
    """`--fsdp fsdp2` or an FSDP JSON (ms-swift >= 3.12): its `fsdp` options and `fsdp_config` decide the engine
    (offload, ZeRO-2-like SHARD_GRAD_OP or full_shard), and `activation_checkpointing` there checkpoints the blocks
    even with `--gradient_checkpointing false`, as ms-swift's examples write it."""
    ref = src.get("fsdp")
    if ref == "fsdp2":
        raw: Any = FSDP2
    else:
        hit = local_file(ref, src.path.parent)
        if hit is None:
            raise UserError(f"{src.where}: --fsdp {ref}: not fsdp2 and no such JSON file here; give the FSDP JSON's "
                            f"path (relative to the script) or --fsdp fsdp2.")
        raw = parse_json(read_text(Path(hit)), hit)
    if not isinstance(raw, dict):
        raise UserError(f"{src.where}: --fsdp {ref}: an FSDP JSON holds one object with `fsdp` and `fsdp_config`.")
    options = str(raw.get("fsdp", "full_shard auto_wrap")).split()
    cfg = fsdp_settings(raw.get("fsdp_config"), f"{src.where}: --fsdp {ref}")
    offload = "offload" in options or as_bool(cfg.get("offload_params", False))
    sharding = "shard_grad_op" if "shard_grad_op" in options else fsdp_sharding(cfg, f"{src.where}: --fsdp {ref}")
    job.engine = fsdp_engine(sharding, offload, job.distributed)
    fsdp1 = trainer_fsdp1(cfg, version, f"{src.where}: --fsdp {ref}", job.notes)  # ms-swift runs the HF Trainer
    flat = flat_params_of(cfg, fsdp1, f"{src.where}: --fsdp {ref}", job.notes)
    job.workload = dataclasses.replace(job.workload, fsdp1=fsdp1, flat_params=flat)
    if as_bool(cfg.get("activation_cpu_offload", False)):  # activations moved to host memory: not planned
        record(job, "fsdp:activation_cpu_offload", cfg["activation_cpu_offload"], modelled=False)
    if as_bool(cfg.get("activation_checkpointing", False)) and job.workload.grad_ckpt == "none":
        job.workload = dataclasses.replace(job.workload, grad_ckpt="full")
        job.reentrant_ckpt = False  # accelerate wraps the blocks with the non-reentrant checkpoint
        job.notes.append(f"--fsdp {ref}: activation_checkpointing in its fsdp_config checkpoints every block "
                         f"(planned as grad_ckpt full)")


def _file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str) -> None:
    unplanned = {"optim"} if optimizer(src.get("optim", "adamw_torch")) is None else set()
    effects = {}
    if src.get("target_regex"):
        effect = plan_targets(job, "--target_regex", str(src.get("target_regex")), shape, version)
        if effect:
            effects["target_regex"] = effect
        else:
            unplanned.add("target_regex")
        if "target_modules" in src:
            effects["target_modules"] = "overridden by --target_regex (ms-swift trains the regex's modules)"
    elif "target_modules" in src and src.get("target_modules") != "all-linear":
        effect = plan_targets(job, "--target_modules", lora_targets(src.get("target_modules"), "target_modules",
                                                                    src.where), shape, version)
        if effect:
            effects["target_modules"] = effect
        else:
            unplanned.add("target_modules")
    if saved_names(src.get("modules_to_save")) and job.workload.trains_adapters:
        effect = plan_saved(job, "--modules_to_save", saved_names(src.get("modules_to_save")))
        effects["modules_to_save"] = effect
        if not effect:
            unplanned.add("modules_to_save")
    if src.get("experts_impl", "").lower() == "batched_mm":
        unplanned.add("experts_impl")
        job.notes.append("--experts_impl batched_mm copies each token's expert weights for its matmuls (gigabytes "
                         "at long sequences); not planned: shardfit plans grouped_mm (an under-estimate)")
    if "freeze_vit" in src and not src.flag("freeze_vit") and w.method == "full":
        unplanned.add("freeze_vit")
    file_keys(job, src.items(), KEYS, w, effects=effects, unplanned=unplanned)


def _datasets(src: Source, job: ForeignJob) -> list[str]:
    data = [d for d in src.get("dataset", "").split() if d]
    missing = [d for d in data if not local_file(d.split("#")[0], src.path.parent)]
    if missing:
        job.notes.append(f"datasets not found as local files (hub ids; convert leaves them out): {', '.join(missing)}")
    return [hit for d in data if (hit := local_file(d.split("#")[0], src.path.parent))]


def _convert(src: Source, job: ForeignJob) -> dict[str, Any]:
    out = settings(src, KEYS, "config")
    if src.get("target_regex"):  # one regular expression over module names, as peft (and shardfit) read a string
        out.setdefault("lora", {})["targets"] = str(src.get("target_regex"))
    if job.speech_outputs or "omni" in job.model.lower():
        out["drop_modules"] = ["talker", "token2wav"]
    return out
