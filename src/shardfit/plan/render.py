"""The plan as people read it: a terminal table and a bar chart. Both show the numbers of `Plan.to_json`."""

from __future__ import annotations

from shardfit import method as methods
from shardfit.plan.cards import Card, card_of, no_fp8_reason
from shardfit.plan.estimate import ALLOCATOR_CACHE, ALLOCATOR_RESERVE
from shardfit.plan.flops import FP8_CAST_BYTES
from shardfit.plan.hardware import hardware_notes
from shardfit.plan.plan import Plan

PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "eval": "eval"}
PARTS = ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "allocator_reserve",
         "runtime_overhead")


# The table's columns: name, width, right-aligned. The terminal pads to these widths; the UI makes an HTML table.
COLUMNS = (("strategy", 15, False), ("weights", 8, True), ("grads", 8, True), ("optim", 8, True),
           ("activ", 8, True), ("logits", 8, True), ("temp", 8, True), ("reserve", 8, True),
           ("runtime", 8, True), ("total", 9, True),
           ("peak", 6, True), ("fits", 6, True), ("step", 10, True), ("tokens/s", 11, True), ("bound", 7, False),
           ("notes", 0, False))


def format_table(plan: Plan, style: str = "plan") -> str:
    """A readable table of the plan for the terminal (rounded as in the JSON). `style` phrases the alternatives
    for the command the user ran: `plan` flags, or `config` overrides for train and check."""
    def line(cells: list[str]) -> str:
        return "".join(f"{c:>{w}}" if right else f"{c:<{w}}" if i == 0 else f"  {c:<{w}}"
                       for i, (c, (_, w, right)) in enumerate(zip(cells, COLUMNS, strict=True))).rstrip()

    return "\n".join([*header_lines(plan), "", line([name for name, _, _ in COLUMNS]),
                      *[line(row_cells(c)) for c in plan.to_json()["candidates"]], "", legend(plan), "",
                      *verdict_lines(plan, style)])


def header_lines(plan: Plan) -> list[str]:
    """The model and workload, the hardware, and what the plan assumed about it."""
    d = plan.to_json()
    m, w = d["model"], d["workload"]
    moe = (f" ({m['active_params'] / 1e9:.2f}B active: {m['experts_per_token']} of {m['experts']} experts a token)"
           if m.get("active_params") else "")
    return [f"{m['id']}: {m['params'] / 1e9:.2f}B params{moe}, {m['trainable_params'] / 1e6:.1f}M trainable "
            f"({w['method']}, {w['precision']}{_float8_label(w)}, "
            f"seq {w['seq_len']} x batch {w['micro_batch']}, "
            f"grad-ckpt {w['grad_ckpt']}, {w['optimizer']}"
            + _loss_label(w["loss"]) + (", frozen fp32" if w["frozen_fp32"] else "")
            + (", 16-bit adapters" if w["adapters_16bit"] and methods.get(w["method"]).adapters else "")
            + _objective_label(d["objective"]) + ")",
            _hardware_line(plan), *[f"note: {n}" for n in _notes(plan, w["precision"], w.get("float8", False))
                                    + plan.notes]]


def row_cells(c: dict) -> list[str]:
    """One candidate (its JSON) as the table's cells, in COLUMNS order."""
    g = c["per_gpu_gib"]
    runs = c["fits"] and c["applies"]  # a row that cannot run gets no time: it would never take one
    notes = c["notes"] + (f" (host {c['cpu_gib']:.0f} GiB/GPU)" if c["cpu_gib"] and c["applies"] else "")
    return [c["strategy"], *(f"{g[k]:.2f}" for k in PARTS), f"{g['total']:.2f}",
            PHASE_SHORT.get(c["peak_phase"], ""), _fits(c), _step(c["step_s"] if runs else None),
            _tps(c["tokens_per_s"] if runs else None), (c["bound"] if runs else None) or "-", notes]


def verdict_lines(plan: Plan, style: str = "plan") -> list[str]:
    """The recommendation and why, or the nearest alternatives when nothing fits."""
    if plan.recommended:
        return [f"recommended: {plan.recommended} ({plan.reason})"]
    phrases = [a.phrase(style) for a in plan.alternatives or []]
    a = plan.adjusted
    if a is not None and a.how(style):
        rate = f", {_tps(a.tokens_per_s)} tokens/s" if a.tokens_per_s else ""
        return [f"nothing fits as configured. recommended: {a.strategy} with {a.what} ({a.how(style)}): "
                f"{a.total_gib:.1f} GiB per {a.unit}{rate}; the trained result is the same (the same examples, "
                "global batch and update), only memory and speed change", "Other changes that make something fit:",
                *[f"  - {p}" for p in phrases if p]]
    return ["nothing fits. Nearest alternatives:", *([f"  - {p}" for p in phrases if p] or [
        "  - none found: neither one change, nor QLoRA with checkpointing and micro-batch 1, nor up to 16x the "
        "GPUs makes a strategy fit; a smaller model or larger GPUs"])]


def _fits(c: dict) -> str:
    return "n/a" if not c["applies"] else "yes" if c["fits"] else "NO"


