"""Read another tool's job: `shardfit plan|check|convert --from TOOL FILE`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from shardfit import objective as objectives
from shardfit.errors import UserError
from shardfit.foreign.axolotl import read_axolotl
from shardfit.foreign.common import (
    default_attention,
    default_optim,
    eight_bit_words,
    hf_loss,
    load_yaml,
    multi_tensor_step,
    named_sdpa,
    parse_json,
    read_text,
    step_keys,
)
from shardfit.foreign.deepspeed import read_deepspeed
from shardfit.foreign.hf import read_hf
from shardfit.foreign.job import TOOL_NAMES, TOOLS, ForeignJob, Words
from shardfit.foreign.keys import Source
from shardfit.foreign.lf_megatron import is_megatron, refuse_megatron
from shardfit.foreign.llamafactory import read_llamafactory
from shardfit.foreign.llamafactory_v1 import is_v1, read_llamafactory_v1
from shardfit.foreign.swift import read_swift
from shardfit.foreign.targets import plan_all_linear
from shardfit.plan.deepspeed import as_deepspeed_runs
from shardfit.plan.hardware import Hardware
from shardfit.plan.sdpa_classes import installed_transformers, release_of, sdpa_refusal
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.workload import Workload
from shardfit.resolve.dims import ParallelDims
from shardfit.resolve.experts_rules import check_ep_model
from shardfit.resolve.sequence import check_model, facts_of_shape

# Each tool's key for the rows of one micro-batch on one rank.
BATCH_KEYS = {"llamafactory": "per_device_train_batch_size", "swift": "--per_device_train_batch_size",
              "axolotl": "micro_batch_size", "hf": "--per_device_train_batch_size",
              "deepspeed": "train_micro_batch_size_per_gpu"}
# The tools' keys that split each row over ranks, and that share each block's experts over them.
SEQUENCE_KEYS = ("sequence_parallel_size", "context_parallel_size", "sequence_parallel_degree", "cp_size")
EXPERT_KEYS = ("expert_parallel_size", "dist_config.ep_size")


@dataclasses.dataclass
class JobOptions:
    """What the command line adds to a job file: the model and shape of a bare DeepSpeed JSON, the ranks, and
    the transformers version whose loss to plan (default: the installed one)."""

    model: str | None = None
    nproc: int | None = None
    seq: int | None = None
    batch: int | None = None
    method: str | None = None
    grad_ckpt: str | None = None
    transformers: str | None = None
    gpus: Hardware | None = None  # --gpus: the GPUs a launcher that takes every visible one starts ranks on
    # `plan`'s --frozen-fp32 and --bnb-compute-fp32, for the tools whose training script, not the tool, prepares the
    # model (hf, deepspeed: cli/plan_args.py `FROM_SCRIPT_FLAGS`): what the script does that the file does not say
    frozen_fp32: bool | None = None
    bnb_compute_fp32: bool | None = None
    # `plan`'s workload flags a script job's file may leave unsaid (SCRIPT_SETTABLE), by Workload field
    workload: dict[str, object] = dataclasses.field(default_factory=dict)


# The Workload fields `plan --from hf|deepspeed` takes from the command line where the file does not say them
# (the training script decides), with the HF Trainer keys that say each in a file: there the flag is refused.
SCRIPT_SETTABLE = {"lora_rank": ("lora_r", "lora_rank"), "lora_dropout": ("lora_dropout",),
                   "attention": ("attn_implementation",), "optimizer": ("optim",), "loss": ("use_liger_kernel",)}


def _shape_of(model: str) -> ModelShape:
    try:
        return resolve_shape(model)
    except UserError as e:
        raise UserError(f"{e} (the job's model; for a model that is neither local nor in the catalog, pass a local "
                        f"config.json with --model)") from None


def _read_llamafactory(path: Path, version: str, opts: JobOptions, shape_of: Callable[[str], ModelShape]) -> ForeignJob:
    """Any LLaMA-Factory YAML: a Megatron one is refused with the plan of its split, a v1 one read by its reader,
    and the rest by the v0 reader."""
    top, lines = load_yaml(path, nested=True)  # read once: each reader takes the mapping
    if is_megatron(top):
        raise refuse_megatron(Source(path, top, list(top), {k: n for k, n in lines.items() if "." not in k}),
                              opts.nproc, opts.gpus)
    if is_v1(top):
        return read_llamafactory_v1(path, (top, lines), opts.nproc, shape_of, opts.gpus)
    return read_llamafactory(path, version, opts.nproc, shape_of, (top, lines))


def read_job(tool: str, file: str, opts: JobOptions) -> ForeignJob:
    """The job of `file` as `tool` would run it, with the command line's additions."""
    if tool not in TOOLS:
        raise UserError(f"--from {tool}: choose one of {', '.join(TOOLS)}.")
    path = Path(file)
    if not path.is_file():
        raise UserError(f"--from {tool}: file not found: {file}. Give the tool's config file (or the shell script "
                        f"that runs it).")
    version = opts.transformers or installed_transformers()
    def shape_of(model: str) -> ModelShape:  # --model names the model when the file's is not at hand
        return _shape_of(opts.model or model)

    if tool == "llamafactory":
        job = _read_llamafactory(path, version, opts, shape_of)
    elif tool == "swift":
        job = read_swift(path, shape_of, version, opts.nproc)
    elif tool == "axolotl":
        job = read_axolotl(path, shape_of, version, opts.nproc)
    elif tool == "hf":
        job = read_hf(path, shape_of, version, opts.nproc, opts.model, opts.seq, opts.batch,
                      opts.workload.get("optimizer"))
    else:
        job = _read_bare_deepspeed(path, opts, version)
    if opts.model is not None:
        job.model = opts.model
    if job.workload.lora_targets is None and job.workload.trains_adapters:  # all-linear, or every linear layer
        plan_all_linear(job, shape_of(job.model), version)
    overrides = {"seq_len": opts.seq, "micro_batch": opts.batch, "method": opts.method, "grad_ckpt": opts.grad_ckpt}
    job.workload = dataclasses.replace(job.workload, **{k: v for k, v in overrides.items() if v is not None})
    _workload_flags(job, opts)
    _script_flags(job, opts)
    # transformers 5 fuses every mixture's routed experts into 3-D weights, which bitsandbytes' 4-bit loading
    # leaves unquantized (plan/precision.py `experts_stay_16bit`); transformers 4 builds an nn.Linear per expert
    job.workload = dataclasses.replace(job.workload, fused_experts=release_of(version) >= (5, 0))
    if job.attention_unset and opts.workload.get("attention") is None:  # --attention says what the script runs
        shape = shape_of(job.model)  # the text model's class picks the decoder's kernel
        job.workload = dataclasses.replace(job.workload, attention=default_attention(
            version, shape.text_model_type or shape.model_type, job.notes))
    elif job.workload.attention == "sdpa" and (named := named_sdpa(job.keys)) is not None:
        shape = shape_of(job.model)
        refusal = sdpa_refusal(shape.model_type, f"{job.source}: '{named[0]}: {named[1]}'", named[2], version,
                               text_type=shape.text_model_type)
        if refusal is not None:  # transformers refuses to load the class with SDPA
            raise UserError(refusal)
    cast = as_deepspeed_runs(job.workload) if job.engine == "deepspeed" else job.workload
    if cast != job.workload:
        job.workload = cast
        job.notes.append(f"DeepSpeed {job.workload.precision} casts the weights peft's k-bit preparation upcast "
                         "to fp32 back to 16 bits (engine.py _cast_module_mixed_precision): planned in "
                         f"{job.workload.precision}")
    if opts.gpus is not None:  # the ranks a launch that takes every GPU starts, before the checks that count ranks
        launch_on(job, opts.gpus.gpus_per_node)
    _check_split(job, shape_of)
    _check_micro_batch(job, opts)
    job.notes.append(f"loss as transformers {version} computes it" +
                     (" (fused kernel: no full logits)" if job.workload.loss == "chunked" else ""))
    return job


