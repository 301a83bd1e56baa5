"""Preflight rules on another tool's job, each finding said in that tool's keys (`shardfit check --from ...`).

The rule ids are shardfit's own where the problem is the same (device_map_in_distributed, predicted_oom, ...), so
a finding reads the same whichever tool the job came from."""

from __future__ import annotations

from collections.abc import Callable

from shardfit.check.findings import Finding
from shardfit.foreign.asplanned import ForeignPlan, reference_bytes
from shardfit.foreign.job import ForeignJob
from shardfit.plan.estimate import GIB
from shardfit.plan.precision import compute_bytes


def foreign_rules(fp: ForeignPlan) -> list[Finding]:
    """Every rule that applies to the job, in RULES' order; none fixes anything (the job is the tool's, not
    shardfit's)."""
    out: list[Finding] = []
    for rule in RULES:
        out += rule(fp, out)
    return out


def _zero3(job: ForeignJob) -> bool:
    return job.engine == "deepspeed" and job.zero is not None and job.zero.stage == 3


def _shards_params(job: ForeignJob) -> bool:
    """ZeRO-3 or FSDP full_shard: every parameter is partitioned across ranks."""
    return _zero3(job) or job.engine in ("fsdp_full_shard", "fsdp_offload")


def _device_map(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """A device map under a launcher, or with ZeRO-3: both refused by the libraries before training starts."""
    job, say, out = fp.job, fp.job.words.say, []
    launch = f"{job.nproc} ranks" + (f" ({job.launcher})" if job.launcher else "")
    if job.device_map and job.distributed:
        out.append(Finding(
            "device_map_in_distributed", "error", f"device_map={job.device_map}",
            f"the model is loaded with device_map={job.device_map!r} under {launch}: every rank splits its own copy "
            f"over all visible GPUs, and transformers/accelerate refuse to train it (\"You can't train a model that "
            f"has been loaded with device_map='auto' in any distributed mode\")",
            say("device_map", "load without device_map under a launcher")))
    if job.device_map and _zero3(job):
        out.append(Finding(
            "device_map_with_zero3", "error", f"device_map={job.device_map}",
            "a device map places whole layers on GPUs while ZeRO-3 partitions every parameter across ranks; "
            "DeepSpeed refuses the combination ('DeepSpeed Zero-3 is not compatible with low_cpu_mem_usage=True or "
            "with passing a device_map')", say("device_map", "remove device_map")))
    return out


def _unused_speech_modules(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """An Omni model's talker loaded for text training: never run, so sharded engines fail on it."""
    job, say = fp.job, fp.job.words.say
    if not job.speech_outputs:
        return []
    where = "env ENABLE_AUDIO_OUTPUT" if job.tool == "swift" else "model"
    if _shards_params(job):
        return [Finding(
            "unused_module", "error", where,
            f"{job.model}'s talker and token2wav (speech output) are loaded, but text training never runs them: "
            f"under {job.describe_engine()} their parameters are never gathered to the GPU and the first op "
            f"that meets them fails ('Expected all tensors to be on the same device, ... cuda:0 and cpu')",
            say("talker", "load the thinker only (Qwen2_5OmniThinkerForConditionalGeneration), or "
                          "model.disable_talker() before training"))]
    return [Finding(
        "unused_module", "warning", where,
        f"{job.model}'s talker and token2wav are loaded but never used by text training; they cost memory "
        f"on every GPU" + (" and DDP waits for gradients they never get" if job.workload.method == "full"
                           and job.engine == "ddp" else ""),
        say("talker", "load the thinker only, or model.disable_talker()"))]


def _replica_does_not_fit(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """A replicated engine (DDP, ZeRO-1/2, shard_grad_op) whose weights alone exceed one GPU."""
    job, z = fp.job, fp.job.zero
    replicated = job.engine in ("ddp", "single") or (job.engine == "deepspeed" and z is not None and z.stage < 3) \
        or job.engine == "fsdp_shard_grad_op"
    if not (replicated and job.distributed):
        return []
    w = job.workload
    # DeepSpeed keeps a 16-bit model (its fp32 masters are sharded); DDP a full fine-tune's fp32 weights
    per = 0.52 if w.method == "qlora" else 4 if w.method == "full" and job.engine != "deepspeed" else \
        compute_bytes(w)
    replica = fp.shape.params() * per / GIB
    if replica <= fp.hardware.gpu_mem_gib:
        return []
    return [Finding(
        "replica_does_not_fit", "error", job.describe_engine(),
        f"{job.describe_engine()} keeps the whole model on every GPU: its weights alone are {replica:.0f} "
        f"GiB, the GPU has {fp.hardware.gpu_mem_gib:.0f} GiB; more GPUs do not help",
        job.words.say("zero3", "ZeRO-3 (parameters sharded)") + " (parameters sharded across ranks)")]


def _predicted_oom(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """The job as configured does not fit (unless a replica that does not fit already says why)."""
    c = fp.configured
    if c.fits or any(f.rule == "replica_does_not_fit" for f in found):
        return []
    fix = "; or ".join(fp.would[:3]) if fp.would else "more or larger GPUs"
    return [Finding(
        "predicted_oom", "error", fp.job.describe_engine(),
        f"predicted {c.per_gpu_gib.total:.1f} GiB per GPU of {fp.hardware.gpu_mem_gib:.0f} as configured ({c.notes}; "
        f"peak in {c.peak_phase})", fix)]


def _reference_copy(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """A DPO/KTO job whose tool loads a second copy of the weights as the reference: whole on every GPU (ZeRO-0/1/2,
    DDP, a quantized copy under ZeRO-3), or partitioned beside the policy. shardfit keeps no copy."""
    job = fp.job
    ref = reference_bytes(job, fp.shape, job.workload, fp.hardware, job.engine, job.zero)
    if not ref:
        return []
    n = fp.hardware.world
    policy = fp.configured.per_gpu_gib.weights - ref.gpu / GIB
    if not ref.sharded and _shards_params(job):
        what = (f"its reference copy is not partitioned: {ref.gpu / GIB:.1f} GiB on every GPU while the policy's "
                f"weights are sharded over {n} ranks ({policy:.1f} GiB each)")
    elif not ref.sharded:
        what = (f"a second copy of the weights, {ref.gpu / GIB:.1f} GiB whole on every GPU"
                + (" (trl runs it at ZeRO stage 0 under ZeRO-1/2)" if job.engine == "deepspeed" else "")
                + f", beside the policy's {policy:.1f} GiB")
    else:
        where = f"{ref.host / GIB:.1f} GiB of host RAM per rank" if ref.host else f"{ref.gpu / GIB:.1f} GiB per GPU"
        what = f"a second copy of the weights, partitioned over {n} ranks: {where}"
    say = job.words.say
    tool_way = say("ref_precompute", "")
    lora = "" if job.reference is None or job.reference.with_adapters else \
        f"; or {say('lora', 'LoRA')} (the reference is then the adapters switched off)"
    fix = (f"shardfit convert --from {job.tool} {job.source} (shardfit computes the reference log-probabilities once "
           f"before step 1 and keeps no copy){lora}" + (f"; or {tool_way}" if tool_way else ""))
    return [Finding(
        "reference_copy", "warning" if fp.configured.fits else "error", f"objective {job.workload.objective}",
        f"{job.reference.why if job.reference else ''}: {what}", fix)]


def _quantized_storage(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """QLoRA's uint8 weights under an engine that partitions float tensors of one dtype."""
    job = fp.job
    if not (job.workload.method == "qlora" and _shards_params(job) and not job.quant_storage):
        return []
    return [Finding(
        "fsdp_quantized_storage", "error", job.describe_engine(),
        "4-bit bitsandbytes weights are stored as uint8; ZeRO-3 and FSDP partition float tensors of one dtype, "
        "so the quantized layers cannot be sharded" + (" (Qwen's finetune.py: 'FSDP or ZeRO3 are incompatible "
                                                       "with QLoRA')" if job.tool == "hf" else ""),
        job.words.say("quant_storage",
                      "store the 4-bit weights in the compute dtype: bnb_4bit_quant_storage=bfloat16"))]


def _reentrant_under_ddp(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    job = fp.job
    if not (job.engine == "ddp" and job.reentrant_ckpt and job.find_unused):
        return []
    return [Finding(
        "gc_ddp_reentrant", "error", "gradient checkpointing",
        "reentrant gradient checkpointing under DDP with find_unused_parameters: backward re-runs each block and "
        "DDP marks its parameters ready twice ('Expected to mark a variable ready only once')",
        job.words.say("reentrant", "non-reentrant checkpointing (use_reentrant: false)")
        + ", or ddp_find_unused_parameters false")]


def _device_map_split(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    """One process over several GPUs: slow, and remote code whose loss is not device-safe fails."""
    job, say = fp.job, fp.job.words.say
    if job.engine != "device_map":
        return []
    n = job.gpus or fp.hardware.gpus_per_node
    out = [Finding(
        "device_map_split", "info", f"device_map={job.device_map or 'auto'}",
        f"one process splits the model over {n} GPUs: one GPU computes at a time (the most loaded one needs "
        f"{fp.configured.per_gpu_gib.total:.1f} GiB); it trains, but at the speed of one GPU",
        say("ranks", f"shardfit: strategy zero3 over {n} ranks") + " is faster when it fits (the plan shows "
        "both)")]
    # ChatGLM's remote code (model_type chatglm: ChatGLM2/3, GLM-4-9B); transformers' own GLM classes (glm,
    # glm4, glm4_moe) move the labels to the logits' device like every native model.
    if job.tool in ("hf", "swift") and fp.shape.model_type == "chatglm":
        out.append(Finding(
            "device_map_cross_device", "warning", "loss",
            f"{job.model}'s remote code computes the loss on the last GPU's logits with labels left on the first "
            "GPU: 'Expected all tensors to be on the same device, cuda:N and cuda:0'",
            "move labels to the logits' device in the loss (transformers' own models do), or train with "
            "shardfit's model_parallel, whose loss is device-safe"))
    return out


def _not_modelled(fp: ForeignPlan, found: list[Finding]) -> list[Finding]:
    job = fp.job
    if not job.not_modelled:
        return []
    return [Finding(
        "not_modelled", "info", job.source,
        f"{len(job.not_modelled)} key(s) read but not modelled by the planner: "
        + ", ".join(sorted(job.not_modelled)), "check their memory effect by hand, or ask for them in shardfit")]


# Each rule sees the plan and the findings before it (predicted_oom stays quiet after replica_does_not_fit).
RULES: tuple[Callable[[ForeignPlan, list[Finding]], list[Finding]], ...] = (
    _device_map, _unused_speech_modules, _replica_does_not_fit, _predicted_oom, _reference_copy, _quantized_storage,
    _reentrant_under_ddp, _device_map_split, _not_modelled)
