"""Preflight rules on another tool's job, each finding said in that tool's keys (`shardfit check --from ...`).

The rule ids are shardfit's own where the problem is the same (device_map_in_distributed, predicted_oom, ...), so
a finding reads the same whichever tool the job came from."""

from __future__ import annotations

from shardfit.check.findings import Finding
from shardfit.foreign.asplanned import ForeignPlan
from shardfit.plan.estimate import GIB, compute_bytes


def foreign_rules(fp: ForeignPlan) -> list[Finding]:
    """Every rule that applies to the job; none fixes anything (the job is the tool's, not shardfit's)."""
    job, hw = fp.job, fp.hardware
    say = job.words.say
    out: list[Finding] = []
    z = job.zero
    zero3 = job.engine == "deepspeed" and z is not None and z.stage == 3
    sharded_params = zero3 or job.engine in ("fsdp_full_shard", "fsdp_offload")
    launch = f"{job.nproc} ranks" + (f" ({job.launcher})" if job.launcher else "")
    if job.device_map and job.distributed:
        out.append(Finding(
            "device_map_in_distributed", "error", f"device_map={job.device_map}",
            f"the model is loaded with device_map={job.device_map!r} under {launch}: every rank splits its own copy "
            f"over all visible GPUs, and transformers/accelerate refuse to train it (\"You can't train a model that "
            f"has been loaded with device_map='auto' in any distributed mode\")",
            say("device_map", "load without device_map under a launcher")))
    if job.device_map and zero3:
        out.append(Finding(
            "device_map_with_zero3", "error", f"device_map={job.device_map}",
            "a device map places whole layers on GPUs while ZeRO-3 partitions every parameter across ranks; "
            "DeepSpeed refuses the combination ('DeepSpeed Zero-3 is not compatible with low_cpu_mem_usage=True or "
            "with passing a device_map')", say("device_map", "remove device_map")))
    if job.speech_outputs:
        where = "env ENABLE_AUDIO_OUTPUT" if job.tool == "swift" else "model"
        if sharded_params:
            out.append(Finding(
                "unused_module", "error", where,
                f"{job.model}'s talker and token2wav (speech output) are loaded, but text training never runs them: "
                f"under {job.describe_engine()} their parameters are never gathered to the GPU and the first op "
                f"that meets them fails ('Expected all tensors to be on the same device, ... cuda:0 and cpu')",
                say("talker", "load the thinker only (Qwen2_5OmniThinkerForConditionalGeneration), or "
                              "model.disable_talker() before training")))
        else:
            out.append(Finding(
                "unused_module", "warning", where,
                f"{job.model}'s talker and token2wav are loaded but never used by text training; they cost memory "
                f"on every GPU" + (" and DDP waits for gradients they never get" if job.workload.method == "full"
                                   and job.engine == "ddp" else ""),
                say("talker", "load the thinker only, or model.disable_talker()")))
    replicated = job.engine in ("ddp", "single") or (job.engine == "deepspeed" and z is not None and z.stage < 3) \
        or job.engine == "fsdp_shard_grad_op"
    if replicated and job.distributed:
        w = job.workload
        # DeepSpeed keeps a 16-bit model (its fp32 masters are sharded); DDP a full fine-tune's fp32 weights
        per = 0.52 if w.method == "qlora" else 4 if w.method == "full" and job.engine != "deepspeed" else \
            compute_bytes(w)
        replica = fp.shape.params() * per / GIB
        if replica > hw.gpu_mem_gib:
            out.append(Finding(
                "replica_does_not_fit", "error", job.describe_engine(),
                f"{job.describe_engine()} keeps the whole model on every GPU: its weights alone are {replica:.0f} "
                f"GiB, the GPU has {hw.gpu_mem_gib:.0f} GiB; more GPUs do not help",
                say("zero3", "ZeRO-3 (parameters sharded)") + " (parameters sharded across ranks)"))
    c = fp.configured
    if not c.fits and not any(f.rule == "replica_does_not_fit" for f in out):
        fix = "; or ".join(fp.would[:3]) if fp.would else "more or larger GPUs"
        out.append(Finding(
            "predicted_oom", "error", job.describe_engine(),
            f"predicted {c.per_gpu_gib.total:.1f} GiB per GPU of {hw.gpu_mem_gib:.0f} as configured ({c.notes}; "
            f"peak in {c.peak_phase})", fix))
    if job.workload.method == "qlora" and sharded_params and not job.quant_storage:
        out.append(Finding(
            "fsdp_quantized_storage", "error", job.describe_engine(),
            "4-bit bitsandbytes weights are stored as uint8; ZeRO-3 and FSDP partition float tensors of one dtype, "
            "so the quantized layers cannot be sharded" + (" (Qwen's finetune.py: 'FSDP or ZeRO3 are incompatible "
                                                           "with QLoRA')" if job.tool == "hf" else ""),
            say("quant_storage", "store the 4-bit weights in the compute dtype: bnb_4bit_quant_storage=bfloat16")))
    if job.engine == "ddp" and job.reentrant_ckpt and job.find_unused:
        out.append(Finding(
            "gc_ddp_reentrant", "error", "gradient checkpointing",
            "reentrant gradient checkpointing under DDP with find_unused_parameters: backward re-runs each block and "
            "DDP marks its parameters ready twice ('Expected to mark a variable ready only once')",
            say("reentrant", "non-reentrant checkpointing (use_reentrant: false)")
            + ", or ddp_find_unused_parameters false"))
    if job.engine == "device_map":
        n = job.gpus or hw.gpus_per_node
        out.append(Finding(
            "device_map_split", "info", f"device_map={job.device_map or 'auto'}",
            f"one process splits the model over {n} GPUs: one GPU computes at a time (the most loaded one needs "
            f"{c.per_gpu_gib.total:.1f} GiB); it trains, but at the speed of one GPU",
            say("ranks", f"shardfit: strategy zero3 over {n} ranks") + " is faster when it fits (the plan shows "
            "both)"))
        if job.tool in ("hf", "swift") and ("glm" in job.model.lower() or "chatglm" in job.model.lower()):
            out.append(Finding(
                "device_map_cross_device", "warning", "loss",
                f"{job.model}'s remote code computes the loss on the last GPU's logits with labels left on the first "
                "GPU: 'Expected all tensors to be on the same device, cuda:N and cuda:0'",
                "move labels to the logits' device in the loss (transformers' own models do), or train with "
                "shardfit's model_parallel, whose loss is device-safe"))
    if job.not_modelled:
        out.append(Finding(
            "not_modelled", "info", job.source,
            f"{len(job.not_modelled)} key(s) read but not modelled by the planner: "
            + ", ".join(sorted(job.not_modelled)), "check their memory effect by hand, or ask for them in shardfit"))
    return out