def _workload_flags(job: ForeignJob, opts: JobOptions) -> None:
    """`plan`'s --lora-rank, --lora-dropout, --attention, --optimizer and --loss on a job whose training script
    decides them (`SCRIPT_SETTABLE`), applied as --seq is; a UserError naming the file's key where the file says
    it (the plan reads it from there), or where the job has no adapters for a LoRA flag."""
    given = {k: v for k, v in opts.workload.items() if v is not None}
    for field, value in given.items():
        flag = f"--{field.replace('_', '-')} {value}"
        said = [k for k in SCRIPT_SETTABLE[field] if k in job.keys or k in job.not_modelled]
        if field == "optimizer" and job.zero is not None and job.zero.ds_optimizer:  # the JSON's section steps
            said = [next((k for k in job.keys if k.startswith("optimizer")), "optimizer")]
        if said:
            raise UserError(f"{flag} with {job.source}: the file says it ({said[0]} "
                            f"{job.keys.get(said[0], job.not_modelled.get(said[0], ''))}".rstrip() +
                            f"), and the plan reads it from there. Change {said[0]} in the file, or drop the flag.")
        if field.startswith("lora_") and not job.workload.trains_adapters:
            raise UserError(f"{flag} with {job.source}: the job is method {job.workload.method}, without adapters; "
                            f"add --method lora or qlora, or drop the flag.")
    job.workload = dataclasses.replace(job.workload, **given)
    job.notes += [f"--{k.replace('_', '-')} {v}: as the training script runs it (the file does not say)"
                  for k, v in given.items()]


