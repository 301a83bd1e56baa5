"""LLaMA-Factory's v1 configs (`USE_V1=1 llamafactory-cli sft my.yaml`, src/llamafactory/v1): `model:` names the
checkpoint, and the method, sharding, quantization, kernels and optimizer are plugin mappings with a `name`
(`peft_config`, `dist_config`, `quant_config`, `kernel_config`, `optim_config`). Read with v1's own behaviour: a
fully trained model cast to fp32 with bf16 only as FSDP2's compute dtype, non-reentrant checkpointing on unless
disabled, torch's AdamW, and its own loss over the fp32 logits. foreign/read.py tells a v1 YAML from a v0 or
Megatron one (`is_v1`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardfit.config.load import read_yaml
from shardfit.errors import UserError
from shardfit.foreign.common import ATTENTION, as_float, as_int, lf_freeze_blocks, local_file
from shardfit.foreign.deepspeed import DeepSpeedJob
from shardfit.foreign.job import ForeignJob, ReferenceCopy, Words
from shardfit.foreign.keys import (
    NO_EFFECT,
    TRUST_REMOTE_CODE,
    Key,
    Source,
    count,
    default_epochs,
    epochs,
    file_keys,
    hf_trainer,
    if_truthy,
    key_table,
    settings,
    use_deepspeed,
)
from shardfit.foreign.preference import Preference, apply, choice
from shardfit.foreign.targets import plan_targets
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload

# Keys only v1 has at the top level (v0 names the model `model_name_or_path`).
V1_ONLY = {"model", "micro_batch_size", "global_batch_size", "train_dataset", "enable_activation_checkpointing",
           "model_class", "batching_strategy", "cp_size", "cp_mode", "dp_size", "mp_shard_size", "mp_replicate_size"}
PLUGINS = {"dist_config": "fsdp2", "peft_config": "lora", "quant_config": "bnb", "kernel_config": "auto",
           "optim_config": "muon", "lr_scheduler_config": "cosine", "init_config": "init_on_meta"}
DIST = ("fsdp2", "fsdpturbo", "deepspeed")
V1_ATTENTION = ("eager", "sdpa", "flash_attention_2")
BATCHING = ("normal", "padding_free", "dynamic_batching", "dynamic_padding_free")
METHODS = {"lora": "lora", "freeze": "freeze"}
PREF_LOSSES = {"sigmoid": "dpo", "orpo": "orpo", "simpo": "simpo"}
QUANT = ("bnb", "auto")  # bnb defaults to 4 bits; auto quantizes only when quantization_bit is given


def lora_targets(value: Any, key: str, where: str) -> str | list[str]:
    """`target_modules` (`key`, at `where`): `all`, one module name (v1 hands a string to peft as a one-name list,
    so it is no regular expression), or a list of names; anything else peft cannot match is a UserError."""
    if value == "all":
        return "all-linear"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: {key} is {value!r}; v1 takes `all` or module names, one or a YAML list of them: "
                        f"`{key.rsplit('.', 1)[-1]}: [q_proj, v_proj]`.")
    return value


# What each v1 key means to shardfit; a plugin's keys are named `plugin.key`.
KEYS = key_table({
    "peft_config.name": Key("{method}"), "quant_config.quantization_bit": Key("4-bit NF4 frozen weights"),
    "quant_config.name": Key("bitsandbytes"), "bf16": Key("{precision}"),
    "cutoff_len": Key("sequence length", field="seq_len", read=count, default=2048),
    "micro_batch_size": Key("micro-batch", field="micro_batch", read=count, default=1),
    "global_batch_size": Key("grad_accum {grad_accum}"), "dp_size": Key("grad_accum {grad_accum}"),
    "peft_config.r": Key("adapter size", field="lora_rank", read=count, default=8),
    "peft_config.lora_dropout": Key("adapter dropout {lora_dropout}", field="lora_dropout", config="lora.dropout",
                                    read=as_float, default=0.05),
    "peft_config.lora_alpha": Key(config="lora.alpha", read=as_int, default=16),
    "peft_config.target_modules": Key("adapters on every linear layer (all)", config="lora.targets",
                                      read=lora_targets, default="all"),
    "peft_config.freeze_trainable_layers": Key("trainable blocks"),
    "enable_activation_checkpointing": Key("grad_ckpt {grad_ckpt}"), "flash_attn": Key("attention {attention}"),
    "cp_size": Key("sequence parallel", field="sequence_parallel", config="sequence_parallel", read=count),
    "cp_mode": Key("Ulysses"),
    "dist_config.name": Key("sharding"), "dist_config.config_file": Key("ZeRO settings"),
    "dist_config.offload_params": Key("sharding"), "dist_config.reshard_after_forward": Key("sharding"),
    "dist_config.ep_size": Key("expert parallel", field="expert_parallel", config="expert_parallel", read=as_int),
    "batching_strategy": Key("rows of one example each"), "model_class": Key("causal LM head"),
    "kernel_config.name": Key("no kernels on CUDA (auto picks Ascend NPU kernels only)"),
    # carried over to the shardfit config: v1's own TrainingArguments keep the HF Trainer's names and meaning for
    # these (its step counts are steps, its epochs scale the steps), and leave warmup and weight decay to its
    # optimizer and scheduler plugins and evaluation out; HfArgumentParser refuses those names at the top level
    **hf_trainer("eval_steps", "warmup_ratio", "weight_decay"), "trust_remote_code": TRUST_REMOTE_CODE,
    # v1's own TrainingArguments (v1/config/training_args.py, LLaMA-Factory 0.9.5): num_train_epochs defaults to 3,
    # which its trainer multiplies by the batches of an epoch unless max_steps is above 0
    "num_train_epochs": Key(config="epochs", read=if_truthy(epochs), default=3),
}, no_effect={
    "model", "train_dataset", "eval_dataset", "custom_chat_template", "sample_backend", "max_new_tokens",
    "batching_workers", "dist_timeout", "resume_from_checkpoint", "save_epochs", "save_ckpt_as_hf",
    "save_total_limit", "full_determinism", "dist_config.dcp_path", "dist_config.pin_memory",
    "dist_config.ep_dispatcher", "init_config.name", "quant_config.compute_dtype", "quant_config.quantization_type",
    "quant_config.double_quantization", "lr_scheduler_config.name", "kernel_config", "quant_config",
    "init_config", "lr_scheduler_config", "mp_replicate_size"})


def words() -> Words:
    """How v1 spells the planner's suggestions."""
    ds = "dist_config: {name: deepspeed, config_file: examples/deepspeed/"
    return Words(zero={"zero2": ds + "ds_z2_config.json}", "zero3": "dist_config: {name: fsdp2}",
                       "zero3_offload": "dist_config: {name: fsdp2, offload_params: true}"},
                 keys={"grad_ckpt": "enable_activation_checkpointing: true (remove the key)",
                       "micro_batch": "micro_batch_size: 1, global_batch_size as it is ({} micro-batches a rank each "
                       "step)", "seq": "cutoff_len: {}",
                       "qlora": "peft_config: {name: lora} with quant_config: {name: bnb, quantization_bit: 4}",
                       "lora": "peft_config: {name: lora}",
                       "launch": "USE_V1=1 FORCE_TORCHRUN=1 llamafactory-cli sft"})


