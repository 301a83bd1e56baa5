"""An axolotl YAML (`axolotl train my.yml`, `accelerate launch -m axolotl.cli.train my.yml`), with axolotl's
memory behaviour: 4/8-bit models go through peft's prepare_model_for_kbit_training, after which axolotl casts the
embeddings, norms and head back to the compute dtype (`_kbit_dtypes`), the Liger / Cut Cross-Entropy plugins
fuse the loss, `fsdp` / `fsdp_config` shard with FSDP."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.axolotl_checks import check_axolotl_schedule, check_fp32_norms
from shardfit.foreign.common import (
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
)
from shardfit.foreign.job import ForeignJob, ReferenceCopy, Words
from shardfit.foreign.kbit import cast_back
from shardfit.foreign.keys import (
    TF32,
    TORCH_COMPILE,
    Key,
    Source,
    default_epochs,
    epochs,
    file_keys,
    flag,
    if_set,
    if_truthy,
    key_table,
    only_true,
    settings,
    text,
    use_deepspeed,
    yaml_source,
)
from shardfit.foreign.preference import Preference, apply, choice, refuse
from shardfit.foreign.targets import plan_linear_names, plan_saved, plan_targets, saved_names
from shardfit.foreign.trainer_eval import EVAL_KEYS, held_out_eval
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload

ATTENTION = "attention {attention}"
# `gradient_checkpointing` values that checkpoint every block beside true: unsloth's, and the older spellings of
# activation offloading (`offload` is `activation_offloading: true`, `offload_disk` is `disk`).
OFFLOAD_SPELLINGS = {"offload": "true", "offload_disk": "disk"}
CHECKPOINT_WORDS = ("unsloth", *OFFLOAD_SPELLINGS)


def _compiled(value: Any, key: str, where: str) -> bool:
    """`torch_compile`: axolotl turns `auto` on wherever torch is 2.5.1 or newer (every torch shardfit runs on)."""
    return str(value).strip().lower() == "auto" or flag(value, key, where)


# Preference settings, carried over to shardfit's `dpo:` keys where it has one (`_preference`).
PREFERENCE_KEYS = {"rl_beta", "dpo_beta", "orpo_alpha", "rpo_alpha", "simpo_gamma", "cpo_alpha", "kto_desirable_weight",
                   "kto_undesirable_weight", "dpo_label_smoothing", "precompute_ref_log_probs", "dpo_use_weighting",
                   "dpo_use_logits_to_keep", "dpo_norm_loss", "dpo_padding_free", "dpo_generate_during_eval",
                   "dpo_use_liger_kernel", "dpo_loss_type", "dpo_loss_weights"}
# axolotl's `rl` (RLType): `true` is its first spelling of DPO.
RL_TYPES = {"dpo": "dpo", "ipo": "ipo", "orpo": "orpo", "kto": "kto", "simpo": "simpo", "grpo": "grpo",
            "gdpo": "gdpo", "true": "dpo"}
REFUSED = {"grpo": "GRPO, online with generation", "gdpo": "GDPO, online with generation"}
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")
# What each axolotl key means to shardfit. Settings that carry over are read as axolotl reads them: a null value
# leaves axolotl's default.
KEYS = key_table({
    "torch_compile": dataclasses.replace(TORCH_COMPILE, read=_compiled),
    "tf32": TF32,
    "adapter": Key("{method}"), "load_in_4bit": Key("4-bit NF4"), "load_in_8bit": Key("planned as 4-bit"),
    "bf16": Key("{precision}"), "fp16": Key("{precision}"),
    # torchao's float8 training through accelerate, as shardfit's `float8` converts the blocks' linear layers
    "fp8": Key("FP8 matmuls", field="float8", config="float8", read=flag, default=False),
    "sequence_len": Key("sequence length", field="seq_len", read=as_int, default=2048),
    "micro_batch_size": Key("micro-batch", field="micro_batch", read=as_int, default=1),
    "lora_r": Key("adapter size", field="lora_rank", read=as_int, default=8),
    "gradient_accumulation_steps": Key("grad_accum", field="grad_accum", read=as_int, default=1),
    "gradient_checkpointing": Key("grad_ckpt {grad_ckpt}"), "gradient_checkpointing_kwargs": Key("reentrant or not"),
    "lora_target_linear": Key("adapters on every linear layer"), "flash_attention": Key(ATTENTION),
    "sdp_attention": Key(ATTENTION), "flex_attention": Key(ATTENTION), "attn_implementation": Key(ATTENTION),
    # each of N ranks holds 1/N of every row's tokens (axolotl's ring attention, planned with Ulysses' all-to-alls;
    # `sequence_parallel_degree` is its old name), or 1/N of each block's routed experts
    "context_parallel_size": Key("sequence parallel", field="sequence_parallel", config="sequence_parallel",
                                 read=if_set(as_int)),
    "sequence_parallel_degree": Key("sequence parallel", field="sequence_parallel", config="sequence_parallel",
                                    read=if_set(as_int)),
    "expert_parallel_size": Key("expert parallel", field="expert_parallel", config="expert_parallel",
                                read=if_set(as_int)),
    "liger_fused_linear_cross_entropy": Key("fused loss"), "cut_cross_entropy": Key("fused loss"),
    # axolotl's own param groups: where a step that loops over tensors steps the embedding and head (`_groups`)
    "embedding_lr": Key("embedding group, own param groups"),
    "embedding_lr_scale": Key("embedding group, own param groups"), "lr_groups": Key("own param groups"),
    "deepspeed": Key("ZeRO settings"), "fsdp": Key("FSDP"), "fsdp_config": Key("FSDP"), "optimizer": Key("{optimizer}"),
    "ddp_find_unused_parameters": Key("DDP"), "bnb_4bit_quant_storage": Key("quantized storage"),
    "quantize_moe_experts": Key("routed experts in 4-bit, as planned"), "fsdp_version": Key("FSDP1 or FSDP2"),
    "dp_shard_size": Key("FSDP shard group"),
    "tensor_parallel_size": Key("no tensor parallelism (1)"),
    "dp_replicate_size": Key("FSDP shard group (ranks / replicas)"),
    # carried over to the shardfit config (LoRA's targets are decided in `_convert`)
    "lora_alpha": Key(config="lora.alpha", read=as_int, default=16),
    "lora_dropout": Key(config="lora.dropout", read=as_float, default=0.0),
    "sample_packing": Key(config="packing", read=flag, default=False),
    "learning_rate": Key(config="lr", read=if_set(as_float)),
    "warmup_ratio": Key(config="warmup_ratio", read=if_set(as_float)),
    "weight_decay": Key(config="weight_decay", read=if_set(as_float)),
    "max_grad_norm": Key(config="max_grad_norm", read=if_set(as_float)),
    "val_set_size": Key(config="eval_split", read=if_set(as_float)), **EVAL_KEYS,
    "eval_batch_size": Key("eval forward of {eval_batch} rows per GPU, its loss upcast to fp32"),
    "max_steps": Key(config="max_steps", read=if_set(as_int)),
    "logging_steps": Key(config="log_steps", read=if_set(as_int)),
    "seed": Key(config="seed", read=if_set(as_int)),
    "save_steps": Key(config="save_steps", read=if_set(as_int)),
    "eval_steps": Key(config="eval_steps", read=if_set(as_int)),
    "num_epochs": Key(config="epochs", read=if_set(epochs), default=1.0),
    "output_dir": Key(config="output_dir", read=if_truthy(text)),
    "trust_remote_code": Key(config="trust_remote_code", read=only_true),
    # preference training (`_preference`): the objective, and a reference model loaded beside the policy
    "rl": Key("objective {objective}"), "rl_adapter_ref_model": Key("reference model loaded beside the adapters"),
}, no_effect=TRAINER_NO_EFFECT | PREFERENCE_KEYS | {
    "base_model", "model_type", "tokenizer_type", "strict", "datasets", "dataset_prepared_path", "lora_model_dir",
    "lora_fan_in_fan_out", "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model",
    "lr_scheduler", "train_on_inputs", "early_stopping_patience", "evals_per_epoch", "saves_per_epoch", "debug",
    "special_tokens", "tokens", "chat_template", "pad_to_sequence_len", "eval_sample_packing", "plugins",
    "hub_strategy", "xformers_attention", "s2_attention", "eval_table_size", "eval_max_new_tokens",
    "shuffle_merged_datasets", "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model",
    "cosine_min_lr_ratio", "loss_watchdog_threshold", "loss_watchdog_patience", "liger_rms_norm",
    "liger_glu_activation", "liger_rope", "liger_layer_norm",
})


def words() -> Words:
    return Words(zero={"zero2": "deepspeed: deepspeed_configs/zero2.json",
                       "zero3": "deepspeed: deepspeed_configs/zero3_bf16.json",
                       "zero3_offload": "deepspeed: deepspeed_configs/zero3_bf16_cpuoffload_all.json"},
                 keys={**eight_bit_words("optimizer: {}"),
                       "fused_loss": "plugins: [axolotl.integrations.liger.LigerPlugin] with "
                       "liger_fused_linear_cross_entropy: true",
                       "grad_ckpt": "gradient_checkpointing: true", "micro_batch": "micro_batch_size: 1 with "
                       "gradient_accumulation_steps", "seq": "sequence_len: {}", "qlora": "adapter: qlora with "
                       "load_in_4bit: true", "lora": "adapter: lora",
                       "reentrant": "gradient_checkpointing_kwargs: {use_reentrant: false}",
                       "device_map": "drop device_map under accelerate launch",
                       "nodes": "num_machines: {} and num_processes: {ranks} (every machine's GPUs together) in the "
                       "accelerate config, machine_rank and main_process_ip on each machine"})


def read_axolotl(path: Path, shape_of: Any, version: str, nproc: int | None) -> ForeignJob:
    src = yaml_source(path)
    model = src.get("base_model")
    if not model:
        raise UserError(f"{src.where}: no 'base_model'; axolotl needs it, and shardfit plans from it.")
    check_axolotl_schedule(src)
    check_fp32_norms(src)
    shape = shape_of(str(model))
    job = ForeignJob("axolotl", src.where, str(model), Workload(), words=words(), nproc=nproc)
    w = job.workload = _workload(src, job, version)
    w = job.workload = dataclasses.replace(w, **held_out_eval(
        src, share="val_set_size", data="test_datasets", strategy_default=True, batch_key="eval_batch_size",
        default_batch=w.micro_batch))
    _checkpointing(src, job)
    if src.get("deepspeed") and (src.get("fsdp") or src.get("fsdp_config")):
        raise UserError(f"{src.at('deepspeed')}: both 'deepspeed' and FSDP ('fsdp'/'fsdp_config') are set; axolotl "
                        f"shards with one of them: keep one.")
    if src.get("deepspeed"):
        use_deepspeed(job, str(src.get("deepspeed")), path.parent, src.at("deepspeed"), shape.hidden, job.notes)
    elif fsdp := _fsdp_engine(src, job.distributed):
        job.engine = fsdp
        _fsdp_checkpointing(src, job)
        _fsdp_version(src, job)
    elif nproc and nproc > 1:
        job.engine = "ddp"
    _parallel_sizes(src, job)
    # axolotl stores 4-bit weights in the compute dtype itself when it shards them (FSDP, ZeRO-3)
    job.quant_storage = w.method == "qlora" and job.engine != "ddp"
    _kbit_dtypes(src, job, shape, version)
    _unplanned_savings(src, job)
    _groups(src, job)
    job.data = _datasets(src, job)
    job.convert = _convert(src)
    default_epochs(job, src, KEYS, "axolotl")
    apply(job, _preference(src))
    _file_keys(src, job, job.workload, shape, version)
    return job


def _preference(src: Source) -> Preference:
    """`rl` in shardfit's objectives (ipo is dpo with the IPO loss). axolotl loads the model a second time as the
    reference for every `rl` but orpo unless an adapter trains (train.setup_reference_model), and with one too under
    `rl_adapter_ref_model`; DPO and IPO hand it to TRL's trainer, which prepares it as the policy's engine does.
    beta is `rl_beta` (`dpo_beta` before it), else `orpo_alpha`; TRL's default is 0.1."""
    rl = src.get("rl")
    if rl is None or rl is False or str(rl).lower() in ("", "false", "none"):
        return Preference()
    kind = choice(rl, "rl", src.at("rl"), RL_TYPES)
    if kind in REFUSED:
        raise refuse(src.at("rl"), "rl", kind, REFUSED[kind])
    pref = Preference(objective="dpo" if kind == "ipo" else kind)
    beta_key = next((k for k in ("rl_beta", "dpo_beta", "orpo_alpha") if src.get(k) is not None), "rl_beta")
    pref.number("beta", src.get(beta_key, 0.1), beta_key, src.at(beta_key))
    if pref.objective == "dpo":
        losses = src.get("dpo_loss_type") or ["ipo" if kind == "ipo" else "sigmoid"]
        losses = [str(x) for x in (losses if isinstance(losses, list) else [losses])]
        if len(losses) == 1 and losses[0] in DPO_LOSSES:
            pref.dpo["loss"] = losses[0]
        else:
            pref.unconvertible = f"dpo_loss_type {losses}: shardfit's dpo losses are {', '.join(DPO_LOSSES)} (one)"
        pref.number("label_smoothing", src.get("dpo_label_smoothing"), "dpo_label_smoothing",
                    src.at("dpo_label_smoothing"))
    if kind == "simpo":
        pref.number("simpo_gamma", src.get("simpo_gamma"), "simpo_gamma", src.at("simpo_gamma"))
        alpha = src.get("cpo_alpha")
        if alpha is None or as_float(alpha, "cpo_alpha", src.at("cpo_alpha")) > 0:
            pref.drop("cpo_alpha", "1.0 (TRL's default)" if alpha is None else alpha, "TRL's CPO trainer adds "
                      "cpo_alpha times the chosen answer's NLL to SimPO's loss; shardfit's simpo has none (cpo_alpha: "
                      "0 is plain SimPO)")
    if kind == "kto":
        pref.number("desirable_weight", src.get("kto_desirable_weight"), "kto_desirable_weight",
                    src.at("kto_desirable_weight"))
        pref.number("undesirable_weight", src.get("kto_undesirable_weight"), "kto_undesirable_weight",
                    src.at("kto_undesirable_weight"))
    if src.get("rpo_alpha") is not None and as_float(src.get("rpo_alpha"), "rpo_alpha", src.at("rpo_alpha")) > 0:
        pref.drop("rpo_alpha", src.get("rpo_alpha"), "RPO's NLL term on the chosen answer; shardfit's dpo has none")
    if src.flag("dpo_use_weighting"):
        pref.drop("dpo_use_weighting", "true", "WPO's weighting of each pair by its probability")
    if kind in ("dpo", "ipo", "kto"):
        own = src.flag("rl_adapter_ref_model")
        pref.reference = ReferenceCopy("rl_adapter_ref_model: true loads the model again as the reference" if own
                                       else f"rl: {kind} without an adapter loads the model again as the reference",
                                       with_adapters=own)
    return pref


