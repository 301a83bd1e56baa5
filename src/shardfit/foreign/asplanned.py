"""A foreign job on the planner: its own engine's estimate ("as configured"), shardfit's strategies for the same
workload, and the nearest changes that fit, said in the tool's keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardfit.foreign.job import ENGINE_STRATEGY, TOOL_NAMES, ForeignJob
from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed
from shardfit.plan.estimate import GIB, Candidate, add_runtime_overhead, estimate
from shardfit.plan.hardware import Hardware
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS
from shardfit.plan.plan import Alternative, Plan, eight_bit_offer, make_plan
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from shardfit.strategy import NAMES

NO_EFFECT_MARK = "(no effect on memory)"


@dataclass
class ForeignPlan:
    job: ForeignJob
    shape: ModelShape
    hardware: Hardware
    configured: Candidate
    plan: Plan  # shardfit's strategies for the same model, workload and GPUs
    would: list[str] = field(default_factory=list)  # the nearest changes that fit, in the tool's keys

    def to_json(self) -> dict[str, Any]:
        """plan.to_json() plus a `from` section (docs/reference.md, `plan --json --from TOOL FILE`)."""
        out = self.plan.to_json()
        c = self.configured.to_json()
        c["engine"] = self.job.describe_engine()
        out["from"] = {"tool": self.job.tool, "file": self.job.source, "model": self.job.model,
                       "ranks": self.hardware.world, "as_configured": c, "what_would_fit": self.would,
                       "keys": self.job.keys, "not_modelled": self.job.not_modelled, "notes": self.job.notes}
        return out


def job_hardware(job: ForeignJob, hw: Hardware) -> Hardware:
    """The GPUs the job runs on: the card of `hw`, as many per node as the job launches ranks (a device-map job:
    the GPUs its one process sees)."""
    per_node = job.nproc or job.gpus or hw.gpus_per_node
    return dataclasses.replace(hw, gpus_per_node=per_node, nodes=max(job.nnodes, hw.nodes))


def configured_estimate(job: ForeignJob, shape: ModelShape, w: Workload, hw: Hardware,
                        zero: ZeroSettings | None = None, engine: str | None = None) -> Candidate:
    """The per-GPU estimate of the job's own engine (DeepSpeed ZeRO with its buffers, else the shardfit strategy
    with the same sharding), with the reference model the tool keeps beside the policy."""
    engine = engine or job.engine
    zero = zero or job.zero
    if engine.startswith("fsdp") and (group := job.shard_group(hw.world)):
        # each rank holds 1/N of the model, and of the reference FSDP prepares alike, for a shard group of N ranks,
        # whatever the replicas around it
        hw = dataclasses.replace(hw, nodes=1, gpus_per_node=group)
    ref = reference_bytes(job, shape, w, hw, engine, zero)
    if ref:  # the tool runs its copy's forward inside every step, as the adapters-off reference runs
        w = dataclasses.replace(w, precompute_reference=False)
    if engine == "deepspeed" and zero is not None:
        c = estimate_deepspeed(shape, w, hw, zero)
    else:
        strategy = ENGINE_STRATEGY.get(engine, "single")
        if strategy == "single" and hw.world > 1:
            hw = dataclasses.replace(hw, nodes=1, gpus_per_node=1)
        c = estimate(shape, w, hw, strategy)
    return with_reference(c, ref, hw) if ref else c


@dataclass(frozen=True)
class ReferenceMemory:
    """What the tool's reference copy takes per rank (bytes), and whether it is partitioned over the ranks."""

    gpu: float = 0.0
    host: float = 0.0
    sharded: bool = False

    def __bool__(self) -> bool:
        return self.gpu > 0 or self.host > 0