def is_v1(top: dict[str, Any]) -> bool:
    """Whether a LLaMA-Factory YAML's top-level keys are a v1 config's (v0 names its model `model_name_or_path`)."""
    return "model_name_or_path" not in top and bool((V1_ONLY | set(PLUGINS)) & set(top))


def v1_source(path: Path, data: dict[str, Any], lines: dict[str, int]) -> Source:
    """A v1 YAML, as read (`data`, the `lines` of its keys), with each plugin mapping's keys flattened to
    `plugin.key` (a plugin's line for its own keys where the file's lines do not say)."""
    lines = dict(lines)
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}:{lines[key]}" if key in lines else str(path)
        if key in PLUGINS and isinstance(value, str) and value.strip().startswith("{"):
            value = json.loads(value) if _json_ok(value) else value
        if key not in PLUGINS or value is None:
            values[key] = value
            continue
        if not isinstance(value, dict) or "name" not in value:
            raise UserError(f"{where}: '{key}' is {value!r}; LLaMA-Factory v1 reads a plugin mapping with a name, "
                            f"e.g. `{key}: {{name: {PLUGINS[key]}}}`.")
        for sub, v in value.items():
            values[f"{key}.{sub}"] = v
    for key in values:
        head = key.partition(".")[0]
        if key not in lines and head in lines:
            lines[key] = lines[head]
    return Source(path, values, list(values), lines)