def _method(src: Source, job: ForeignJob) -> str:
    adapter = str(src.get("adapter") or "").lower()
    eight = src.flag("load_in_8bit")
    if adapter and adapter not in ("lora", "qlora"):
        raise UserError(f"{src.at('adapter')}: 'adapter' is {adapter!r}; axolotl's are lora and qlora (unset: full).")
    if eight:
        job.notes.append("load_in_8bit planned as 4-bit NF4 (an under-estimate of the frozen weights)")
    if not adapter:
        return "full"
    return "qlora" if adapter == "qlora" or src.flag("load_in_4bit") or eight else "lora"


def _workload(src: Source, job: ForeignJob, version: str) -> Workload:
    method = _method(src, job)
    bf16 = src.get("bf16", False)
    precision = "bf16" if bf16 == "auto" or as_bool(bf16) else "fp16" if src.flag("fp16") else "fp32"
    plugins = " ".join(str(p) for p in src.get("plugins") or [])
    # the Cut Cross-Entropy plugin turns its loss on unless `cut_cross_entropy: false` (its default is true)
    cce = "cut_cross_entropy" in plugins.lower() and (src.get("cut_cross_entropy") is None
                                                       or src.flag("cut_cross_entropy"))
    fused = (src.flag("liger_fused_linear_cross_entropy") and "liger" in plugins.lower()) or src.flag(
        "cut_cross_entropy") or cce
    impl = str(src.get("attn_implementation") or "").lower()  # the newer key; the flags above are deprecated
    _one_attention(src, impl)
    flash = src.flag("flash_attention") or src.flag("flex_attention") or any(k in impl for k in ("flash", "flex"))
    gc = src.get("gradient_checkpointing", False)
    if isinstance(gc, str) and gc not in CHECKPOINT_WORDS and gc.lower() not in ("true", "false"):
        raise UserError(f"{src.at('gradient_checkpointing')}: 'gradient_checkpointing: {gc}'; axolotl takes true, "
                        f"false or one of {', '.join(CHECKPOINT_WORDS)} (lower case).")
    return Workload(method=method, precision=precision, grad_ckpt="full" if gc in CHECKPOINT_WORDS or as_bool(gc)
                    else "none",
                    **optimizer_keys(src.get("optimizer"), version, job.notes, "adamw_torch_fused",
                                    src.get("optim_args"), src.get("weight_decay", 0.0), src.at("optim_args")),
                    loss=hf_loss(version, fused), attention=_attention(src, impl, flash, job),
                    quant_backend="bnb", quantize_fused_experts=src.flag("quantize_moe_experts"),
                    **settings(src, KEYS, "field"))


