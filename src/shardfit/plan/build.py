"""Assemble a plan (CONTRACTS.md section 3): every strategy's estimate, the recommendation and the reason."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardfit import __version__
from shardfit.plan.estimate import SPEED_ORDER, STRATEGIES, Candidate, Workload, estimate, trainable_params
from shardfit.plan.hardware import Hardware
from shardfit.plan.shapes import ModelShape


def recommend(cands: list[Candidate], hw: Hardware) -> tuple[str | None, str]:
    """The fastest strategy that fits: least communication, no offload unless nothing else fits."""
    by_name = {c.strategy: c for c in cands}
    order = list(SPEED_ORDER)
    if hw.world > 1:
        order.remove("single")  # one GPU of many is never the fastest way to use them
        order.insert(order.index("model_parallel"), "single")
    for name in order:
        c = by_name.get(name)
        if c is not None and c.fits:
            faster = [by_name[n] for n in order[:order.index(name)] if n in by_name]
            why = "; ".join(f"{f.strategy}: {f.notes}" for f in faster if not f.fits)
            reason = f"{name} is the fastest strategy that fits ({c.per_gpu_gib.total:.1f} of " \
                     f"{hw.gpu_mem_gib:.0f} GiB per GPU)"
            return name, reason + (f". Not {why}" if why else "")
    return None, "nothing fits this hardware"


def alternatives(shape: ModelShape, w: Workload, hw: Hardware) -> list[str]:
    """The nearest changes that make something fit, checked with the same estimator."""
    tries: list[tuple[str, Workload, Hardware]] = []
    if w.grad_ckpt != "full":
        what = "checkpoint whole blocks" if w.grad_ckpt == "selective" else "turn on gradient checkpointing"
        tries.append((f"{what} (--grad-ckpt full)", dataclasses.replace(w, grad_ckpt="full"), hw))
    if w.micro_batch > 1:
        accum = w.grad_accum * w.micro_batch
        tries.append((f"micro-batch 1 with grad_accum {accum}",
                      dataclasses.replace(w, micro_batch=1, grad_accum=accum), hw))
    if w.seq_len > 512:
        tries.append((f"shorter sequences (--seq {w.seq_len // 2})", dataclasses.replace(w, seq_len=w.seq_len // 2),
                      hw))
    if w.method in ("full", "freeze"):
        tries.append(("LoRA instead of a full fine-tune (--method lora)", dataclasses.replace(w, method="lora"), hw))
    if w.method != "qlora":
        tries.append(("QLoRA: 4-bit frozen weights (--method qlora)", dataclasses.replace(w, method="qlora"), hw))
    if w.optimizer == "adamw" and w.method == "full":
        tries.append(("8-bit AdamW (--optimizer adamw8bit)", dataclasses.replace(w, optimizer="adamw8bit"), hw))
    tries.append((f"twice the GPUs ({hw.nodes * 2} nodes x {hw.gpus_per_node})", w,
                  dataclasses.replace(hw, nodes=hw.nodes * 2)))
    out = []
    for label, w2, hw2 in tries:
        cands = [estimate(shape, w2, hw2, s) for s in STRATEGIES]
        best, _ = recommend(cands, hw2)
        if best is not None:
            c = next(c for c in cands if c.strategy == best)
            out.append(f"{label}: {best} at {c.per_gpu_gib.total:.1f} GiB per GPU")
    return out


def make_plan(shape: ModelShape, w: Workload, hw: Hardware, strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """The plan as the JSON object of CONTRACTS.md section 3 (plus `alternatives` when nothing fits)."""
    cands = [estimate(shape, w, hw, s) for s in strategies]
    best, reason = recommend(cands, hw)
    plan: dict[str, Any] = {
        "shardfit_version": __version__,
        "model": {"id": shape.id, "params": shape.params(), "trainable_params": trainable_params(shape, w),
                  "layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab},
        "hardware": {"nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node, "gpu_mem_gib": round(hw.gpu_mem_gib, 2),
                     "cpu_mem_gib": round(hw.cpu_mem_gib, 1) if hw.cpu_mem_gib else None},
        "workload": dataclasses.asdict(w),
        "candidates": [c.to_json() for c in cands],
        "recommended": best,
        "reason": reason,
    }
    if best is None:
        plan["alternatives"] = alternatives(shape, w, hw)
    return plan


PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def format_table(plan: dict) -> str:
    """A readable table of the plan for the terminal."""
    m, hw, w = plan["model"], plan["hardware"], plan["workload"]
    lines = [f"{m['id']}: {m['params'] / 1e9:.2f}B params, {m['trainable_params'] / 1e6:.1f}M trainable "
             f"({w['method']}, {w['precision']}, seq {w['seq_len']} x batch {w['micro_batch']}, "
             f"grad-ckpt {w['grad_ckpt']}, {w['optimizer']}"
             + _loss_label(w.get("loss", "chunked")) + (", frozen fp32" if w.get("frozen_fp32") else "")
             + (", 16-bit adapters" if w.get("adapters_16bit") and w["method"] in ("lora", "qlora") else "") + ")",
             f"hardware: {hw['nodes']} node(s) x {hw['gpus_per_node']} GPU(s) x {hw['gpu_mem_gib']:.1f} GiB", "",
             f"{'strategy':<15}{'weights':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'logits':>8}{'temp':>8}"
             f"{'runtime':>8}{'total':>9}  peak  fits  notes"]
    for c in plan["candidates"]:
        g = c["per_gpu_gib"]
        lines.append(f"{c['strategy']:<15}{g['weights']:>8.2f}{g['grads']:>8.2f}{g['optimizer']:>8.2f}"
                     f"{g['activations']:>8.2f}{g['logits']:>8.2f}{g['temporaries']:>8.2f}"
                     f"{g['runtime_overhead']:>8.2f}{g['total']:>9.2f}  {PHASE_SHORT.get(c['peak_phase'], ''):<4}  "
                     f"{'yes ' if c['fits'] else 'NO  '}  "
                     f"{c['notes']}" + (f" (host {c['cpu_gib']:.0f} GiB/GPU)" if c["cpu_gib"] else ""))
    lines += ["", "per-GPU GiB at the step's peak (fwd: the loss, bwd: backward, opt: the optimizer step); "
                  "total = tensors + runtime (CUDA context, NCCL, allocator reserve)", ""]
    if plan["recommended"]:
        lines.append(f"recommended: {plan['recommended']} ({plan['reason']})")
    else:
        lines.append("nothing fits. Nearest alternatives:")
        lines += [f"  - {a}" for a in plan.get("alternatives", [])] or ["  - none found"]
    return "\n".join(lines)


def _loss_label(loss: str) -> str:
    return {"full": ", full-logits loss", "full_shift": ", full-logits loss with shifted copy",
            "full_shift16": ", full-logits loss with shifted 16-bit copy"}.get(loss, "")


def plot(plan: dict, path: str) -> None:
    """Stacked bars per strategy against the GPU capacity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["weights", "grads", "optimizer", "activations", "logits", "temporaries", "runtime_overhead"]
    names = [c["strategy"] for c in plan["candidates"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(names)
    for part in parts:
        vals = [c["per_gpu_gib"][part] for c in plan["candidates"]]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    cap = plan["hardware"]["gpu_mem_gib"]
    ax.axhline(cap, color="red", linestyle="--", label=f"GPU memory {cap:.0f} GiB")
    ax.set_ylim(0, max(cap * 1.6, min(max(bottom), cap * 6)))
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{plan['model']['id']} ({plan['workload']['method']}) on {plan['hardware']['nodes']}x"
                 f"{plan['hardware']['gpus_per_node']} GPUs")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