def _json_ok(value: str) -> bool:
    try:
        json.loads(value)
    except json.JSONDecodeError:
        return False
    return True


def read_llamafactory_v1(path: Path, parsed: tuple[dict[str, Any], dict[str, int]], nproc: int | None,
                         shape_of: Any, hw: Hardware | None = None) -> ForeignJob:
    """The job of a v1 YAML, `parsed` its mapping and the lines of its keys (common.load_yaml, nested). `nproc` the
    ranks a node launches; without it, v1's launcher starts one per visible GPU, so the GPUs a node has in `hw`
    (--gpus) when given."""
    src = v1_source(path, *parsed)
    model = src.get("model")
    if model is None:
        raise UserError(f"{src.where}: no 'model'; LLaMA-Factory v1 would train its default "
                        f"Qwen/Qwen3-4B-Instruct-2507. Name the checkpoint: `model: ORG/NAME`.")
    if not isinstance(model, str) or not model.strip():
        raise UserError(f"{src.at('model')}: 'model' is {model!r}; LLaMA-Factory v1 reads a checkpoint's hub id or "
                        f"path, e.g. `model: Qwen/Qwen3-4B`.")
    shape = shape_of(model)
    job = ForeignJob("llamafactory", src.where, model, Workload(), words=words(), nproc=nproc)
    if nproc is None and hw is not None:
        job.nproc, job.nnodes = hw.gpus_per_node, hw.nodes
        job.notes.append(f"no --nproc: planned as v1's launcher runs, one rank per GPU ({hw.gpus_per_node} a node, "
                         f"from --gpus); pass --nproc N for NPROC_PER_NODE=N")
    ds_precision = _engine(src, job, shape.hidden)
    w = job.workload = _workload(src, job, ds_precision, shape.layers)
    job.quant_storage = w.method == "qlora"  # v1 stores 4-bit weights in the compute dtype
    job.data, job.data_missing, pair = _datasets(src)
    if job.data_missing:
        job.notes.append(f"datasets not found as local files (convert leaves them out): "
                         f"{', '.join(job.data_missing)}")
    job.convert = _convert(src, w, shape.layers)
    default_epochs(job, src, KEYS, "LLaMA-Factory v1")
    if pair:
        _check_dpo(src, w)
        _preference(src, job, w)
        w = job.workload
    job.notes.append("loss: v1's trainer takes an fp32 copy of the logits and a shifted copy of that (full_shift), "
                     "whatever the transformers version")
    _file_keys(src, job, w, shape)
    return job