def _kbit_dtypes(src: Source, job: ForeignJob, shape: ModelShape, version: str) -> None:
    """The frozen weights' dtype of a 4/8-bit job as axolotl's loader leaves them (loaders/model.py
    `_configure_embedding_dtypes`, `_prepare_model_for_quantization`; utils/models.py before 0.10; the same in
    every release since 0.3, 0.18.0 read): peft's prepare_model_for_kbit_training upcasts every weight that is not
    4-bit to fp32, then for lora and qlora axolotl casts the norms, embeddings and head back to the compute dtype.
    With FSDP it skips both for `adapter: qlora` (since 0.5) or `cpu_ram_efficient_loading`, and under
    `quantize_moe_experts` it skips the preparation. What stays fp32 is the routed experts bitsandbytes left
    unquantized (kbit.py `cast_back`). Under ZeRO-3 DeepSpeed's cast decides (foreign/read.py)."""
    w = job.workload
    if w.method != "qlora":
        return
    cfg = fsdp_settings(src.get("fsdp_config") or {}, src.at("fsdp_config"))
    fsdp = bool(src.get("fsdp") or src.get("fsdp_config"))
    why = "adapter: qlora" if str(src.get("adapter")).lower() == "qlora" else "cpu_ram_efficient_loading"
    if fsdp and (why == "adapter: qlora" or as_bool(cfg.get("cpu_ram_efficient_loading", False))):
        job.notes.append(f"{why} with FSDP: axolotl skips prepare_model_for_kbit_training, frozen weights stay "
                         f"{w.precision}")
        job.workload = dataclasses.replace(w, frozen_fp32=False)
        return
    job.workload, note = cast_back(w, shape, version, "axolotl")
    job.notes.append(note)