def legend(plan: Plan) -> str:
    """What the columns mean, in the terms of the hardware named: a CPU job's processes share the host's RAM."""
    if plan.hardware.name == "cpu":
        return ("per-process GiB of host RAM at the step's peak (fwd: the loss, bwd: backward, opt: the optimizer "
                "step); total = tensors + reserve (the allocator's) + runtime (the process's torch runtime); fits: n/a "
                "where a CPU cannot run the strategy; step: one optimizer step, tokens/s: the whole job's (none for "
                "a row that cannot run), bound: what the step waits on (compute, host: launching ops, comm)")
    return ("per-GPU GiB at the step's peak (fwd: the loss, bwd: backward, opt: the optimizer step); tensors: "
            "torch.cuda.max_memory_allocated(); + reserve (the fragmentation a full card's caching allocator cannot "
            f"give back, {100 * ALLOCATOR_RESERVE:.1f} %): the least max_memory_reserved() it fits in; total = that + "
            "runtime (CUDA context, NCCL): the least device memory it fits in, which decides fits; "
            f"a run on a card with room reads more: max_memory_reserved() = tensors + {100 * ALLOCATOR_CACHE:.1f} % "
            "(the allocator's cache) + the pools of FSDP's own streams (gradient shards, gathered weights; --json: "
            "stream_pool), nvidia-smi that + runtime, at most the card; "
            "fits: n/a where these GPUs cannot run the strategy; "
            "step: one optimizer step, tokens/s: the whole job's (none for a row that cannot run), bound: what the "
            "step waits on (compute, host: launching ops, comm, pcie)")


def _float8_label(w: dict) -> str:
    """What the header says of float8: nothing where the plan leaves it out (float8_notes says why)."""
    if not w.get("float8") or methods.get(w["method"]).quantized or w["precision"] != "bf16":
        return ""
    return " + FP8 matmuls, compiled" if w["compile"] else " + FP8 matmuls, uncompiled"


def _notes(plan: Plan, precision: str, float8: bool = False) -> list[str]:
    card = card_of(plan.hardware)
    assumed = card.assumed if plan.hardware.name != "cpu" else None
    return hardware_notes(plan.hardware, precision) + ([assumed] if assumed else []) + \
        (float8_notes(plan, card) if float8 else [])


def float8_notes(plan: Plan, card: Card) -> list[str]:
    """What `--float8` plans on `card` where it does not speed the run up as FP8 does on a GPU that has it."""
    w = plan.workload
    if methods.get(w.method).quantized or w.precision != "bf16":
        why = f"method {w.method}" if methods.get(w.method).quantized else f"precision {w.precision}"
        return [f"float8 with {why}: check and train refuse it (FP8 casts 16-bit bf16 weights), so this plan "
                "leaves it out"]
    if card.key == "cpu":
        return ["float8 on a CPU is emulated: the casts run without the FP8 speed (a test of the numerics only)"]
    if card.fp8_flops is None:
        return [f"float8 on {card.key.upper()}: {no_fp8_reason(card.key)}; it only adds its casts here, and check "
                "and train refuse it"]
    if not w.compile:
        return [f"float8 uncompiled: torchao's casts to FP8 run as separate kernels ({FP8_CAST_BYTES['eager']} "
                f"bytes moved per element, {FP8_CAST_BYTES['compiled']} compiled), slower than bf16 here; "
                "train with compile: true and packing off or static_shape: true (--compile plans it)"]
    return []


def _step(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _tps(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:,.0f}" if t >= 10 else f"{t:.2g}"  # a slow CPU row reads 0.75, not 1 (or 0)


def _hardware_line(plan: Plan) -> str:
    hw = plan.hardware
    if hw.name == "cpu":  # no GPU: each process computes on the CPU and shares the host's memory
        return (f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} CPU process(es) x {round(hw.gpu_mem_gib, 2):.1f} "
                "GiB of host RAM (no GPU)")
    return f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) x {round(hw.gpu_mem_gib, 2):.1f} GiB"


def _objective_label(o: dict) -> str:
    """The objective and its reference (the plan's JSON `objective`), for a preference run; SFT says nothing."""
    if o["name"] == "sft":
        return ""
    ref = {"adapters_off": "reference: adapters off", "precomputed": "reference: precomputed"}.get(
        o["reference"], "no reference")
    return f", objective {o['name']} ({ref})"


def _loss_label(loss: str) -> str:
    return {"full": ", full-logits loss", "full_shift": ", full-logits loss with shifted copy",
            "full_shift16": ", full-logits loss with shifted 16-bit copy"}.get(loss, "")


def plot(plan: Plan, path: str) -> None:
    """Stacked bars per strategy against the GPU capacity line."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan.to_json()
    names = [c["strategy"] for c in d["candidates"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(names)
    for part in PARTS:
        vals = [c["per_gpu_gib"][part] for c in d["candidates"]]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    cap = d["hardware"]["gpu_mem_gib"]
    unit = plan.hardware.unit
    ax.axhline(cap, color="red", linestyle="--",
               label=f"{'host RAM per process' if unit == 'process' else 'GPU memory'} {cap:.0f} GiB")
    # The predicted speed under each strategy's name (only where the strategy can run); the recommendation marked.
    ax.set_xticks(range(len(names)), [
        f"{'* ' if c['strategy'] == d['recommended'] else ''}{c['strategy']}"
        + (f"\n{_tps(c['tokens_per_s'])} tok/s\n{_step(c['step_s'])}/step"
           if c["tokens_per_s"] and c["fits"] and c["applies"] else "" if c["applies"] else "\nn/a")
        for c in d["candidates"]], fontsize=8)
    ax.set_ylim(0, max(cap * 1.6, min(max(bottom), cap * 6)))
    ax.set_ylabel(f"GiB per {unit}")
    count = d["hardware"]["gpus_per_node"]
    ax.set_title(f"{d['model']['id']} ({d['workload']['method']}) on {d['hardware']['nodes']}x{count} "
                 + ("CPU process(es)" if unit == "process" else "GPUs")
                 + (f"; * recommended: {d['recommended']}" if d["recommended"] else ""))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
