"""The planner against published peak-memory measurements (bench/published_memory.yaml).

    python bench/plan_vs_published.py          # prints the table, writes bench/results/plan_vs_published.json

Each case is predicted with the settings its source ran (the source's defaults, then the case's own keys):
- measured: the error is the predicted reading over the reported peak, minus one; the verdict is whether the
  planner agrees that the run fit the card.
- max_context: the run at `seq` just fit the card, so its real peak lay just under the card's memory: the error is
  the predicted total at `seq` over the card's memory, minus one. The planner's own largest fitting sequence
  length is printed beside the published one.
- oom: right when the planner says that the run does not fit.

Every verdict is the plan's own: its `total` (the tensors, the reserve a full card cannot give back, the runtime)
against the card. A measured peak is a successful run's READING on a card that may have room, predicted by
shardfit.plan.estimate.peak_reading: `reading: total` (the default) is the device as nvidia-smi shows it, the
tensor peak with the allocator's cache and the runtime; `reading: reserved` torch.cuda.max_memory_reserved(), which
holds neither the CUDA context nor NCCL's buffers; both capped by the card (the allocator frees its cache before a
request fails). `reading: allocated` is torch.cuda.max_memory_allocated() (torchtune's "peak memory active"): the
tensor peak alone. `nodes` spreads `gpu` over several nodes. `deepspeed` holds the ZeRO settings of a DeepSpeed run,
predicted by plan/deepspeed.py instead of the FSDP strategies.
Summaries are given per source, per part and per `family` (who measured) within each part.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed  # noqa: E402
from shardfit.plan.estimate import GIB, Breakdown, estimate, peak_reading  # noqa: E402
from shardfit.plan.hardware import Hardware, parse_gpus  # noqa: E402
from shardfit.plan.shapes import ModelShape, resolve_shape  # noqa: E402
from shardfit.plan.timing import step_time  # noqa: E402
from shardfit.plan.workload import Workload  # noqa: E402

CASES = ROOT / "bench" / "published_memory.yaml"
THROUGHPUT = ROOT / "bench" / "published_throughput.yaml"
OUT = ROOT / "bench" / "results" / "plan_vs_published.json"
WORKLOAD_KEYS = {f.name for f in dataclasses.fields(Workload)} - {"seq_len"}
# Keys of a case the comparison itself reads (what was measured, where, how it was read).
CASE_KEYS = {"kind", "unit", "peak", "model", "gpu", "nodes", "strategy", "seq", "reading", "deepspeed", "family"}
# Settings written down because the source ran them, which the planner does not model (none at present: FSDP1's
# `flat_params` became a Workload key with `fsdp1_no_sync`).
RECORDED_ONLY: set[str] = set()
# A peak in the source's unit, as GiB (nvidia-smi prints MiB: 2^20 bytes).
UNITS = {"GB": 1e9 / GIB, "GiB": 1.0, "MiB": 2**20 / GIB}
# What the plan chooses between for one workload: a pair of runs that differs only in these (the batch may differ
# with them: a sharded strategy is run at the larger batch it makes room for) is a strategy pair.
PLAN_CHOICES = ("strategy", "grad_ckpt", "compile")
# Workload keys that say how a published run's sharding engine ran (FSDP1, its no_sync(), flat parameters, its
# prefetch, DeepSpeed's fetch): part of the strategy a run chose, not of its workload, so a one-GPU run and an
# FSDP1 run of the same job are a strategy pair.
ENGINE_KEYS = ("fsdp1", "fsdp1_mixed_units", "fsdp1_no_sync", "flat_params", "fsdp1_no_backward_prefetch",
               "zero3_sync_fetch")


def part(source: str) -> str:
    """`dev` or `test`, by a rule fixed before any error was looked at: the parity of the first hex digit of
    sha256(source name). Only dev sources may inform the model; the test part is the headline."""
    return "dev" if int(hashlib.sha256(source.encode()).hexdigest()[0], 16) % 2 == 0 else "test"


def hardware(case: dict) -> Hardware:
    return parse_gpus(str(case["gpu"]), nodes=case.get("nodes", 1))


def predicted(case: dict, seq: int) -> Breakdown:
    """The planner's per-GPU breakdown (GiB) for `case` at sequence length `seq`."""
    w = workload(case, seq)
    shape, hw = resolve_shape(case["model"]), hardware(case)
    if "deepspeed" in case:
        return estimate_deepspeed(shape, w, hw, ZeroSettings(**case["deepspeed"])).per_gpu_gib
    return estimate(shape, w, hw, case.get("strategy", "single")).per_gpu_gib