def _attention(src: Source, impl: str, flash: bool, job: ForeignJob) -> str:
    """The planner's attention for axolotl's attention keys (its own SDPA and xformers patches count as set); none
    set, transformers' default (read.py decides it by version and model)."""
    if flash:
        return "flash"
    if src.flag("eager_attention") or impl == "eager":
        return "eager"
    job.attention_unset = not (impl or src.flag("sdp_attention") or src.flag("xformers_attention"))
    return "sdpa"


def _one_attention(src: Source, impl: str) -> None:
    """A UserError when `attn_implementation` and a deprecated attention flag set to true name different kernels
    (axolotl's version decides which one runs, so neither is planned silently)."""
    if not impl:
        return
    for key, words in (("flash_attention", ("flash",)), ("flex_attention", ("flex",)), ("sdp_attention", ("sdpa",)),
                       ("eager_attention", ("eager",))):
        if src.flag(key) and not any(w in impl for w in words):
            raise UserError(f"{src.at(key)}: '{key}: true' and 'attn_implementation: {impl}' name different "
                            f"attention kernels; keep attn_implementation and drop {key}.")


def _checkpointing(src: Source, job: ForeignJob) -> None:
    on = job.workload.grad_ckpt != "none"
    _offloading(src, job, on)
    kwargs = src.get("gradient_checkpointing_kwargs") or {}
    job.reentrant_ckpt = on and as_bool(kwargs.get("use_reentrant", True)) if isinstance(kwargs, dict) else on
    job.find_unused = src.flag("ddp_find_unused_parameters")


