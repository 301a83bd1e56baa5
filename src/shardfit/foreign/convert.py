"""`shardfit convert --from TOOL FILE`: the shardfit config of the same job, as YAML with what could not be
carried over said in comments at the top."""

from __future__ import annotations

from typing import Any

import yaml

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.errors import UserError
from shardfit.foreign.job import TOOL_NAMES, ForeignJob
from shardfit.foreign.keys import EPOCH_KEYS, fractional_epochs
from shardfit.plan.adapters import adapts_experts
from shardfit.plan.shapes import ModelShape, resolve_shape

ATTN = {"flash": "flash_attention_2", "eager": "eager", "sdpa": "auto"}


def to_config(job: ForeignJob) -> dict[str, Any]:
    """shardfit config keys (config/schema.py) for the job; a UserError for a job no shardfit objective trains
    as configured (`ForeignJob.unconvertible`)."""
    if job.unconvertible:
        raise UserError(f"{job.source}: cannot convert: {job.unconvertible}.")
    w = job.workload
    cfg: dict[str, Any] = {"model": job.model,
                           "data": (job.data[0] if len(job.data) == 1 else job.data) or "data/train.jsonl",
                           "method": w.method, "strategy": job.strategy, "precision": w.precision,
                           "max_seq_len": w.seq_len, "micro_batch": w.micro_batch, "grad_accum": w.grad_accum,
                           "grad_ckpt": w.grad_ckpt, "attn_implementation": ATTN[w.attention]}
    extra = dict(job.convert)
    lora = {"rank": w.lora_rank, **extra.pop("lora", {})}
    lora["rank"] = w.lora_rank
    if methods.get(w.method).adapters:
        cfg["lora"] = lora
        mixture = _mixture(job)
        if "experts" not in lora and mixture is not None and not adapts_experts(mixture, w):
            # the tool's adapters reach no routed expert (plan/adapters.py `adapts_experts`), while shardfit's
            # trainer would otherwise add every expert's adapters
            lora["experts"] = False
        if lora.get("dropout", 0) > 0 and lora.get("experts", True) and mixture is not None:
            # the fused experts' adapters (peft's target_parameters) take no dropout: keeping which weights train
            # matters more to the result than the regularizer, and the header says how to keep it instead
            lora["dropout"] = 0.0
    cfg.update(extra)
    if cfg.get("sequence_parallel", 1) > 1:  # shardfit's Ulysses runs its own attention around SDPA
        cfg["attn_implementation"] = "auto"
    if _splits(cfg):
        # shardfit's sequence and expert parallelism run uncompiled blocks, on several ranks: a launch that does
        # not say its ranks (axolotl's) would otherwise convert as `single`, which check refuses with a split
        if cfg.get("compile") is True:
            cfg["compile"] = False
        if cfg["strategy"] == "single":
            cfg["strategy"] = "auto"
    if job.engine == "device_map":
        cfg["device_map"] = "auto"
    if objectives.micro_batch_problem(w.objective, w.micro_batch):
        # the tool trains this batch (its rule is looser, read.kto_batch_problem); shardfit's KTO needs two rows a
        # micro-batch, so the same rows a step go two at a time with half the accumulation
        cfg["micro_batch"] = 2
        cfg["grad_accum"] = max(1, w.micro_batch * w.grad_accum // 2)
    return cfg


def _mixture(job: ForeignJob) -> ModelShape | None:
    """The job's model's shape where it is a mixture of experts; None for a dense model or one not at hand (the
    converted config then keeps shardfit's defaults)."""
    try:
        shape = resolve_shape(job.model)
    except UserError:
        return None
    return shape if shape.moe else None


def comments(job: ForeignJob, cfg: dict[str, Any]) -> list[str]:
    """What the YAML's header says: the source, and everything not carried over."""
    out = [f"converted by shardfit from {job.tool}: {job.source}",
           f"{job.describe_engine()} -> strategy: {cfg['strategy']}"]
    if _splits(cfg) and job.convert.get("compile") is True:
        out.append("compile: false: shardfit's sequence and expert parallelism run uncompiled blocks")
    if _splits(cfg) and job.strategy == "single":
        out.append("strategy: auto: the job splits over ranks its launch does not say; run it with "
                   "shardfit train --nproc N")
    if not job.data:
        out.append("data: no local file found in the job; replace data/train.jsonl with your data")
    if job.device_map and job.distributed:
        out.append(f"device_map={job.device_map} dropped: shardfit never uses a device map under a launcher")
    if job.zero is not None and job.zero.stage == 3 and job.zero.offload_optimizer and not job.zero.offload_param:
        out.append("ZeRO-3 with only the optimizer offloaded: zero3_offload keeps parameters on the host too")
    if job.zero is not None and job.zero.stage in (0, 1):
        out.append(f"ZeRO-{job.zero.stage} shards no parameters or gradients: closest is ddp")
    if (epochs := fractional_epochs(job.keys)) is not None:
        out.append(epochs)
    elif "epochs" in cfg and not any(k in job.keys for k in EPOCH_KEYS):
        out.append(f"epochs {cfg['epochs']}: {TOOL_NAMES[job.tool]}'s default, as the job names no epoch count")
    if job.workload.optimizer != "adamw":
        out.append(f"optimizer {job.workload.optimizer}: shardfit trains with AdamW")
    if job.workload.method == "qlora":
        out.append("method qlora: shardfit stores the frozen weights in NF4 itself (torchao), not with bitsandbytes")
    if job.workload.loss != "chunked":
        out.append("loss: shardfit always uses its chunked loss (no full logits), whatever the tool ran")
    if job.reference is not None and job.keeps_reference():
        out.append(f"{TOOL_NAMES[job.tool]} keeps a reference model beside the policy ({job.reference.why}); "
                   f"shardfit keeps none: {_reference_way(cfg)}")
    if cfg["micro_batch"] != job.workload.micro_batch:
        out.append(f"micro_batch {job.workload.micro_batch} -> {cfg['micro_batch']} with grad_accum "
                   f"{job.workload.grad_accum} -> {cfg['grad_accum']}: shardfit's {job.workload.objective} needs two "
                   f"rows a micro-batch; the rows a step stay the same (one fewer for an odd count)")
    if "lora" in cfg and cfg["lora"].get("dropout") == 0 and (asked := job.convert.get("lora", {}).get("dropout")):
        out.append(f"lora.dropout {asked:g} -> 0: this mixture's fused routed experts take "
                   "adapters without dropout (peft's target_parameters); lora.experts: false keeps the dropout "
                   "and adapts the attention (and shared experts) only")
    if job.workload.lora_saved:
        out.append(f"{' and '.join(job.workload.lora_saved)} trained whole beside the adapters (peft's "
                   f"modules_to_save): not carried, shardfit trains the adapters only (the converted job needs "
                   f"less memory than the tool's)")
    out += [f"warning: {x}" for x in job.not_carried]
    if job.not_modelled:
        out.append("not carried (not modelled): " + ", ".join(sorted(job.not_modelled)))
    return out


def _splits(cfg: dict[str, Any]) -> bool:
    """Whether the config splits each row or each block's experts over ranks."""
    return cfg.get("sequence_parallel", 1) > 1 or cfg.get("expert_parallel", 1) > 1


def _reference_way(cfg: dict[str, Any]) -> str:
    """How shardfit gets the same reference log-probabilities (objective.reference_of's rule, in words)."""
    adapters = methods.get(cfg["method"]).adapters
    if cfg.get("dpo", {}).get("precompute_reference") is True or not adapters:
        return "it computes the reference log-probabilities once before step 1"
    return "the reference is the policy with its adapters switched off"


def to_yaml(job: ForeignJob) -> str:
    """The YAML text `shardfit train` reads."""
    cfg = to_config(job)
    head = "".join(f"# {line}\n" for line in comments(job, cfg))
    return head + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None)