def predicted_total(case: dict, seq: int) -> float:
    """Per-GPU GiB the planner predicts `case`'s published peak reads at sequence length `seq`, as its `reading`
    (`read_as`)."""
    return read_as(predicted(case, seq), case.get("reading", "total"), hardware(case).gpu_mem_gib)


def fit_total(case: dict, seq: int) -> float:
    """Per-GPU GiB the planner's fit verdict compares with the card: the tensors, the reserve a full card cannot
    give back, and the runtime."""
    return predicted(case, seq).total


def read_as(b: Breakdown, reading: str, gpu_gib: float = float("inf")) -> float:
    """What a successful run's peak read as `reading` holds of the predicted per-GPU breakdown `b` (GiB) on a card
    of `gpu_gib`: `total` the whole device as nvidia-smi shows it (CUDA context and NCCL buffers included),
    `reserved` max_memory_reserved() (the tensor peak and the allocator's cache, capped by the card), `allocated`
    the tensor peak alone (shardfit.plan.estimate.peak_reading)."""
    return peak_reading(b, gpu_gib, reading)


def workload(case: dict, seq: int) -> Workload:
    """The case's Workload: its keys that are Workload fields (lists, such as `lora_targets`, as tuples)."""
    keys = {k: tuple(v) if isinstance(v, list) else v for k, v in case.items() if k in WORKLOAD_KEYS}
    return Workload(seq_len=seq, **keys)


def max_fitting_seq(case: dict) -> int:
    """The largest sequence length (to 1 token) the planner says fits the card; 0 when none does."""
    cap = hardware(case).gpu_mem_gib
    lo, hi = 0, 1 << 22
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fit_total(case, mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def evaluate_case(c: dict, source: str, smallest_seq: int) -> dict:
    """One case with the planner's prediction, the error, and whether the fits/does-not-fit verdict is right."""
    hw = hardware(c)
    cap = hw.gpu_mem_gib
    kind = c["kind"]
    seq = c.get("seq", smallest_seq)
    b = predicted(c, seq)
    fit = b.total  # what the verdict compares with the card
    total = read_as(b, c.get("reading", "total"), cap) if kind == "measured" else fit
    gpus = str(c["gpu"]) if hw.nodes == 1 else f"{hw.nodes} nodes x {c['gpu']}"
    row = {"source": source, "part": part(source), "family": c.get("family", source), "model": c["model"],
           "gpu": gpus,
           "strategy": c.get("strategy", "single"), "gpu_gib": cap, "seq": seq, "kind": kind,
           "reading": c.get("reading", "total"),
           "predicted_total_gib": round(total, 2), "fit_total_gib": round(fit, 2)}
    if kind == "oom":
        row.update(published="OOM", verdict_right=fit > cap)
    elif kind == "max_context":
        row.update(published=f"fits at {seq}", verdict_right=fit <= cap, error=round(fit / cap - 1, 4),
                   predicted_max_seq=max_fitting_seq(c))
    else:
        peak = c["peak"] * UNITS[c["unit"]]
        row.update(published=f"{c['peak']} {c['unit']}", published_gib=round(peak, 2), verdict_right=fit <= cap,
                   error=round(total / peak - 1, 4))
    return row


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows if "error" in r]
    return {"median_abs_error": round(statistics.median(errors), 4) if errors else None,
            "verdicts_right": sum(r["verdict_right"] for r in rows), "verdicts": len(rows)}


def evaluate(spec: dict) -> dict:
    """Every case of every source, with a summary per source and over all."""
    rows, per_source = [], {}
    for name, src in spec["sources"].items():
        cases = [{"family": src.get("family", name), **src["defaults"], **c} for c in src["cases"]]
        smallest: dict[str, int] = {}
        for c in cases:
            if "seq" in c:
                smallest[c["model"]] = min(smallest.get(c["model"], 1 << 30), c["seq"])
        src_rows = [evaluate_case(c, name, smallest.get(c["model"], 0)) for c in cases]
        per_source[name] = {**summary(src_rows), "part": part(name), "text": src["text"]}
        rows += src_rows
    parts = {}
    for p in ("dev", "test"):
        sel = [r for r in rows if r["part"] == p]
        families = {f: summary([r for r in sel if r["family"] == f]) for f in sorted({r["family"] for r in sel})}
        parts[p] = {**summary(sel), "families": families}
    return {"cases": rows, **summary(rows), "parts": parts, "sources": per_source}