def _offloading(src: Source, job: ForeignJob, on: bool) -> None:
    """axolotl's activation offloading (`activation_offloading`, or `gradient_checkpointing: offload|offload_disk`,
    its older spelling of true|disk): the activations checkpointing keeps go to host memory or disk. shardfit
    offloads no activations, so the plan keeps them on the GPU (an over-estimate), and says so."""
    gc, ao = src.get("gradient_checkpointing"), src.get("activation_offloading")
    old = OFFLOAD_SPELLINGS.get(str(gc).lower()) if isinstance(gc, str) else None
    mode = str(ao).lower() if ao not in (None, False) and str(ao).lower() not in ("false", "none") else old
    if mode is None:
        return
    if ao not in (None, False) and not on:
        raise UserError(f"{src.at('activation_offloading')}: 'activation_offloading: {str(ao).lower()}' without "
                        f"gradient_checkpointing; axolotl refuses it (activation offloading requires gradient "
                        f"checkpointing): set gradient_checkpointing: true.")
    key = "activation_offloading" if ao not in (None, False) else f"gradient_checkpointing: {gc}"
    where = "disk" if mode == "disk" else "host memory"
    what = "each block's input" if mode == "hidden_states" else "the activations"
    job.notes.append(f"{key}: axolotl moves {what} to {where}; shardfit does not model offloaded activations, so "
                     "the plan keeps them on the GPU as checkpointing does (an over-estimate of the GPU's "
                     "activations; ask for activation offloading in shardfit)")
    job.not_carried.append(f"{key} not carried: shardfit keeps activations on the GPU (grad_ckpt full)")