def reference_bytes(job: ForeignJob, shape: ModelShape, w: Workload, hw: Hardware, engine: str,
                    zero: ZeroSettings | None) -> ReferenceMemory:
    """The tool's reference copy per rank, as TRL's trainers (and LLaMA-Factory's, ms-swift's and axolotl's, built
    on them) hold it: under ZeRO-3 DeepSpeed partitions it like the policy (trl's prepare_deepspeed keeps stage 3,
    parameter offload included), under ZeRO-0/1/2 it runs at stage 0, a whole copy per GPU, FSDP shards it, and
    without either every rank holds all of it. A quantized copy is placed as loaded, never partitioned. It is
    loaded frozen, in the compute dtype."""
    ref = job.reference
    if ref is None or not job.keeps_reference(w):
        return ReferenceMemory()
    total = shape.params() * (ref.bits / 8 if ref.bits else compute_bytes(w))
    zero3 = engine == "deepspeed" and zero is not None and zero.stage == 3
    if ref.bits is None and (zero3 or engine in ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_offload")):
        offloaded = (zero3 and zero is not None and zero.offload_param) or engine == "fsdp_offload"
        share = total / hw.world
        return ReferenceMemory(0.0, share, True) if offloaded else ReferenceMemory(share, 0.0, True)
    if engine == "device_map":  # split over the GPUs as the policy is
        return ReferenceMemory(total / max(1, job.gpus or hw.gpus_per_node), 0.0, True)
    return ReferenceMemory(total)


def with_reference(c: Candidate, ref: ReferenceMemory, hw: Hardware) -> Candidate:
    """`c` with the reference copy's weights on the GPU (its peak moves with it: the copy is there at every
    moment of the step) and in host RAM."""
    gpu, host = ref.gpu, ref.host
    b = dataclasses.replace(c.per_gpu_gib, weights=c.per_gpu_gib.weights + gpu / GIB)
    add_runtime_overhead(b, hw, c.strategy)
    fits = c.fits and b.total <= hw.gpu_mem_gib
    copy = f"a reference model copy of {gpu / GIB:.1f} GiB per GPU" + (
        f" ({host / GIB:.1f} GiB per rank in host RAM)" if host else "")
    if not c.fits and c.per_gpu_gib.total <= hw.gpu_mem_gib:  # it failed for its own reason; keep it
        note = f"{c.notes}; with {copy}"
    else:
        cap = hw.gpu_mem_gib
        note = (f"{cap - b.total:.1f} GiB headroom" if fits else f"{b.total:.1f} GiB > {cap:.0f} GiB") + f" with {copy}"
    extra = dict(c.extra)
    if "between_steps_gib" in extra:
        extra["between_steps_gib"] += gpu / GIB
    return dataclasses.replace(c, fits=fits, per_gpu_gib=b, cpu_gib=c.cpu_gib + host / GIB, notes=note, extra=extra)


def plan_job(job: ForeignJob, shape: ModelShape, hw: Hardware,
             strategies: tuple[str, ...] | None = None) -> ForeignPlan:
    """The job as configured on `hw`, shardfit's plan of the same workload over `strategies` (default: every one),
    and what would fit."""
    hw = job_hardware(job, hw)
    w = job.workload
    configured = configured_estimate(job, shape, w, hw)
    plan = make_plan(shape, w.on_shardfits_engine(), hw, strategies or NAMES)
    if plan.alternatives is not None:
        plan.alternatives = _in_tool_words(job, plan.alternatives, hw.gpus_per_node)
    _tool_adjusted(job, plan, hw.gpus_per_node)
    fp = ForeignPlan(job, shape, hw, configured, plan)
    if not configured.fits:
        fp.would = what_would_fit(job, shape, w, hw, configured)
    return fp


def _in_tool_words(job: ForeignJob, alternatives: list[Alternative], per_node: int) -> list[Alternative]:
    """The plan's alternatives for a `--from` job on nodes of `per_node` GPUs, each in the tool's words
    (`tool_alternative`)."""
    return [tool_alternative(job, a, per_node=per_node) for a in alternatives]


# Each workload change the plan offers (plan/plan.py `alternatives`, `same_result`) as a concept of the tools' words
# (job.py `Words`), with the value it takes there; micro_batch takes grad_accum's value (it is always 1).
_CONCEPTS = {"grad_ckpt": lambda v: ({"full": "grad_ckpt"}.get(str(v), str(v)), None),
             "seq_len": lambda v: ("seq", v), "method": lambda v: (str(v), None),
             "optimizer": lambda v: (str(v), None)}
# Why a tool may have no words for a concept.
_NO_WORDS = {"selective": "{tool} has no selective checkpointing (it checkpoints whole blocks or none)",
             "nodes": "shardfit does not know {tool}'s own multi-node launch; plan --from ... --nodes N plans it"}


def tool_alternative(job: ForeignJob, a: Alternative, *, per_node: int | None = None) -> Alternative:
    """`a` as the job's tool spells it (`setting`), since `plan --from` reads the workload from the job's file and
    refuses shardfit's flags for it; where the tool has no setting for a change, `left_out` says so. `per_node`:
    the GPUs of a node, which a launch on more nodes counts its processes by."""
    words, changes = job.words, dict(a.changes)
    parts: list[str] = []
    missing: list[str] = []

    def put(concept: str, value: object = None) -> None:
        said = words.setting(concept, value, per_node)
        parts.append(said) if said else missing.append(concept)

    if a.nodes is not None:
        put("nodes", a.nodes)
    for name, value in a.changes:
        if name == "micro_batch":
            put("micro_batch", changes.get("grad_accum"))
        elif name in _CONCEPTS:
            put(*_CONCEPTS[name](value))
        elif name not in ("grad_accum", "bnb_optimizer"):  # said with micro_batch, and with the optimizer
            missing.append(name)
    if not missing:
        return dataclasses.replace(a, setting=" + ".join(parts))
    tool = TOOL_NAMES[job.tool]
    why = "; ".join(_NO_WORDS.get(m, f"{tool} has no setting for "
                                     f"{OPTIMIZER_KINDS[m].label if m in OPTIMIZER_KINDS else m} that shardfit "
                                     "knows").format(tool=tool) for m in missing)
    return dataclasses.replace(a, setting=None, left_out=why)


def _tool_adjusted(job: ForeignJob, plan: Plan, per_node: int) -> None:
    """The plan's adjusted recommendation (`same_result`) in the tool's words; where the tool has no setting for
    it, left out and said among the alternatives."""
    if plan.adjusted is None:
        return
    said = tool_alternative(job, plan.adjusted, per_node=per_node)
    if said.left_out:
        plan.adjusted = None
        plan.alternatives = [said, *(plan.alternatives or [])]
    else:
        plan.adjusted = said


Try = tuple[str, Workload, ZeroSettings | None, str | None]


def _eval_tries(w: Workload, say: Callable[[str, str], str], fits: Callable[[Workload], bool]) -> list[Try]:
    """The changes to the evaluation while training, for a job whose peak is its evaluation, first as they change
    nothing the training computes: the logits moved to the CPU every step (where kept), else, or where that alone
    is not enough, the largest halving of the eval batch that fits (`fits`), with the logits moved if need be."""
    tries: list[Try] = []
    bases = [("", w)]
    if w.eval_batch and w.eval_keeps_logits and w.eval_accumulation != 1:
        moved = say("eval_accumulation", "eval_accumulation_steps 1")
        tries.append((moved, dataclasses.replace(w, eval_accumulation=1), None, None))
        if fits(tries[0][1]):
            return tries
        bases.append((f"{moved} + ", tries[0][1]))
    for label, base in bases:
        n = base.eval_batch // 2
        while n >= 1 and not fits(dataclasses.replace(base, eval_batch=n)):
            n //= 2
        if n >= 1:
            tries.append((f"{label}{say('eval_batch', w.eval_batch_key)} {n}",
                          dataclasses.replace(base, eval_batch=n), None, None))
            break
    return tries


def what_would_fit(job: ForeignJob, shape: ModelShape, w: Workload, hw: Hardware, configured: Candidate) -> list[str]:
    """Changes to the job that make its own engine fit, nearest first, in the tool's keys; then shardfit's
    recommendation for the same job. `configured`: the job's own estimate, whose peak says whether the evaluation's
    changes are worth trying."""
    say = job.words.say
    at_eval = configured.peak_phase == "eval"
    tries = _eval_tries(w, say, lambda w2: configured_estimate(job, shape, w2, hw).fits) if at_eval else []
    if w.grad_ckpt == "none":
        tries.append((say("grad_ckpt", "gradient checkpointing on"), dataclasses.replace(w, grad_ckpt="full"),
                      None, None))
    if w.micro_batch > 1:
        tries.append((job.words.setting("micro_batch", w.micro_batch * w.grad_accum)
                      or f"micro-batch 1 (1 x {w.micro_batch * w.grad_accum})",
                      dataclasses.replace(w, micro_batch=1, grad_accum=w.micro_batch * w.grad_accum), None, None))
    z = job.zero or ZeroSettings()
    if job.engine == "deepspeed" and z.stage < 3 or job.engine in ("ddp", "single"):
        tries.append((say("zero3", "ZeRO-3"), w, dataclasses.replace(z, stage=3), "deepspeed"))
    if job.engine in ("deepspeed", "ddp", "single") and not (z.stage == 3 and z.offload_param):
        tries.append((say("zero3_offload", "ZeRO-3 with CPU offload"),
                      w, dataclasses.replace(z, stage=3, offload_optimizer=True, offload_param=True), "deepspeed"))
    if w.seq_len > 512:
        tries.append((job.words.setting("seq", w.seq_len // 2) or f"sequence length {w.seq_len // 2}",
                      dataclasses.replace(w, seq_len=w.seq_len // 2), None, None))
    if (offer := eight_bit_offer(w)) is not None:  # the plan's own rule, in the tool's words where it has them
        optimizer = str(offer[1]["optimizer"])
        tries.append((say(optimizer, f"left out: {offer[0]} ({TOOL_NAMES[job.tool]} names no such optimizer)"),
                      dataclasses.replace(w, **offer[1]), None, None))
    if w.method in ("full", "freeze"):
        tries.append((say("lora", "LoRA"), dataclasses.replace(w, method="lora"), None, None))
    if w.loss != "chunked":
        tries.append((say("fused_loss", "a fused linear cross-entropy (Liger)"), dataclasses.replace(w, loss="chunked"),
                      None, None))
    if w.method != "qlora":
        tries.append((say("qlora", "4-bit QLoRA"), dataclasses.replace(w, method="qlora"), None, None))
    out = []
    for label, w2, z2, engine in tries:
        c = configured_estimate(job, shape, w2, hw, z2, engine)
        if c.fits:
            out.append(f"{label}: {c.per_gpu_gib.total:.1f} GiB per GPU")
    precompute = say("ref_precompute", "")
    if precompute and job.keeps_reference(w):  # the tool's own way to drop its reference copy
        c = configured_estimate(dataclasses.replace(job, reference=None), shape,
                                dataclasses.replace(w, precompute_reference=True), hw)
        if c.fits:
            out.insert(0, f"{precompute}: {c.per_gpu_gib.total:.1f} GiB per GPU")
    if not out:  # no single change is enough: the workload changes together, in the order listed
        stacked, labels = w, []
        for label, w2, z2, _ in tries:  # only changes the tool can make: a stack is one offer to run
            if z2 is None and w2 != w and not label.startswith("left out: "):
                stacked = dataclasses.replace(stacked, **{f.name: getattr(w2, f.name) for f in
                                                          dataclasses.fields(w2) if getattr(w2, f.name) !=
                                                          getattr(w, f.name)})
                labels.append(label)
                c = configured_estimate(job, shape, stacked, hw)
                if c.fits:
                    out.append(" + ".join(labels) + f": {c.per_gpu_gib.total:.1f} GiB per GPU")
                    break
    plan = make_plan(shape, w, hw)
    if plan.recommended:
        c = plan.candidate(plan.recommended)
        assert c is not None
        tool_way = say(plan.recommended, "")
        out.append(f"shardfit: strategy {plan.recommended}, {c.per_gpu_gib.total:.1f} GiB per GPU (shardfit convert "
                   f"--from {job.tool} {job.source})"
                   + (f"; in {TOOL_NAMES[job.tool]}: {tool_way}" if tool_way else ""))
    return out


def format_report(fp: ForeignPlan, table: str) -> str:
    """The terminal report: what was read, shardfit's table, and the verdict on the job as configured."""
    job, c = fp.job, fp.configured
    lines = [f"from {job.tool}: {job.source}",
             f"  model {job.model}; {fp.hardware.world} {'GPU' if job.engine == 'device_map' else 'rank'}(s) of "
             f"{fp.hardware.gpu_mem_gib:.1f} GiB; "
             f"{job.describe_engine()}"]
    idle = NO_EFFECT_MARK
    used = {k: v for k, v in job.keys.items() if not v.endswith(idle)}
    if used:
        lines.append("  read: " + "; ".join(f"{k}={v}" for k, v in used.items()))
    if len(used) < len(job.keys):
        lines.append("  no effect on memory: " + ", ".join(k for k, v in job.keys.items() if v.endswith(idle)))
    if job.not_modelled:
        lines.append("  not modelled: " + "; ".join(f"{k}={v}" for k, v in job.not_modelled.items()))
    for n in job.notes:
        lines.append(f"  note: {n}")
    lines += ["", table, ""]
    verdict = "fits" if c.fits else "does not fit"
    lines.append(f"as configured: {job.describe_engine()}, {c.per_gpu_gib.total:.1f} GiB per GPU on "
                 f"{fp.hardware.gpu_mem_gib:.0f}: {verdict}"
                 + (f" (host {c.cpu_gib:.1f} GiB per rank)" if c.cpu_gib else "")
                 + f" [peak {c.peak_phase}; weights {c.per_gpu_gib.weights:.1f}, grads {c.per_gpu_gib.grads:.1f}, "
                   f"optimizer {c.per_gpu_gib.optimizer:.1f}, activations {c.per_gpu_gib.activations:.1f}, logits "
                   f"{c.per_gpu_gib.logits:.1f}, temporaries {c.per_gpu_gib.temporaries:.1f}]")
    if not c.fits:
        lines.append("what would:" + ("" if fp.would else " nothing found"))
        lines += [f"  - {x}" for x in fp.would]
    return "\n".join(lines)