def _script_flags(job: ForeignJob, opts: JobOptions) -> None:
    """--frozen-fp32 and --bnb-compute-fp32 on a job whose script prepares the model: what the script does after
    loading, which the file does not say, applied where the reader left the default (before DeepSpeed's cast,
    which undoes the fp32 upcast as it does peft's). A UserError where the job has nothing the flag could change."""
    w = job.workload
    if opts.frozen_fp32:
        if w.method == "full":
            raise UserError(f"--frozen-fp32 keeps frozen weights in fp32, but {job.source} is a full fine-tune: every "
                            "weight trains (fp32 masters already). Drop the flag, or plan the adapters' run with "
                            "--method lora or qlora.")
        _refuse_cast_back(job, w)
        if job.tool == "hf" and w.method == "qlora" and w.adapters_16bit:
            # only trl_kbit makes a Trainer job's adapters 16-bit: the flag plans the older TRL its note names,
            # which prepared the model and left the adapters and modules_to_save copies in fp32 too
            job.notes.append("--frozen-fp32: planned as older TRL ran it, prepare_model_for_kbit_training without "
                             "TRL's bf16 cast: frozen embeddings, norms and head, the adapters and the saved copies "
                             "in fp32")
            w = dataclasses.replace(w, frozen_fp32=True, adapters_16bit=False, lora_saved_dtype="loaded")
        else:
            job.notes.append("--frozen-fp32: frozen embeddings, norms and head planned in fp32, as the script's "
                             "prepare_model_for_kbit_training leaves them" + (" (as read already)" if w.frozen_fp32
                                                                              else ""))
            w = dataclasses.replace(w, frozen_fp32=True)
    if opts.bnb_compute_fp32:
        if w.method != "qlora":
            raise UserError(f"--bnb-compute-fp32 sets bitsandbytes' 4-bit compute dtype, but {job.source} is method "
                            f"{w.method}, without 4-bit weights: add --method qlora (the script loads the model with "
                            "a BitsAndBytesConfig), or drop the flag.")
        job.notes.append("--bnb-compute-fp32: bitsandbytes computes in fp32 (the script's BitsAndBytesConfig without "
                         "bnb_4bit_compute_dtype)")
        # the flag names bitsandbytes' kernel: a bare DeepSpeed JSON's 4-bit weights are then bitsandbytes' too
        w = dataclasses.replace(w, bnb_compute_fp32=True, quant_backend="bnb")
    job.workload = w