def _fsdp_checkpointing(src: Source, job: ForeignJob) -> None:
    """`activation_checkpointing` in `fsdp_config` (axolotl's Llama 4 examples) checkpoints every block through
    accelerate's non-reentrant wrapper, with or without `gradient_checkpointing`."""
    cfg = src.get("fsdp_config") or {}
    cfg = fsdp_settings(cfg, src.at("fsdp_config"))
    if as_bool(cfg.get("activation_checkpointing", False)) and job.workload.grad_ckpt == "none":
        job.workload = dataclasses.replace(job.workload, grad_ckpt="full")
        job.reentrant_ckpt = False
        job.notes.append("fsdp_config activation_checkpointing checkpoints every block (planned as grad_ckpt full)")


def _unplanned_savings(src: Source, job: ForeignJob) -> None:
    """Keys whose memory shardfit does not count, said rather than dropped: `tiled_mlp` (ALST's MLP over slices
    of the sequence: less activation memory than planned)."""
    if src.flag("tiled_mlp"):
        job.notes.append("tiled_mlp: axolotl runs each MLP over slices of the sequence; shardfit plans it whole (an "
                         "over-estimate of the MLP's activations at long sequences)")


def _groups(src: Source, job: ForeignJob) -> None:
    """axolotl's own param groups (its OptimizerMixin's `create_optimizer_grouped_parameters`), built in place of
    the Trainer's once `embedding_lr`, `embedding_lr_scale` or `lr_groups` is set: the embedding and head in a
    group of their own (`embedding_group`), one more group per `lr_groups` entry that names modules, and no 32-bit
    override for the embedding's bitsandbytes states (its create_optimizer registers one only for the Adam8bit
    class: `embedding_override` off)."""
    if all(src.get(k) is None for k in ("embedding_lr", "embedding_lr_scale", "lr_groups")):
        return
    groups = src.get("lr_groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UserError(f"{src.at('lr_groups')}: 'lr_groups' is {groups!r}; axolotl takes a list of mappings, each "
                        f"with name, modules (a list of module names) and lr.")
    named = sum(1 for g in groups if g.get("modules"))
    job.workload = dataclasses.replace(job.workload, embedding_group=True, lr_groups=named, embedding_override=False)


