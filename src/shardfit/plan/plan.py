"""A plan: every strategy's per-GPU memory for one model, workload and hardware, the recommendation and why.

`Plan` is what the other stages read (`candidate`, `fits`); `to_json` is its public form (docs/reference.md), written
by `shardfit plan --json` and into a run's plan.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardfit import __version__
from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.config.support import trainable_methods
from shardfit.plan.dispatch import delta_rule_chunk_ops
from shardfit.plan.estimate import (
    GIB,
    Candidate,
    estimate,
    planned_workload,
    trainable_params,
)
from shardfit.plan.hardware import Hardware, hardware_notes
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS, eight_bit_form
from shardfit.plan.precision import experts_stay_16bit
from shardfit.plan.shapes import ModelShape
from shardfit.plan.timing import reference_pass_s, step_time
from shardfit.plan.weight_bytes import stored_linear_bytes
from shardfit.plan.workload import Workload
from shardfit.strategy import NAMES, SPEED_ORDER


@dataclass(frozen=True)
class ModelInfo:
    """The model as the plan reports it: sizes, and what the optimizer updates (LoRA: the adapter)."""

    id: str
    params: int
    trainable_params: int
    layers: int
    hidden: int
    vocab: int
    # A mixture of experts: the weights one token computes with (top-k and shared experts), and the experts.
    active_params: int | None = None
    experts: int | None = None
    experts_per_token: int | None = None


@dataclass
class Plan:
    model: ModelInfo
    hardware: Hardware
    workload: Workload
    candidates: list[Candidate]
    recommended: str | None
    reason: str
    alternatives: list[Alternative] | None = None  # the nearest changes that make something fit, when nothing does
    notes: list[str] = dataclasses.field(default_factory=list)  # what the objective adds (`objective_notes`)
    # When nothing fits as configured: the fastest plan among settings that change memory but not the trained
    # result (`same_result`), with what it turned on; None otherwise or when none of them fits either.
    adjusted: Alternative | None = None

    def candidate(self, strategy: str) -> Candidate | None:
        """The estimate of `strategy`, or None when the plan did not consider it."""
        return next((c for c in self.candidates if c.strategy == strategy), None)

    def fits(self, strategy: str) -> bool | None:
        """Whether `strategy` is predicted to fit; None when the plan did not consider it."""
        c = self.candidate(strategy)
        return None if c is None else c.fits

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shardfit_version": __version__,
            "model": dataclasses.asdict(self.model),
            "hardware": {"name": self.hardware.name, "nodes": self.hardware.nodes,
                         "gpus_per_node": self.hardware.gpus_per_node,
                         "gpu_mem_gib": round(self.hardware.gpu_mem_gib, 2),
                         "cpu_mem_gib": round(self.hardware.cpu_mem_gib, 1) if self.hardware.cpu_mem_gib else None,
                         # how the spec was read, as the text output's notes say it (`--gpus 8x24GB`: nominal)
                         "notes": hardware_notes(self.hardware, self.workload.precision)},
            "workload": dataclasses.asdict(self.workload),
            # What the objective makes of the workload: sequences and tokens one micro-batch forwards, the reference.
            "objective": {"name": self.workload.objective, "rows": self.workload.rows,
                          "tokens": self.workload.tokens, "reference": self.workload.reference},
            "candidates": [c.to_json() for c in self.candidates],
            "recommended": self.recommended,
            # The table's pick over whole rows; `plan CONFIG` may recommend another job (cli/plan_job.py).
            "best_strategy": self.recommended,
            "reason": self.reason,
        }
        if self.alternatives is not None:
            out["alternatives"] = [a.phrase("plan") for a in self.alternatives]
        if self.adjusted is not None:
            a = self.adjusted
            out["adjusted"] = {"what": a.what, "changes": dict(a.changes), "strategy": a.strategy,
                               "total_gib": round(a.total_gib, 2),
                               "tokens_per_s": None if a.tokens_per_s is None else round(a.tokens_per_s, 1)}
        if self.notes:
            out["notes"] = self.notes
        return out


# Predictions within this fraction of the fastest are a tie, which the simpler engine wins (SPEED_ORDER): the time
# model is not more precise than that.
TIE = 0.05


def recommend(cands: list[Candidate], hw: Hardware) -> tuple[str | None, str]:
    """The strategy that fits with the most predicted tokens/s (the job's, all ranks together), with the reason in
    numbers. Candidates without a time (none was predicted) are ranked by SPEED_ORDER; those the hardware cannot
    run (`applies` false) are left out."""
    rank = {name: i for i, name in enumerate(SPEED_ORDER)}
    cands = [c for c in cands if c.applies]  # what the hardware cannot run is neither rated nor recommended
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None, "nothing fits this hardware"
    if all(c.tokens_per_s for c in fitting):
        top = max(c.tokens_per_s or 0.0 for c in fitting)
        best = min((c for c in fitting if (c.tokens_per_s or 0.0) >= top * (1 - TIE)), key=lambda c: rank[c.strategy])
        faster = [c for c in cands if not c.fits and (c.tokens_per_s or 0.0) > (best.tokens_per_s or 0.0)]
        timed = sorted(fitting, key=lambda c: -(c.tokens_per_s or 0.0))
        lead = timed[0]
        claim = f"{best.strategy} trains the most tokens/s of the strategies that fit" if lead is best else (
            f"{best.strategy} is within {TIE:.0%} of the fastest that fits ({lead.strategy}), which the time model "
            "cannot tell apart, and the simplest of those")
        reason = (f"{claim} ({best.per_gpu_gib.total:.1f} of {hw.gpu_mem_gib:.0f} GiB per {hw.unit}): "
                  + "; ".join(_timing_phrase(c) for c in timed))
    else:
        order = list(SPEED_ORDER)
        if hw.world > 1:
            order.remove("single")  # one GPU of many is never the fastest way to use them
            order.insert(order.index("model_parallel"), "single")
        best = min(fitting, key=lambda c: order.index(c.strategy))
        faster = [c for c in cands if not c.fits and order.index(c.strategy) < order.index(best.strategy)]
        reason = f"{best.strategy} is the fastest strategy that fits ({best.per_gpu_gib.total:.1f} of " \
                 f"{hw.gpu_mem_gib:.0f} GiB per {hw.unit})"
    why = "; ".join(f"{f.strategy}: {f.notes}" for f in faster)
    return best.strategy, reason + (f". Not {why}" if why else "")


def _timing_phrase(c: Candidate) -> str:
    why = {"compute": "compute-bound", "host": "host-bound (launching ops: a longer micro-batch or torch.compile "
           "would help)", "comm": "communication-bound", "pcie": "PCIe-bound"}.get(c.bound or "", "")
    if c.strategy == "model_parallel" and c.extra.get("busy_gpus", 1) > 1:
        why = "one GPU busy at a time"
    step = c.step_s or 0.0
    tps = c.tokens_per_s or 0.0
    rate = f"{tps:,.0f}" if tps >= 10 else f"{tps:.2g}"
    return f"{c.strategy} ~{step:.2g} s/step, {rate} tokens/s, {why}" if step < 10 else \
        f"{c.strategy} ~{step:.0f} s/step, {rate} tokens/s, {why}"


def timed(shape: ModelShape, w: Workload, hw: Hardware, c: Candidate) -> Candidate:
    """`c` with the time model's step time, tokens/s and bound (plan/timing.py)."""
    t = step_time(shape, w, hw, c.strategy)
    parts = {"compute_s": t.compute_s, "comm_s": t.comm_s, "pcie_s": t.pcie_s, "host_s": t.host_s}
    return dataclasses.replace(c, step_s=t.step_s, tokens_per_s=t.tokens_per_s, bound=t.bound, time_parts=parts,
                               extra={**c.extra, "busy_gpus": t.busy_gpus},
                               reference_pass_s=reference_pass_s(shape, w, hw, c.strategy))


def estimate_all(shape: ModelShape, w: Workload, hw: Hardware, names: tuple[str, ...] = NAMES) -> list[Candidate]:
    """Memory and time of every strategy of `names`."""
    return [timed(shape, w, hw, estimate(shape, w, hw, s)) for s in names]


@dataclass(frozen=True)
class Alternative:
    """A change that makes something fit: what to change (workload fields, or more nodes) and the result."""

    what: str  # in words: "turn on gradient checkpointing"
    changes: tuple[tuple[str, object], ...]  # workload field -> new value
    nodes: int | None  # more nodes instead of a workload change
    strategy: str
    total_gib: float
    unit: str = "GPU"  # what total_gib is per: a GPU, or a process on a CPU-only machine
    tokens_per_s: float | None = None  # the job's predicted rate with the change (set by `same_result`)
    # the change as the setting of another tool's job (`plan --from`, foreign/asplanned.py `plan_job`), which the
    # plan then reads from the job's file: what `how` says in place of `shardfit plan`'s flags
    setting: str | None = None
    # ... or why that tool has no setting for it: the change is then said as left out, never as shardfit's flags
    left_out: str | None = None

    def how(self, style: str = "plan") -> str | None:
        """The change as `shardfit plan` flags (style "plan") or config overrides (style "config"); None when that
        command has no such setting (or the job's tool has none, `left_out`)."""
        return None if self.left_out else _flags(self, style)

    def phrase(self, style: str = "plan") -> str | None:
        """The change as the flags of `shardfit plan` (style "plan") or as config overrides for `train`/`check`
        (style "config"); None when that command has no such setting; one line saying why where the job's tool
        has none (`left_out`)."""
        if self.left_out:
            return f"left out: {self.what} ({self.strategy} at {self.total_gib:.1f} GiB per {self.unit}): " \
                f"{self.left_out}"
        how = _flags(self, style)
        if how is None:
            return None
        return f"{self.what} ({how}): {self.strategy} at {self.total_gib:.1f} GiB per {self.unit}"


# Workload fields as `shardfit plan` flags and as config keys (None: the config has no such key).
_FLAG = {"grad_ckpt": ("--grad-ckpt", "grad_ckpt"), "micro_batch": ("--batch", "micro_batch"),
         "grad_accum": ("--grad-accum", "grad_accum"), "seq_len": ("--seq", "max_seq_len"),
         "method": ("--method", "method"), "optimizer": ("--optimizer", None),
         "bnb_optimizer": ("--bnb-optimizer", None), "sequence_parallel": ("--sequence-parallel", "sequence_parallel")}


def _flags(a: Alternative, style: str) -> str | None:
    if a.setting is not None and style == "plan":
        return a.setting
    parts = []
    if a.nodes is not None:
        parts.append(f"--nodes {a.nodes}" if style == "plan" else f"--nnodes {a.nodes}")
    for field_name, value in a.changes:
        flag, key = _FLAG[field_name]
        if style == "plan":
            parts.append(flag if value is True else f"{flag} {value}")  # a store_true flag takes no value
        elif key is None or (field_name == "method" and value not in trainable_methods()):
            return None
        else:
            parts.append(f"--set {key}={value}")
    return " ".join(parts)


def alternatives(shape: ModelShape, w: Workload, hw: Hardware) -> list[Alternative]:
    """The nearest changes that make something fit, checked with the same estimator."""
    tries: list[tuple[str, dict[str, object], int | None]] = []
    if w.grad_ckpt != "full":
        tries.append(("checkpoint whole blocks" if w.grad_ckpt == "selective" else "turn on gradient checkpointing",
                      {"grad_ckpt": "full"}, None))
    if w.micro_batch > 1:
        tries.append((f"micro-batch 1 with grad_accum {w.grad_accum * w.micro_batch}",
                      {"micro_batch": 1, "grad_accum": w.grad_accum * w.micro_batch}, None))
    if w.seq_len > 512:
        tries.append(("shorter sequences", {"seq_len": w.seq_len // 2}, None))
    if not methods.get(w.method).adapters:
        tries.append(("LoRA instead of a full fine-tune", {"method": "lora"}, None))
    if w.method != "qlora":
        tries.append(("QLoRA: 4-bit frozen weights", {"method": "qlora"}, None))
    if (offer := eight_bit_offer(w)) is not None:
        tries.append((*offer, None))
    out = [a for what, changes, nodes in tries if (a := _fits_with(shape, w, hw, what, changes, nodes))]
    if not out:  # all of them at once, for a job no single change rescues (a full fine-tune on one GPU)
        lean = {"grad_ckpt": "full", "micro_batch": 1, "grad_accum": w.grad_accum * w.micro_batch}
        for method in ("lora", "qlora") if w.method in ("full", "freeze") else ("qlora",) * (w.method != "qlora"):
            what = f"{'QLoRA' if method == 'qlora' else 'LoRA'} with gradient checkpointing and micro-batch 1"
            found = _fits_with(shape, w, hw, what, {**lean, "method": method}, None)
            if found is not None:
                out.append(found)
                break
    # More GPUs: the fewest of 2, 4, 8 or 16 times the nodes that make something fit.
    for factor in (2, 4, 8, 16):
        nodes = hw.nodes * factor
        what = "twice the GPUs" if factor == 2 else f"{factor}x the GPUs"
        found = _fits_with(shape, w, hw, f"{what} ({nodes} nodes x {hw.gpus_per_node})", {}, nodes)
        if found is not None:
            out.append(found)
            break
    return out


def eight_bit_offer(w: Workload) -> tuple[str, dict[str, object]] | None:
    """bitsandbytes' 8-bit form of the job's own optimizer, as its label and workload changes; the one rule
    `alternatives` and a `--from` job's "what would fit" (foreign/asplanned.py `what_would_fit`) offer it by. Never
    another optimizer (that would train something else), nor for a stand-in or an optimizer DeepSpeed builds from
    its JSON (`no_8bit_form`); for adapters too: QLoRA's adapters on every linear layer of a 70B model at rank 64
    keep GiBs of states. A job a tool's Trainer runs (`tool_autocast`) gets bitsandbytes' kernels as its `optim`
    names them (`bnb_optimizer`: the Trainer keeps the embedding's states in fp32 where it registers them,
    optimizer_states.py `fp32_state_embedding`). None where the table models no 8-bit form."""
    eight_bit = eight_bit_form(w.optimizer, w.no_8bit_form)
    if eight_bit is None:
        return None
    return OPTIMIZER_KINDS[eight_bit].label, {"optimizer": eight_bit,
                                              **({"bnb_optimizer": True} if w.tool_autocast else {})}


def _fits_with(shape: ModelShape, w: Workload, hw: Hardware, what: str, changes: dict[str, object],
               nodes: int | None) -> Alternative | None:
    """The change as an Alternative when the planner finds a strategy that fits with it, else None."""
    w2 = dataclasses.replace(w, **changes)
    hw2 = dataclasses.replace(hw, nodes=nodes) if nodes else hw
    cands = estimate_all(shape, w2, hw2)
    best, _ = recommend(cands, hw2)
    if best is None:
        return None
    c = next(c for c in cands if c.strategy == best)
    return Alternative(what, tuple(changes.items()), nodes, best, c.per_gpu_gib.total, hw.unit)


def same_result(shape: ModelShape, w: Workload, hw: Hardware,
                strategies: tuple[str, ...] = NAMES) -> Alternative | None:
    """The fastest plan among the settings that change memory but not what is trained (the same examples, the same
    global batch, the same update): gradient checkpointing (selective, full: recomputation gives the same
    activations), micro-batch 1 with grad_accum raised to the same global batch (the mean over the same examples),
    and every strategy of `strategies`, offload among them (the same AdamW, on the host). None when none fits.
    Ties within TIE of the fastest go to the fewest changes."""
    ckpt = {"none": ("selective", "full"), "selective": ("full",)}.get(w.grad_ckpt, ())
    batch = [{"micro_batch": 1, "grad_accum": w.grad_accum * w.micro_batch}] if w.micro_batch > 1 else []
    words = {"selective": "selective checkpointing", "full": "gradient checkpointing"}
    found: list[Alternative] = []
    for c in (None, *ckpt):
        for b in ({}, *batch):
            changes: dict[str, object] = {**({"grad_ckpt": c} if c else {}), **b}
            if not changes:
                continue
            what = " and ".join([*([f"{words[c]} on"] if c else []),
                                 *([f"micro-batch 1 with grad_accum {b['grad_accum']}"] if b else [])])
            cands = estimate_all(shape, dataclasses.replace(w, **changes), hw, strategies)
            best, _ = recommend(cands, hw)
            if best is not None:
                pick = next(x for x in cands if x.strategy == best)
                found.append(Alternative(what, tuple(changes.items()), None, best, pick.per_gpu_gib.total, hw.unit,
                                         pick.tokens_per_s))
    if not found:
        return None
    top = max(a.tokens_per_s or 0.0 for a in found)
    return min((a for a in found if (a.tokens_per_s or 0.0) >= top * (1 - TIE)), key=lambda a: len(a.changes))


def make_plan(shape: ModelShape, w: Workload, hw: Hardware, strategies: tuple[str, ...] = NAMES) -> Plan:
    """Estimate every strategy of `strategies`, recommend the fastest that fits; when none does, the fastest that
    fits with settings that keep the trained result (`same_result`) and the nearest changes."""
    asked, w = w, planned_workload(shape, w)
    cands = estimate_all(shape, w, hw, strategies)
    best, reason = recommend(cands, hw)
    model = ModelInfo(shape.id, shape.params(), trainable_params(shape, w), shape.layers, shape.hidden, shape.vocab,
                      *((shape.active_params(), shape.experts, shape.top_k) if shape.moe else (None, None, None)))
    return Plan(model, hw, w, cands, best, reason, alternatives(shape, w, hw) if best is None else None,
                objective_notes(shape, w, hw, cands, best) + delta_rule_notes(shape, w)
                + mamba_notes(shape, w, hw, best, strategies) + expert_dtype_notes(shape, w)
                + ([f"attention {asked.attention} runs eager: transformers' class of {shape.id} has no SDPA"]
                   if w.attention != asked.attention else []),
                same_result(shape, w, hw, strategies) if best is None else None)


def objective_notes(shape: ModelShape, w: Workload, hw: Hardware, cands: list[Candidate],
                    best: str | None) -> list[str]:
    """How a preference objective is counted, with the recommended strategy's figures (else the first that can
    run): the rows of a micro-batch, and what the reference costs in time (never memory: it is the policy itself,
    with its adapters switched off or before the first update). Nothing for SFT."""
    o = objectives.get(w.objective)
    if not o.preference:
        return []
    each = "pair" if o.sequences == 2 else "row"
    notes = [f"objective {w.objective}: a micro-batch of {w.micro_batch} {each}{'s' * (w.micro_batch != 1)} "
             f"forwards {w.rows} sequence{'s' * (w.rows != 1)} of up to {w.seq_len} tokens"
             + (" (chosen and rejected; the prompt's tokens are in both)" if o.sequences == 2 else "")
             + f"; activations, logits and step time are counted for {w.tokens} tokens"]
    shown = next((c for c in cands if c.strategy == best), None) or next((c for c in cands if c.applies), None)
    if w.reference is None:
        return [*notes, f"no reference model ({w.objective} compares the policy's own answers)"]
    if w.reference == "adapters_off":
        extra = ""
        if shown is not None and shown.step_s:
            without = step_time(shape, dataclasses.replace(w, precompute_reference=True), hw, shown.strategy)
            extra = f" (+{shown.step_s / without.step_s - 1:.0%} step time under {shown.strategy})"
        return [*notes, "reference: the policy with its adapters switched off, one forward without gradients in "
                        f"every micro-batch{extra}; it saves nothing for backward and holds one block's "
                        "activations at a time; no second copy of the weights"]
    per_1k = f" ~{_duration(1000 * shown.reference_pass_s)} per 1,000 examples under {shown.strategy}," \
        if shown is not None and shown.reference_pass_s else ""
    return [*notes, f"reference: log-probabilities computed once before step 1 (one forward without gradients "
                    f"over the data:{per_1k} not in step_s); no second copy of the weights and nothing added to "
                    "the step's memory"]


def expert_dtype_notes(shape: ModelShape, w: Workload) -> list[str]:
    """Where bitsandbytes QLoRA leaves the fused routed experts in 16 bits (precision.py `experts_stay_16bit`): how
    much of the weights that is, and for gpt-oss what its MXFP4 checkpoint does to a 4-bit load."""
    if not experts_stay_16bit(shape, w):
        return []
    gib = stored_linear_bytes(shape, w, True, experts_only=True) * shape.moe_layers / GIB
    kept = "fp32 (peft's prepare_model_for_kbit_training upcasts them)" if w.frozen_fp32 else w.precision
    older = "" if shape.experts_always_fused else \
        "; with transformers 4 (an nn.Linear per expert, `--from ... --transformers 4.57`) they would be NF4"
    notes = [f"the routed experts stay {kept} under bitsandbytes ({gib:.1f} GiB): transformers' 4-bit loading "
             f"replaces only nn.Linear layers, and its fused 3-D expert weights are not{older}"]
    if shape.clamped_swiglu:
        notes.append("gpt-oss ships MXFP4 experts: transformers refuses a BitsAndBytesConfig over the checkpoint's "
                     "Mxfp4Config; a tool that loads it dequantized (Mxfp4Config(dequantize=True)) holds every weight "
                     "in 16 bits, attention included")
    return notes


def delta_rule_notes(shape: ModelShape, w: Workload) -> list[str]:
    """Where a Gated DeltaNet hybrid is planned for transformers' torch fallback (flash-linear-attention is not
    installed where the plan runs, workload.py `delta_rule`): what it costs and how to get the fused kernels."""
    if not shape.linear_layers or w.delta_rule != "torch":
        return []
    kernels, _ = delta_rule_chunk_ops(w)
    return [f"the {shape.linear_layers} Gated DeltaNet blocks are planned with transformers' torch fallback "
            "(flash-linear-attention is not installed here): a Python loop over each row's 64-token chunks, "
            f"{kernels * shape.linear_layers:,.0f} more kernel launches per micro-batch, and fp32 chunk tensors "
            "saved for backward; `pip install flash-linear-attention causal-conv1d` (on the GPU machine, then plan "
            "again there) for the fused kernels"]


def mamba_notes(shape: ModelShape, w: Workload, hw: Hardware, chosen: str | None,
                strategies: tuple[str, ...] = NAMES) -> list[str]:
    """Which Mamba scan the Mamba blocks are planned with (workload.py `mamba_scan`) where it is not the probed
    fused kernel: transformers' torch fallback (mamba_ssm not installed where the plan runs, for this machine's
    GPUs), with how to get the fused kernel; or the fused kernel assumed for other GPUs, with what the torch
    fallback would need there for the `chosen` strategy."""
    if not shape.mamba_blocks or not (w.mamba_scan == "torch" or w.mamba_scan_assumed):
        return []
    blocks = f"the {shape.mamba_blocks} Mamba-{1 if shape.mamba_v1 else 2} blocks"
    if w.mamba_scan == "torch":
        return [f"{blocks} are planned with transformers' reference torch scan (mamba_ssm is not installed here), "
                "which saves fp32 chunk tensors for backward; `pip install mamba-ssm causal-conv1d` (on the GPU "
                "machine, then plan again there) for the fused kernel"]
    cands = estimate_all(shape, dataclasses.replace(w, mamba_scan="torch", mamba_scan_assumed=False), hw, strategies)
    fallback, _ = recommend(cands, hw)
    # `chosen` is make_plan's pick among the same `strategies` (None: nothing fits), so it is among `cands`.
    name = chosen or strategies[0]
    same = next((c for c in cands if c.strategy == name), None)
    assert same is not None, f"mamba_notes: {name} is not among the strategies {strategies} the plan was made of"
    then = (f"{fallback} the fastest that fits then" if fallback and fallback != same.strategy
            else "nothing fits then" if not fallback else "it still fits")
    return [f"{blocks} are planned with mamba_ssm's fused scan, what the GPU machine runs with `pip install "
            f"mamba-ssm causal-conv1d` (not installed here); transformers' torch fallback, without it, saves fp32 "
            f"chunk tensors: {same.strategy} would need {same.per_gpu_gib.total:.1f} GiB a {hw.unit}, {then}"]


def _duration(s: float) -> str:
    return f"{s:.2g} s" if s < 100 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def with_candidates(plan: Plan, cands: list[Candidate]) -> Plan:
    """The plan with other estimates of its strategies (e.g. simulated), the recommendation re-derived; each keeps
    the time its strategy was predicted to take."""
    cands = [_with_time(c, plan.candidate(c.strategy)) for c in cands]
    best, reason = recommend(cands, plan.hardware)
    return dataclasses.replace(plan, candidates=cands, recommended=best, reason=reason)


def _with_time(c: Candidate, before: Candidate | None) -> Candidate:
    if before is None or c.step_s is not None:
        return c
    return dataclasses.replace(c, step_s=before.step_s, tokens_per_s=before.tokens_per_s, bound=before.bound,
                               extra={**before.extra, **c.extra}, reference_pass_s=before.reference_pass_s)