def _engine(src: Source, job: ForeignJob, hidden: int) -> str | None:
    """`dist_config`: FSDP2 (fsdpturbo too: FSDP2 with experts shared over `ep_size` ranks), DeepSpeed with its
    JSON, or none: DDP over several ranks (base_trainer `_shard_model`). Returns the precision a DeepSpeed JSON
    sets (None: "auto" or none)."""
    name = src.get("dist_config.name")
    if name is None:
        job.engine = "ddp" if job.distributed else "single"
        return None
    if name not in DIST:
        raise UserError(f"{src.at('dist_config.name')}: 'dist_config.name' is {name!r}; LLaMA-Factory v1's "
                        f"backends are {', '.join(DIST)} (or no dist_config: DDP).")
    if name == "deepspeed":
        ref = src.get("dist_config.config_file")
        if not isinstance(ref, str) or not ref:
            raise UserError(f"{src.at('dist_config.name')}: dist_config with name deepspeed needs 'config_file', "
                            f"the DeepSpeed JSON (e.g. examples/deepspeed/ds_z3_config.json).")
        # v1's trainer builds a torch optimizer and scheduler and passes both to accelerate (core/base_trainer.py,
        # plugins/trainer_plugins/distributed/deepspeed.py `prepare`, 0.9.5), never DeepSpeed's own
        ds = use_deepspeed(job, ref, src.path.parent, src.at("dist_config.config_file"), hidden, job.notes,
                           passes_optimizer="LLaMA-Factory v1")
        return _ds_mixed(ds, src.at("dist_config.config_file"))
    if name != "deepspeed" and job.nproc is not None and not job.distributed:  # unknown ranks: as configured
        job.engine = "single"
        job.notes.append(f"dist_config {name} on one process: v1 has no device mesh and leaves the model unwrapped "
                         f"(no sharding, no mixed-precision policy), so it is planned as one process without it")
        return None
    offload = src.flag("dist_config.offload_params")
    reshard = src.flag("dist_config.reshard_after_forward", True)
    job.engine = "fsdp_offload" if offload else "fsdp_full_shard" if reshard else "fsdp_shard_grad_op"
    return None


def _ds_mixed(ds: DeepSpeedJob, where: str) -> str:
    """v1's mixed precision under DeepSpeed, from the JSON alone (deepspeed_utils `infer_deepspeed_mixed_precision`;
    the YAML's bf16 never reaches the engine): bf16 unless the JSON turns bf16 or fp16 off ("no": none), and fp16
    refused."""
    if ds.fp16_on:
        raise UserError(f"{where}: the DeepSpeed JSON {ds.source} sets 'fp16.enabled' true; LLaMA-Factory v1 "
                        f"refuses fp16 under DeepSpeed (bf16 only). Set `\"bf16\": {{\"enabled\": true}}` and "
                        f"fp16's to false or auto.")
    return "no" if ds.bf16_on is False or (ds.bf16_on is None and ds.fp16_on is False) else "bf16"


def _method(src: Source, job: ForeignJob) -> str:
    """No peft_config: full fine-tuning; lora (qlora over a 4-bit quant_config) or freeze."""
    name = src.get("peft_config.name")
    method = "full" if name is None else METHODS.get(str(name))
    if method is None:
        raise UserError(f"{src.at('peft_config.name')}: 'peft_config.name' is {name!r}; LLaMA-Factory v1's are "
                        f"lora and freeze (no peft_config: full).")
    quant = src.get("quant_config.name")
    if quant is not None and quant not in QUANT:
        raise UserError(f"{src.at('quant_config.name')}: 'quant_config.name' is {quant!r}; LLaMA-Factory v1's are "
                        f"{', '.join(QUANT)}.")
    bits = src.get("quant_config.quantization_bit")
    if quant == "auto" and bits is None:  # v1's auto plugin loads the model as it is then
        job.notes.append("quant_config auto without quantization_bit: LLaMA-Factory v1 applies no quantization, "
                         "so the weights are planned unquantized")
    elif quant is not None:
        bits = 4 if bits is None else as_int(bits, "quant_config.quantization_bit", src.at("quant_config"))
        if bits not in (4, 8):
            raise UserError(f"{src.at('quant_config')}: 'quant_config.quantization_bit' is {bits}; bitsandbytes "
                            f"takes 4 or 8.")
        method = "qlora" if method == "lora" else method
        if bits == 8:
            job.notes.append("quant_config.quantization_bit: 8 is planned as 4-bit NF4 (the planner models 4-bit "
                             "only): an under-estimate of the frozen weights")
    return method