def _fsdp_version(src: Source, job: ForeignJob) -> None:
    """`fsdp_version` (top level, or in `fsdp_config`): axolotl runs FSDP1 unless it is 2. FSDP1 wraps the blocks
    only, so an untied input embedding stays gathered in the root unit through forward and backward."""
    cfg = fsdp_settings(src.get("fsdp_config") or {}, src.at("fsdp_config"))
    version = src.get("fsdp_version")
    version = cfg.get("version", 1) if version is None else version
    if str(version) not in ("1", "2"):
        raise UserError(f"{src.at('fsdp_version')}: 'fsdp_version' is {version!r}; axolotl runs FSDP 1 or 2.")
    fsdp1 = str(version) == "1"
    flat = flat_params_of(cfg, fsdp1, src.at("fsdp_config"), job.notes)
    job.workload = dataclasses.replace(job.workload, fsdp1=fsdp1, flat_params=flat)
    if "fsdp_version" not in src and "version" not in cfg:
        job.notes.append("fsdp_version not set: axolotl runs FSDP1 (fsdp_version: 2 for FSDP2)")


def _parallel_sizes(src: Source, job: ForeignJob) -> None:
    """axolotl's ParallelismConfig sizes shardfit plans or refuses: `tensor_parallel_size` (each layer's matrices
    split over ranks; shardfit plans no tensor parallelism) is refused, `dp_shard_size` shards FSDP over groups of
    that many ranks, replicated across the groups (HSDP): each rank holds 1/dp_shard_size of the model."""
    tp = src.get("tensor_parallel_size")
    if tp is not None and as_int(tp, "tensor_parallel_size", src.at("tensor_parallel_size")) > 1:
        raise UserError(f"{src.at('tensor_parallel_size')}: 'tensor_parallel_size: {tp}' splits each layer's "
                        f"matrices over {tp} ranks; shardfit does not plan tensor parallelism. Plan the job without "
                        f"it (remove the key): FSDP (fsdp_config, fsdp_version: 2) or ZeRO-3 shards the weights "
                        f"over the ranks instead, or plan a layer split with `shardfit plan --model "
                        f"{src.get('base_model')} --method {job.workload.method} --seq {job.workload.seq_len} "
                        f"--batch {job.workload.micro_batch} --pipeline-parallel {tp}`.")
    shard, rep = src.get("dp_shard_size"), src.get("dp_replicate_size")
    n = 1 if shard is None else as_int(shard, "dp_shard_size", src.at("dp_shard_size"))
    r = 1 if rep is None else as_int(rep, "dp_replicate_size", src.at("dp_replicate_size"))
    if n > 1 and not job.engine.startswith("fsdp"):
        raise UserError(f"{src.at('dp_shard_size')}: 'dp_shard_size: {shard}' without fsdp_config; axolotl refuses "
                        f"it (dp_shard_size was configured without a corresponding fsdp_config): add fsdp_config.")
    if n > 1 and job.workload.fsdp1:
        raise UserError(f"{src.at('dp_shard_size')}: 'dp_shard_size: {shard}' with FSDP1; accelerate's "
                        f"ParallelismConfig, which axolotl turns on for it, runs only with FSDP2: add "
                        f"fsdp_version: 2.")
    if not job.engine.startswith("fsdp") or (n <= 1 and r <= 1):
        return  # replicas without FSDP are DDP's own
    cp = job.workload.sequence_parallel
    if n > 1:  # accelerate shards over the dp_shard x cp ranks (its dp_shard_cp mesh)
        job.shard_ranks = n * cp
    if r > 1:
        job.replicas = r
    group = f"{n * cp} ranks" if n > 1 else f"the ranks / {r}"
    with_cp = f" (dp_shard_size {n} x context_parallel_size {cp})" if n > 1 and cp > 1 else ""
    job.notes.append(f"FSDP shards over groups of {group}{with_cp}, replicated across any groups beyond it: each "
                     f"GPU is planned as one shard of its group (gradients are also all-reduced across the groups)")
    if job.nproc:
        job.shard_group(job.nproc * job.nnodes)  # sizes that cannot make the launched ranks exit 2 now