def throughput_shape(case: dict) -> ModelShape:
    """The case's model: its inline `shape` (a model the catalog does not hold) or the catalog's."""
    if "shape" in case:
        return ModelShape(id=case["model"], **case["shape"])
    return resolve_shape(case["model"])


def published_rate(case: dict, gpus: int) -> float:
    """The published speed in tokens/s of the whole job; for an `ordering_only` case given per epoch, a rate in
    epochs per minute (comparable only within its source)."""
    if "tokens_per_s_per_gpu" in case:
        return case["tokens_per_s_per_gpu"] * gpus
    if "samples_per_s" in case:
        return case["samples_per_s"] * case["seq"]
    if "minutes_per_epoch" in case:
        return 1.0 / case["minutes_per_epoch"]
    return case["seq"] * case["micro_batch"] * case.get("grad_accum", 1) * gpus / case["s_per_step"]


def evaluate_throughput(spec: dict) -> dict:
    """Predicted against published tokens/s of the whole job, per case, per source and per part; and of pairs of
    runs, whether the predicted faster one is the published faster one."""
    rows = []
    for name, src in spec["sources"].items():
        for c in ({**src["defaults"], **c} for c in src["cases"]):
            hw = hardware(c)
            w = workload(c, c["seq"])
            strategy = c.get("strategy", "single")
            t = step_time(throughput_shape(c), w, hw, strategy)
            gpus = hw.world if strategy not in ("single", "model_parallel") else 1
            published = published_rate(c, gpus)
            rest = {k: v for k, v in dataclasses.asdict(w).items()
                    if k not in PLAN_CHOICES + ENGINE_KEYS + ("micro_batch", "grad_accum")}
            row = {"source": name, "part": part(name), "model": c["model"], "gpu": c["gpu"],
                   "nodes": hw.nodes, "strategy": strategy, "seq": c["seq"], "grad_ckpt": w.grad_ckpt,
                   "compile": w.compile, "float8": w.float8, "micro_batch": w.micro_batch,
                   "workload": json.dumps(rest, sort_keys=True),
                   "ordering_only": bool(c.get("ordering_only")),
                   "published_tokens_per_s": round(published, 4 if c.get("ordering_only") else 1),
                   "predicted_tokens_per_s": round(t.tokens_per_s, 1), "bound": t.bound}
            if not row["ordering_only"]:
                row["error"] = round(t.tokens_per_s / published - 1, 4)
            rows.append(row)

    def stats(sel: list[dict]) -> dict:
        errs = [abs(r["error"]) for r in sel if "error" in r]
        return {"median_abs_error": round(statistics.median(errs), 4) if errs else None, "n": len(errs)}
    return {"cases": rows, **stats(rows), "parts": {p: {**stats([r for r in rows if r["part"] == p]),
                                                        **ordering([r for r in rows if r["part"] == p])}
                                                    for p in ("dev", "test")},
            "sources": {n: {**stats([r for r in rows if r["source"] == n]), "part": part(n)}
                        for n in spec["sources"]},
            "float8_pairs": float8_pairs(rows)}