def _refuse_cast_back(job: ForeignJob, w: Workload) -> None:
    """A UserError for --frozen-fp32 on a DeepSpeed job whose engine casts every weight back to its 16-bit dtype
    (`as_deepspeed_runs`): the flag could change nothing there, and planning it would say fp32 and plan 16 bits."""
    if job.engine != "deepspeed" or as_deepspeed_runs(dataclasses.replace(w, frozen_fp32=True)).frozen_fp32:
        return
    raise UserError(f"--frozen-fp32 with {job.source}: DeepSpeed {w.precision} casts every floating-point weight "
                    f"back to {w.precision} at deepspeed.initialize (engine.py _cast_module_mixed_precision), so "
                    f"what prepare_model_for_kbit_training upcast to fp32 is {w.precision} again, as the plan has "
                    f"it. Drop the flag.")


def launch_on(job: ForeignJob, gpus_per_node: int) -> None:
    """The ranks of a job whose launch does not say them, on nodes of `gpus_per_node` GPUs: `llamafactory-cli
    train` starts torchrun itself over every visible GPU when it sees more than one (or with FORCE_TORCHRUN), and
    `accelerate launch` without --num_processes or a config file starts one process per visible GPU
    (commands/launch.py `_validate_launch_command`: torch.cuda.device_count()), so each runs one rank per GPU, not
    one process."""
    if job.nproc is not None or gpus_per_node < 2 or not (job.tool == "llamafactory" or job.every_gpu):
        return
    job.nproc = gpus_per_node
    if job.engine == "single":
        job.engine = "ddp"
    if job.every_gpu:
        job.notes.append(f"accelerate launch without --num_processes starts one process per visible GPU: planned "
                         f"as {gpus_per_node} ranks (--num_processes 1, or --nproc 1 here, for one process)")
        return
    job.launcher = "torchrun"
    cli = job.words.say("launch", "llamafactory-cli train").removeprefix("FORCE_TORCHRUN=1 ")
    job.notes.append(f"{cli} starts torchrun over all {gpus_per_node} visible GPUs itself: planned as "
                     f"{gpus_per_node} ranks (CUDA_VISIBLE_DEVICES=0, or --nproc 1 here, for one process)")


def kto_batch_problem(tool: str, objective: str, micro_batch: int, total_batch: int) -> str | None:
    """Why `tool` refuses to train objective `objective` at `micro_batch` rows a micro-batch (`total_batch` rows an
    optimizer step over all ranks), or None. Each tool decides for itself: axolotl and the HF Trainer run TRL's
    KTOTrainer, which refuses a micro-batch of 1 (its KL pair is shifted within the micro-batch); LLaMA-Factory's
    KTO trainer skips TRL's check and pairs rows when it preprocesses the data, so it runs any batch; ms-swift
    also skips TRL's check and shifts the pairs within the whole step's batch, refusing only a total of 1."""
    if objective != "kto":
        return None
    if tool == "llamafactory":
        return None
    if tool == "swift":
        if total_batch > 1:
            return None
        return (f"ms-swift shifts KTO's KL pairs within the total batch (ranks x per-device batch x accumulation "
                f"= {total_batch}), and refuses a total of 1")
    problem = objectives.micro_batch_problem(objective, micro_batch)
    return None if problem is None else f"{problem} (TRL's KTOTrainer, which {TOOL_NAMES[tool]} runs, refuses it too)"


def _check_micro_batch(job: ForeignJob, opts: JobOptions) -> None:
    """A batch the job's own tool refuses for its objective (`kto_batch_problem`), refused when the job is read, so
    plan, check and convert refuse it alike. convert writes a micro-batch shardfit can train where the tool's
    rule is looser than shardfit's (to_config)."""
    w = job.workload
    total = (job.nproc or 1) * job.nnodes * w.micro_batch * w.grad_accum
    problem = kto_batch_problem(job.tool, w.objective, w.micro_batch, total)
    if problem is None:
        return
    key = "--batch" if opts.batch is not None else BATCH_KEYS[job.tool]
    raise UserError(f"{job.source}: {key} {w.micro_batch} with objective {w.objective}: {problem}. Set {key} to 2 "
                    f"or more (with fewer gradient accumulation steps for the same global batch); plan --from ... "
                    f"--batch 2 plans that.")