def _fsdp_engine(src: Source, distributed: bool) -> str | None:
    """FSDP's engine when `fsdp` (options) or `fsdp_config` asks for it, else None (`distributed`: over several
    ranks, where NO_SHARD is DDP)."""
    fsdp = src.get("fsdp") or []
    fsdp = fsdp.split() if isinstance(fsdp, str) else [str(x) for x in fsdp]
    fsdp_cfg = src.get("fsdp_config") or {}
    if not (fsdp or fsdp_cfg):
        return None
    # axolotl reads `fsdp_config` keys with or without their old `fsdp_` prefix (its examples now omit it)
    cfg = fsdp_settings(fsdp_cfg, src.at("fsdp_config"))
    offload = as_bool(cfg.get("offload_params", False)) or "offload" in fsdp
    # FSDP2 keeping the gathered weights from forward to backward is FSDP1's SHARD_GRAD_OP
    sharding = "shard_grad_op" if "shard_grad_op" in fsdp else fsdp_sharding(cfg, src.at("fsdp_config"))
    return fsdp_engine(sharding, offload, distributed)


def _targets(src: Source) -> str | list[str] | None:
    """`lora_target_modules`: a list of module names or one regular expression (a string), as axolotl takes it;
    a UserError for anything else (a number, a mapping), which axolotl's config validation refuses too."""
    targets = src.get("lora_target_modules")
    if targets is None or isinstance(targets, str):
        return targets
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        return targets
    raise UserError(f"{src.at('lora_target_modules')}: 'lora_target_modules' is {targets!r}; axolotl takes a list "
                    f"of module names (e.g. [q_proj, v_proj]) or one regular expression over module names.")


def _file_keys(src: Source, job: ForeignJob, w: Workload, shape: ModelShape, version: str) -> None:
    unplanned, effects = set(), {}
    targets = _targets(src)
    if targets and not src.flag("lora_target_linear"):
        effect = plan_targets(job, "lora_target_modules", targets, shape, version)
        if effect:
            effects["lora_target_modules"] = effect
        else:
            unplanned.add("lora_target_modules")
    elif targets:  # axolotl adds every linear layer to the modules named
        effects["lora_target_modules"] = "joined with the linear layers' names (lora_target_linear)"
    if src.flag("lora_target_linear") and job.workload.trains_adapters:
        # axolotl puts a string beside the linear names as one more name, not as a pattern
        plan_linear_names(job, "lora_target_linear", [targets] if isinstance(targets, str) else targets or [],
                          shape, version)
    if saved_names(src.get("lora_modules_to_save")) and job.workload.trains_adapters:
        effect = plan_saved(job, "lora_modules_to_save", saved_names(src.get("lora_modules_to_save")))
        effects["lora_modules_to_save"] = effect
        if not effect:
            unplanned.add("lora_modules_to_save")
    if optimizer(str(src.get("optimizer", "adamw_torch"))) is None:
        unplanned.add("optimizer")
    effects |= {key: "off" for key in ("load_in_4bit", "load_in_8bit") if key in src and not src.flag(key)}
    file_keys(job, src.items(), KEYS, w, effects=effects, unplanned=unplanned)


def _datasets(src: Source, job: ForeignJob) -> list[str]:
    data, missing = [], []
    for d in src.get("datasets") or []:
        p = str(d.get("path", "")) if isinstance(d, dict) else str(d)
        hit = local_file(p, src.path.parent)
        (data if hit else missing).append(hit or p)
    if missing:
        job.notes.append(f"datasets not found as local files (convert leaves them out): {', '.join(missing)}")
    return data


def _convert(src: Source) -> dict[str, Any]:
    out = settings(src, KEYS, "config")
    if src.flag("flex_attention") or "flex" in str(src.get("attn_implementation") or "").lower():
        out["attn_implementation"] = "flex_attention"  # planned as flash; some models (Llama 4) have no FA2
    # adapters on every linear layer unless lora_target_linear is off and modules are named
    targets = _targets(src)
    # a string is one regular expression over module names (peft's reading, and shardfit's)
    out["lora"]["targets"] = "all-linear" if src.flag("lora_target_linear") or not targets else targets
    return out