def float8_pairs(rows: list[dict]) -> list[dict]:
    """Every run with `float8: true` beside the run of its source that differs from it only in float8 (the same
    model, GPUs, strategy, checkpointing, compile, batch and workload): the FP8 run's tokens/s over the bf16 one's,
    published and predicted, and the predicted ratio's error against the published one (an `ordering_only` pair
    too: its two published rates are over the same data)."""
    def key(r: dict) -> tuple:
        work = {k: v for k, v in json.loads(r["workload"]).items() if k != "float8"}
        return (r["source"], r["model"], r["gpu"], r["nodes"], r["strategy"], r["grad_ckpt"], r["compile"],
                r["micro_batch"], r["seq"], json.dumps(work, sort_keys=True))
    bf16 = {key(r): r for r in rows if not r["float8"]}
    out = []
    for fp8 in (r for r in rows if r["float8"]):
        base = bf16.get(key(fp8))
        if base is None:
            continue
        published = fp8["published_tokens_per_s"] / base["published_tokens_per_s"]
        predicted = fp8["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
        out.append({"source": fp8["source"], "part": fp8["part"], "model": fp8["model"], "gpu": fp8["gpu"],
                    "nodes": fp8["nodes"], "seq": fp8["seq"], "grad_ckpt": fp8["grad_ckpt"],
                    "compile": fp8["compile"], "micro_batch": fp8["micro_batch"],
                    "published_ratio": round(published, 3), "predicted_ratio": round(predicted, 3),
                    "ratio_error": round(predicted / published - 1, 4)})
    return out


def markdown(result: dict) -> str:
    lines = ["| source | model | GPU | strategy | tokens | published | predicted GiB | error | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        err = f"{r['error']:+.1%}" if "error" in r else "-"
        lines.append(f"| {r['source']} | {r['model']} | {r['gpu']} | {r['strategy']} | {r['seq']:,} | "
                     f"{r['published']} | {r['predicted_total_gib']:.1f} | {err} | "
                     f"{'right' if r['verdict_right'] else 'WRONG'} |")
    lines.append("")
    for name, s in result["sources"].items():
        lines.append(f"{name}: median |error| {s['median_abs_error']:.1%}; verdicts right "
                     f"{s['verdicts_right']}/{s['verdicts']}")
    lines.append(f"all: median |error| {result['median_abs_error']:.1%}; verdicts right "
                 f"{result['verdicts_right']}/{result['verdicts']}")
    for p, ps in result["parts"].items():
        if ps["median_abs_error"] is not None:
            lines.append(f"memory {p}: median |error| {ps['median_abs_error']:.1%}; verdicts right "
                         f"{ps['verdicts_right']}/{ps['verdicts']}")
            for f, fs in ps["families"].items():
                med = "-" if fs["median_abs_error"] is None else f"{fs['median_abs_error']:.1%}"
                lines.append(f"  {p} family {f}: median |error| {med}; verdicts right "
                             f"{fs['verdicts_right']}/{fs['verdicts']}")
    return "\n".join(lines)


def pair_kind(a: dict, b: dict) -> str | None:
    """How two runs of one source on the same model and GPUs differ: `strategy` (only in what the plan chooses:
    strategy, checkpointing, compile; the batch may follow), `same_strategy` (the same choices, another workload:
    sequence length, batch, method, ...), `mixed` (both); None when they are not comparable."""
    if (a["source"], a["model"], a["gpu"], a["nodes"]) != (b["source"], b["model"], b["gpu"], b["nodes"]):
        return None
    choices = any(a[k] != b[k] for k in PLAN_CHOICES)
    work = a["workload"] != b["workload"]
    if choices and not work:
        return "strategy"
    if not choices and (work or a["micro_batch"] != b["micro_batch"]):
        return "same_strategy"
    return "mixed" if choices else None


def ordering(rows: list[dict]) -> dict:
    """Of every two runs that `pair_kind` can compare, whether the predicted faster one is the published faster
    one, counted apart for strategy pairs (what the plan's recommendation rests on) and same-strategy pairs
    (pairs within 5 % of each other are a tie and left out; `mixed` pairs are counted, not scored)."""
    out = {k: {"right": 0, "pairs": 0} for k in ("strategy", "same_strategy")}
    mixed = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            kind = pair_kind(a, b)
            pa, pb = a["published_tokens_per_s"], b["published_tokens_per_s"]
            if kind is None or abs(pa / pb - 1) < 0.05:
                continue
            if kind == "mixed":
                mixed += 1
                continue
            qa, qb = a["predicted_tokens_per_s"], b["predicted_tokens_per_s"]
            out[kind]["pairs"] += 1  # a predicted tie names no faster run: it is not right
            out[kind]["right"] += (pa > pb and qa > qb) or (pa < pb and qa < qb)
    return {"faster_of_two_right": out["strategy"]["right"] + out["same_strategy"]["right"],
            "pairs": out["strategy"]["pairs"] + out["same_strategy"]["pairs"],
            "strategy_pairs": out["strategy"], "same_strategy_pairs": out["same_strategy"], "mixed_pairs": mixed}


def throughput_markdown(result: dict) -> str:
    lines = ["| source | part | model | GPUs | strategy | seq | ckpt | published tok/s | predicted | error | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        gpus = r["gpu"] if r["nodes"] == 1 else f"{r['nodes']} x {r['gpu']}"
        published = f"{r['published_tokens_per_s']:.4g} (rel.)" if r["ordering_only"] else \
            f"{r['published_tokens_per_s']:,.0f}"
        err = f"{r['error']:+.1%}" if "error" in r else "-"
        ckpt = r["grad_ckpt"] + (" +compile" if r["compile"] else "") + (" +fp8" if r["float8"] else "")
        lines.append(f"| {r['source']} | {r['part']} | {r['model']} | {gpus} | {r['strategy']} | {r['seq']:,} | "
                     f"{ckpt} | {published} | {r['predicted_tokens_per_s']:,.0f} | {err} | {r['bound']} |")
    lines.append("")
    for name, s in result["sources"].items():
        med = "-" if s["median_abs_error"] is None else f"{s['median_abs_error']:.1%}"
        lines.append(f"{name} ({s['part']}): median |error| {med} over {s['n']} cases")
    lines.append("")

    def label(r: dict) -> str:
        return (f"{r['strategy']}/{r['grad_ckpt']}{'+compile' if r['compile'] else ''}"
                f"{'+fp8' if r['float8'] else ''}/mb{r['micro_batch']}")
    rows = result["cases"]
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            tie = abs(a["published_tokens_per_s"] / b["published_tokens_per_s"] - 1) < 0.05
            if pair_kind(a, b) != "strategy" or tie:
                continue
            pub = a if a["published_tokens_per_s"] > b["published_tokens_per_s"] else b
            pred = a if a["predicted_tokens_per_s"] > b["predicted_tokens_per_s"] else \
                b if b["predicted_tokens_per_s"] > a["predicted_tokens_per_s"] else None
            other = b if pub is a else a
            # How much faster, not only which: the published faster run over the other, published and predicted.
            ratios = (f"published x{pub['published_tokens_per_s'] / other['published_tokens_per_s']:.2f}, predicted "
                      f"x{pub['predicted_tokens_per_s'] / other['predicted_tokens_per_s']:.2f}")
            lines.append(f"strategy pair ({a['part']}) {a['source']} {a['model']} {a['gpu']}: {label(a)} vs "
                         f"{label(b)}: published faster {label(pub)}, predicted faster "
                         f"{label(pred) if pred else 'neither (tie)'} ({ratios}): "
                         f"{'right' if pred is pub else 'WRONG'}")
    for f in result["float8_pairs"]:
        gpus = f["gpu"] if f["nodes"] == 1 else f"{f['nodes']} x {f['gpu']}"
        lines.append(f"float8 pair ({f['part']}) {f['source']} {f['model']} {gpus} {f['grad_ckpt']}"
                     f"{' +compile' if f['compile'] else ''} mb{f['micro_batch']}: FP8/bf16 tokens/s published "
                     f"x{f['published_ratio']:.2f}, predicted x{f['predicted_ratio']:.2f} ({f['ratio_error']:+.1%})")
    for p, s in result["parts"].items():
        if not s["n"]:
            continue
        sp, ss = s["strategy_pairs"], s["same_strategy_pairs"]
        lines.append(f"time {p}: median |error| {s['median_abs_error']:.1%} over {s['n']} cases; faster of two "
                     f"right: strategy pairs {sp['right']}/{sp['pairs']}, same-strategy pairs "
                     f"{ss['right']}/{ss['pairs']} ({s['mixed_pairs']} pairs differing in both left out)")
    return "\n".join(lines)


def only_part(spec: dict, which: str | None) -> dict:
    """`spec` with only the sources of part `which` (all of them for None)."""
    if which is None:
        return spec
    return {**spec, "sources": {n: s for n, s in spec["sources"].items() if part(n) == which}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("dev", "test"), default=None,
                    help="print only this part's sources (tuning looks at dev alone); the results file is written "
                         "only by a run over both parts")
    args = ap.parse_args(argv)
    result = evaluate(only_part(yaml.safe_load(CASES.read_text()), args.part))
    result["throughput"] = evaluate_throughput(only_part(yaml.safe_load(THROUGHPUT.read_text()), args.part))
    if args.part is None:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print()
    print(throughput_markdown(result["throughput"]))


if __name__ == "__main__":
    main()