def _precision(src: Source, job: ForeignJob, method: str, ds_precision: str | None) -> str:
    """bf16 is FSDP2's compute dtype; DeepSpeed's comes from its JSON alone (`_ds_mixed`); without either nothing
    autocasts, so a fully trained model, cast to fp32 by v1, computes in fp32, and adapters compute beside the
    checkpoint's 16 bits."""
    bf16 = src.flag("bf16", True)
    if job.engine == "deepspeed":
        if ds_precision == "bf16" or method != "full":
            return "bf16"
        job.notes.append("full fine-tuning under a DeepSpeed JSON that turns bf16 off: LLaMA-Factory v1 casts the "
                         "model to fp32 and DeepSpeed runs no mixed precision, so it is planned in fp32")
        return "fp32"
    if job.engine.startswith("fsdp"):  # FSDP2's param_dtype: fp32 casts even a LoRA's frozen weights up
        return "bf16" if bf16 else "fp32"
    if method != "full":
        return "bf16"
    job.notes.append("full fine-tuning without dist_config: LLaMA-Factory v1 casts the model to fp32 and does not "
                     "autocast (bf16 is FSDP2's compute dtype), so it is planned in fp32")
    return "fp32"


def _workload(src: Source, job: ForeignJob, ds_precision: str | None, layers: int) -> Workload:
    method = _method(src, job)
    attn = src.get("flash_attn", "sdpa")
    if attn not in V1_ATTENTION:
        raise UserError(f"{src.at('flash_attn')}: 'flash_attn' is {attn!r}; LLaMA-Factory v1's are "
                        f"{', '.join(V1_ATTENTION)}.")
    fields = settings(src, KEYS, "field")
    _check_split(src, job, fields, attn)
    fields["grad_accum"] = _grad_accum(src, job, fields)
    if src.get("dist_config.name") != "fsdpturbo":  # experts are shared over ranks by fsdpturbo only
        fields.pop("expert_parallel", None)
    if method not in ("lora", "qlora"):
        fields["lora_dropout"] = 0.0
    return Workload(method=method, precision=_precision(src, job, method, ds_precision),
                    grad_ckpt="full" if src.flag("enable_activation_checkpointing", True) else "none",
                    optimizer="adamw", fused_adamw=False, loss="full_shift", attention=ATTENTION[attn],
                    frozen_fp32=False, quant_backend="bnb", freeze_blocks=_freeze_blocks(src, method, layers),
                    **fields)


def _freeze_blocks(src: Source, method: str, layers: int) -> tuple[int, ...]:
    """The blocks the freeze plugin trains (`freeze_trainable_layers`, default the last 2)."""
    if method != "freeze":
        return ()
    n = as_int(src.get("peft_config.freeze_trainable_layers", 2), "peft_config.freeze_trainable_layers",
               src.at("peft_config"))
    return tuple(lf_freeze_blocks(n, layers))


def _check_split(src: Source, job: ForeignJob, fields: dict[str, Any], attn: str) -> None:
    """What v1 refuses at start: a row split without flash-attention 2 or under DeepSpeed, padding-free rows
    without flash-attention 2."""
    mode = src.get("cp_mode", "ulysses")
    if mode != "ulysses":
        raise UserError(f"{src.at('cp_mode')}: 'cp_mode' is {mode!r}; LLaMA-Factory v1 has ulysses only.")
    cp = fields.get("sequence_parallel", 1)
    if cp > 1 and attn != "flash_attention_2":
        raise UserError(f"{src.at('cp_size')}: cp_size {cp} needs `flash_attn: "
                        f"flash_attention_2` (LLaMA-Factory v1's Ulysses wraps flash-attention only).")
    if cp > 1 and job.engine == "deepspeed":
        raise UserError(f"{src.at('cp_size')}: cp_size above 1 needs `dist_config: {{name: fsdp2}}`; LLaMA-Factory "
                        f"v1 refuses context parallelism under DeepSpeed.")
    strategy = src.get("batching_strategy", "normal")
    if strategy not in BATCHING:
        raise UserError(f"{src.at('batching_strategy')}: 'batching_strategy' is {strategy!r}; LLaMA-Factory v1's "
                        f"are {', '.join(BATCHING)}.")
    if strategy in ("padding_free", "dynamic_padding_free") and attn != "flash_attention_2":
        raise UserError(f"{src.at('batching_strategy')}: batching_strategy {strategy} needs `flash_attn: "
                        f"flash_attention_2`.")