def _read_bare_deepspeed(path: Path, opts: JobOptions, version: str) -> ForeignJob:
    """A DeepSpeed JSON on its own: the model, sequence and method come from the command line."""
    if opts.model is None:
        raise UserError(f"--from deepspeed {path}: a DeepSpeed JSON does not name the model; pass --model ID_OR_PATH "
                        f"(and --seq, --batch, --method as the job runs).")
    shape = _shape_of(opts.model)
    raw = parse_json(read_text(path), str(path))
    ds = read_deepspeed(raw, str(path), shape.hidden)
    optim, assumed = default_optim(None, version) if not ds.zero.ds_optimizer else ("adamw_torch_fused", None)
    w = Workload(method=opts.method or "full", precision=ds.precision or "bf16", seq_len=opts.seq or 2048,
                 micro_batch=opts.batch or ds.micro_batch or 1, grad_ckpt="full", optimizer=ds.optimizer or "adamw",
                 loss=hf_loss(version, False), grad_accum=ds.grad_accum or 1,
                 # a torch optimizer DeepSpeed builds by name other than Adam: its default multi-tensor step
                 fused_adamw=not multi_tensor_step(optim) and ds.optimizer in (None, "adamw"),
                 no_8bit_form=ds.zero.ds_optimizer, **step_keys(optim, version))
    words = Words(zero={"zero2": "zero_optimization.stage: 2", "zero3": "zero_optimization.stage: 3",
                        "zero3_offload": "zero_optimization.stage: 3 with offload_optimizer and offload_param "
                                         "{device: cpu}"},
                  keys={"micro_batch": "train_micro_batch_size_per_gpu: 1 with gradient_accumulation_steps",
                        "seq": "--seq", "grad_ckpt": "gradient checkpointing in the training script",
                        "lora": "--method lora", "qlora": "--method qlora",
                        "nodes": "deepspeed --num_nodes {} --hostfile HOSTFILE",
                        **eight_bit_words("optim=\"{}\" in the training script's TrainingArguments")})
    job = ForeignJob("deepspeed", str(path), opts.model, w, engine="deepspeed", zero=ds.zero, nproc=opts.nproc,
                     keys=ds.keys, not_modelled=ds.not_modelled, words=words)
    job.notes.append("gradient checkpointing assumed on (the training script decides; pass --grad-ckpt none to plan "
                     "without)")
    if assumed:  # no optimizer section: the script's optimizer steps, planned as the HF Trainer's default
        job.notes.append(assumed)
    job.attention_unset = True  # the training script decides it: transformers' default, as read_job plans it
    return job


def _check_split(job: ForeignJob, shape_of: Callable[[str], ModelShape]) -> None:
    """A job's sequence or expert parallel size against its model (heads and experts that share out) and, when the
    launch says them, its ranks: a UserError naming the tool's key, as `plan --model` refuses the same split."""
    sp, ep = job.workload.sequence_parallel, job.workload.expert_parallel
    sp_key = next((k for k in SEQUENCE_KEYS if k in job.keys), "sequence parallel size")
    ep_key = next((k for k in EXPERT_KEYS if k in job.keys), "expert parallel size")
    for key, n in ((sp_key, sp), (ep_key, ep)):
        if n < 1:
            raise UserError(f"{job.source}: {key} {n}: a count of ranks, at least 1 (1: no split).")
    if sp == 1 and ep == 1:
        return
    shape = shape_of(job.model)
    checks: list[tuple[str, int, Callable[[], None]]] = [
        (sp_key, sp, lambda: check_model(sp, facts_of_shape(shape), job.model)),
        (ep_key, ep, lambda: check_ep_model(ep, shape.experts, job.model, every_expert=shape.every_expert))]
    # ms-swift without NPROC_PER_NODE runs one process; axolotl's YAML does not say how it is launched
    if job.nproc is not None or job.tool == "swift":
        world = (job.nproc or 1) * job.nnodes
        checks += [(sp_key, sp, lambda: ParallelDims(world=world, sp=sp).check()),
                   (ep_key, ep, lambda: ParallelDims(world=world, sp=sp, ep=ep).check())]
    for key, n, check in checks:
        if n > 1:
            try:
                check()
            except UserError as e:
                raise UserError(f"{job.source}: {key} {n}: {e}") from None