def _grad_accum(src: Source, job: ForeignJob, fields: dict[str, Any]) -> int:
    """Micro-batches per step: `global_batch_size` over the data-parallel ranks (`dp_size`, else the ranks over
    `cp_size`) and the micro-batch, as v1's BatchGenerator divides it; one when it is not given."""
    total = src.get("global_batch_size")
    if total is None:
        return 1
    total = count(total, "global_batch_size", src.at("global_batch_size"))
    world = (job.nproc or 1) * job.nnodes
    cp = fields.get("sequence_parallel", 1)
    dp = src.get("dp_size")
    dp = count(dp, "dp_size", src.at("dp_size")) if dp is not None else max(1, world // cp)
    if job.nproc is None:
        job.notes.append(f"global_batch_size over {dp} data-parallel rank(s): pass --nproc N for the ranks the job "
                         f"runs on")
    per_step = dp * fields["micro_batch"]
    if total % per_step:
        raise UserError(f"{src.at('global_batch_size')}: global_batch_size {total} is not a multiple of {dp} "
                        f"data-parallel rank(s) x micro_batch_size {fields['micro_batch']}; LLaMA-Factory v1 "
                        f"refuses it. Give a multiple of {per_step}.")
    return total // per_step


def _datasets(src: Source) -> tuple[list[str], list[str], bool]:
    """Local files of `train_dataset`: a file, or a dataset YAML whose entries' `path` name the files; and whether
    an entry converts chosen/rejected pairs (`converter: pair`, the data of v1's DPO trainer)."""
    given = src.get("train_dataset")
    if not given:
        return [], [], False
    bases = (src.path.parent, Path.cwd())
    hit = local_file(str(given), *bases)
    if hit is None or not hit.endswith((".yaml", ".yml")):
        return ([hit], [], False) if hit else ([], [str(given)], False)
    infos, _ = read_yaml(Path(hit))
    entries = [v for v in infos.values() if isinstance(v, dict)] if isinstance(infos, dict) else []
    paths = [str(v["path"]) for v in entries if v.get("path")]
    found = [h for p in paths if (h := local_file(p, Path(hit).parent, *bases))]
    pair = any(v.get("converter") == "pair" for v in entries)
    return found, [p for p in paths if not local_file(p, Path(hit).parent, *bases)], pair


def _check_dpo(src: Source, w: Workload) -> None:
    """What v1's DPO trainer refuses when it starts, whatever its pref_loss: rows split over ranks (cp_size above
    1; its chosen and rejected halves are scored whole on each rank)."""
    if w.sequence_parallel > 1:
        raise UserError(f"{src.at('cp_size')}: cp_size {w.sequence_parallel} with a chosen/rejected dataset "
                        f"(`converter: pair`, trained by `llamafactory-cli dpo`): LLaMA-Factory v1's DPO trainer "
                        f"refuses context parallelism (cp_size == 1 only). Remove cp_size (or set it to 1); where a "
                        f"whole row then does not fit one GPU, shorten cutoff_len.")


def _preference(src: Source, job: ForeignJob, w: Workload) -> None:
    """A dataset of chosen/rejected pairs is trained by `llamafactory-cli dpo` (v1's sft trainer has no use for
    pairs): planned as that, `pref_loss` (sigmoid, orpo, simpo) picking the objective. Its sigmoid loss keeps a deep
    copy of the model as the reference unless adapters train (dpo_trainer `_init_ref_model`)."""
    loss = choice(src.get("pref_loss", "sigmoid"), "pref_loss", src.at("pref_loss"), PREF_LOSSES)
    pref = Preference(objective=loss)
    pref.number("beta", src.get("pref_beta", 0.1), "pref_beta", src.at("pref_beta"))
    if loss == "simpo":
        pref.number("simpo_gamma", src.get("simpo_gamma"), "simpo_gamma", src.at("simpo_gamma"))
    if loss == "dpo" and not w.trains_adapters:
        pref.reference = ReferenceCopy("v1's DPO trainer deep-copies the model as the reference")
    apply(job, pref)
    job.notes.append(f"train_dataset has `converter: pair` (chosen/rejected rows): planned as "
                     f"`llamafactory-cli dpo` with pref_loss {src.get('pref_loss', 'sigmoid')}")


def _convert(src: Source, w: Workload, layers: int) -> dict[str, Any]:
    """shardfit config keys of the same job (beyond the workload and the strategy)."""
    out = settings(src, KEYS, "config")
    if src.get("dist_config.name") != "fsdpturbo":
        out.pop("expert_parallel", None)
    # v1 pads rows of one example each unless told to pack them; shardfit packs unless told not to
    out["packing"] = src.get("batching_strategy") in ("padding_free", "dynamic_padding_free")
    if w.method == "freeze":
        out["freeze_trainable"] = [f"layers.{i}" for i in w.trained_blocks(layers)]
    return out


def _file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape) -> None:
    """Every key, with what v1 does with it; what the plan leaves out as not modelled."""
    unplanned = {k for k in src.values if k.startswith(("optim_config.", "pref_", "simpo_", "dpo_", "ld_"))}
    if "optim_config.name" in src:
        job.notes.append(f"optim_config {src.get('optim_config.name')}: planned as torch's AdamW")
    effects = {"dist_config.name": job.describe_engine()}
    if job.workload.objective != "sft":  # a pair dataset: planned as `llamafactory-cli dpo` (`_preference`)
        unplanned -= {"pref_loss", "pref_beta", "simpo_gamma"}
        effects |= {"pref_loss": "objective {objective}", "pref_beta": NO_EFFECT, "simpo_gamma": NO_EFFECT}
    elif unplanned & {"pref_loss", "pref_beta"}:
        job.notes.append("v1 trains DPO when run as `llamafactory-cli dpo`; this YAML is planned as sft")
    targets = lora_targets(src.get("peft_config.target_modules", "all"), "peft_config.target_modules",
                           src.at("peft_config.target_modules"))
    if targets != "all-linear" and w.trains_adapters:  # the freeze plugin has no targets
        effect = plan_targets(job, "peft_config.target_modules", targets, shape)
        if effect:
            effects["peft_config.target_modules"] = effect
        else:
            unplanned.add("peft_config.target_modules")
    for key, default in (("peft_config.freeze_trainable_modules", "all"), ("peft_config.freeze_extra_modules", None),
                         ("model_class", "llm"), ("kernel_config.name", "auto")):
        if src.get(key, default) not in (default, []):
            unplanned.add(key)
    if str(src.get("batching_strategy", "")).startswith("dynamic"):  # micro-batches sized by a token budget
        unplanned.add("batching_strategy")
    if "dist_config.ep_size" in src and src.get("dist_config.name") != "fsdpturbo":
        unplanned.add("dist_config.ep_size")  # experts are shared over ranks by fsdpturbo only
    if src.get("mp_shard_size") is not None:
        unplanned.add("mp_shard_size")  # FSDP2 over a sub-mesh, replicated over the rest (HSDP)
    if src.get("quant_config.name") == "auto" and src.get("quant_config.quantization_bit") is None:
        effects["quant_config.name"] = "no quantization (auto without quantization_bit)"
    if src.get("batching_strategy") in ("padding_free", "dynamic_padding_free"):
        effects["batching_strategy"] = "examples packed into rows"
    file_keys(job, src.items(), KEYS, w, effects=effects, unplanned=unplanned)
