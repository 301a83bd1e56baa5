"""The planner against the blind set (bench/published_blind.yaml): published figures of real fine-tuning runs,
collected by someone who never saw a prediction; an out-of-sample measure, not tuned on.

    python bench/plan_vs_blind.py          # prints the table, writes bench/results/plan_vs_blind.json

Each row is predicted with what it states, the YAML's `unknown` defaults where it states nothing, and its source's
mapping of model, GPUs, strategy and precision onto the planner's vocabulary (bench/plan_vs_published.py's helpers
build the workload, the hardware and the shape). A row the planner cannot describe is counted as not planned, with
its reason. Per planned row:
- memory (rows with a published peak): the error is the predicted per-GPU reading over the peak, minus one (the
  peak converted from the source's unit: GB = 1e9 bytes, GiB = 2^30). The reading (the device as nvidia-smi shows
  it unless the case names `reserved` or `allocated`) is predicted by the in-sample bench's own function,
  plan_vs_published.read_as on the row's card (shardfit.plan.estimate.peak_reading), so both benches read a plan
  alike;
- verdict (every row): right when the planner agrees that the run fit the card (or ran out of memory);
- tokens/s (rows that give a speed): the predicted whole-job tokens/s over the published one, minus one.
`summary` gives, over a set of rows: the median and 90th percentile of |memory error|, the share of memory rows
under-predicted by more than 5 %, verdict accuracy, the median |tokens/s error|; per source and over all. The
in-sample bench's figures (bench/results/plan_vs_published.json, as last written by bench/plan_vs_published.py)
are summarised the same way beside them, labelled in-sample.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import plan_vs_published as pvp  # noqa: E402

from shardfit.errors import UserError  # noqa: E402
from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed  # noqa: E402
from shardfit.plan.estimate import Breakdown, estimate  # noqa: E402
from shardfit.plan.timing import step_time  # noqa: E402

SET = BENCH / "published_blind.yaml"
OUT = BENCH / "results" / "plan_vs_blind.json"
IN_SAMPLE = BENCH / "results" / "plan_vs_published.json"
# A memory row counts as under-predicted when the prediction is more than this far below the published peak.
UNDER = 0.05
METHODS = ("full", "lora", "qlora")


def known(value: Any) -> bool:
    """A value the source states: not None, not `unknown` nor `unknown (the collector's note)`."""
    return value is not None and not str(value).startswith("unknown")


def flag(value: Any) -> bool:
    """A stated yes/no: a bool, or a string that opens with true/false and carries a note after it."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().split(" ")[0].lower()
    if word not in ("true", "false"):
        raise ValueError(f"not a yes/no: {value!r}")
    return word == "true"


def number(value: Any) -> int:
    """A stated count: an int, or the leading number of a value that carries the collector's note after it."""
    if isinstance(value, bool):
        raise ValueError(f"not a count: {value!r}")
    if isinstance(value, int):
        return value
    m = re.match(r"\s*(\d+)\b", str(value))
    if not m:
        raise ValueError(f"not a count: {value!r}")
    return int(m.group(1))


def source_of(row: dict, spec: dict) -> str:
    """The name of the source whose `url` is the row's, or (a source of several documents) one of whose
    `url_prefixes` the row's url starts with."""
    url = row["source_url"]
    names = [name for name, src in spec["sources"].items()
             if src.get("url") == url or any(url.startswith(p) for p in src.get("url_prefixes", ()))]
    if len(names) != 1:
        raise KeyError(f"row of {url}: {len(names)} sources match this url, not one")
    return names[0]


def stated(row: dict, method: str, optimizers: dict | None = None) -> dict:
    """The Workload keys the row states (a value `unknown` is left to the defaults); an optimizer by its source's
    `optimizers` mapping where it has one, else any AdamW as `adamw`."""
    keys: dict[str, Any] = {"method": method}
    if method != "full" and known(row["lora_rank"]):
        keys["lora_rank"] = number(row["lora_rank"])
    for k in ("micro_batch", "grad_accum"):
        if known(row[k]):
            keys[k] = number(row[k])
    if known(row["grad_ckpt"]):
        keys["grad_ckpt"] = "full" if flag(row["grad_ckpt"]) else "none"
    if known(row["optimizer"]) and optimizers is not None:
        keys.update(optimizers[row["optimizer"]])
    elif known(row["optimizer"]):
        if "adamw" not in str(row["optimizer"]).lower():
            raise ValueError(f"optimizer {row['optimizer']!r}: not one the mapping knows")
        keys["optimizer"] = "adamw"
    return keys


def case_of(row: dict, src: dict, spec: dict, settings: dict | None = None) -> dict | str:
    """The row as a case of bench/plan_vs_published.py's vocabulary (model or inline shape, gpu, nodes, strategy,
    deepspeed, seq, reading and Workload keys), or the reason it is not planned. A string a planned row uses that
    its source does not map is an error of the YAML, raised. `settings`: what the row states beyond its columns,
    in the planner's words (Workload keys, `seq`, `reading`), applied last; a sequence length the row leaves
    unknown is the set's `unknown_seq_len`. A source's own `unknown` (its era's defaults) overrides the set's
    `unknown` and `unknown_qlora`, and gives way to what the row maps and states."""
    model = src["models"].get(row["model"], {"model": row["model"]})
    if "not_planned" in model:
        return " ".join(model["not_planned"].split())
    strategy = src["strategies"][row["strategy"]]
    if "not_planned" in strategy:
        return " ".join(strategy["not_planned"].split())
    method = str(row["method"])
    if method not in METHODS:
        return f"method {method!r} is not one the planner models"
    keys = dict(spec["unknown"])
    if method == "qlora":
        keys.update(spec["unknown_qlora"])
    # The source's era defaults (the ninth and later sets): what its date, versions and tool make of an unstated key.
    keys.update(src.get("unknown", {}))
    if known(row["precision"]):
        keys.update(src["precisions"][row["precision"]])
    settings = settings or {}
    # A column the settings restate in numbers ("minimal" batch) is read from the settings alone.
    keys.update(stated({**row, **{k: "unknown" for k in settings if k in row}}, method, src.get("optimizers")))
    if "seq" in settings:  # the row's own length, in numbers (its column may say "81K")
        seq = settings["seq"]
    elif known(row["seq_len"]):
        seq = number(row["seq_len"])
    elif "unknown_seq_len" in spec:
        seq = spec["unknown_seq_len"]
    else:
        raise ValueError(f"row of {row['source_url']}: no sequence length and no unknown_seq_len")
    case = {**keys, "model": model.get("model", row["model"]), **src["gpus"][row["gpus"]], **strategy, **settings,
            "seq": seq}
    if "shape" in model:
        case["shape"] = model["shape"]
    return case


def predict(case: dict) -> dict:
    """The planner's per-GPU peak (GiB, its breakdown) and whole-job tokens/s for one case."""
    shape, hw = pvp.throughput_shape(case), pvp.hardware(case)
    w = pvp.workload(case, case["seq"])
    if "deepspeed" in case:
        cand = estimate_deepspeed(shape, w, hw, ZeroSettings(**case["deepspeed"]))
    else:
        cand = estimate(shape, w, hw, case["strategy"])
    t = step_time(shape, w, hw, case["strategy"])
    b = cand.per_gpu_gib
    parts = ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "allocator_reserve",
             "runtime_overhead")
    out = {"card_gib": hw.gpu_mem_gib, "world": hw.world, "predicted_total_gib": round(b.total, 2),
           "breakdown_gib": {p: round(getattr(b, p), 2) for p in parts}, "peak_phase": cand.peak_phase,
           "predicted_tokens_per_s": round(t.tokens_per_s, 1), "bound": t.bound}
    reading = case.get("reading", "total")
    out.update(reading=reading, predicted_read_gib=round(predicted_reading(b, reading, hw.gpu_mem_gib), 2))
    return out


def predicted_reading(b: Breakdown, reading: str, gpu_gib: float) -> float:
    """What a successful run of breakdown `b` reads as `reading` on a card of `gpu_gib`: the in-sample bench's
    prediction (plan_vs_published.read_as), so that a blind row and an in-sample row are read alike."""
    return pvp.read_as(b, reading, gpu_gib)


def published_rate(rate: dict, row: dict, ranks: int) -> float | str:
    """The job's published tokens/s from a row's speed (`per: gpu` times the data-parallel `ranks`, `per: total`
    as is; `unit: s/it` converted when the row states sequence length, micro batch and accumulation), or why the
    speed is not compared."""
    if rate.get("unit") == "s/it":
        counts = [row[k] for k in ("seq_len", "micro_batch", "grad_accum")]
        if not all(known(c) for c in counts):
            return "a speed in s/it whose row does not state its sequence length, micro batch and accumulation"
        seq, batch, accum = (number(c) for c in counts)
        return seq * batch * accum * ranks / rate["value"]
    per = rate.get("per")
    if per in ("gpu", "total"):
        return rate["value"] * (ranks if per == "gpu" else 1)
    return f"a speed given as {rate.get('unit') or per!r}, not tokens/s of the job or of a GPU"


def row_head(index: int, row: dict, source: str) -> dict[str, Any]:
    """What every evaluated row carries, planned or not: its number, source and the strings it was published
    with."""
    return {"row": index, "source": source, "model": row["model"], "method": row["method"], "gpus": row["gpus"],
            "strategy": row["strategy"], "seq": row["seq_len"], "published_fits": row["fits"]}


def evaluate_row(index: int, row: dict, spec: dict, settings: dict | None = None) -> dict:
    """One row: its prediction, errors and verdict, or its reason for not being planned. The memory error is
    against what the peak's reading holds (the device unless the case says `reading`); `settings` as case_of's."""
    name = source_of(row, spec)
    out = row_head(index, row, name)
    case = case_of(row, spec["sources"][name], spec, settings)
    if isinstance(case, str):
        return {**out, "planned": False, "reason": case}
    try:
        p = predict(case)
    except UserError as e:  # a model or card the planner cannot resolve offline
        return {**out, "planned": False, "reason": str(e)}
    fits = p["predicted_total_gib"] <= p["card_gib"]
    if case["seq"] != row["seq_len"]:  # a length the row leaves unknown or writes in words
        out["planned_seq"] = case["seq"]
    out.update(planned=True, planner_model=case["model"], planner_strategy=case["strategy"],
               workload={k: v for k, v in case.items() if k in pvp.WORKLOAD_KEYS}, **p,
               predicted_fits=fits, verdict_right=fits == bool(row["fits"]))
    peak = row.get("peak_memory")
    if peak:
        gib = peak["value"] * pvp.UNITS[peak["unit"]]
        out.update(published=f"{peak['value']} {peak['unit']}", published_gib=round(gib, 2),
                   error=round(p["predicted_read_gib"] / gib - 1, 4))
    rate = row.get("tokens_per_s")
    if rate and case.get("assumed"):
        out["tokens_left_out"] = "the row does not name its card: its speed is not compared"
    elif rate:
        gpus = p["world"] if case["strategy"] not in ("single", "model_parallel") else 1
        job = published_rate(rate, row, gpus)
        if isinstance(job, str):
            out["tokens_left_out"] = job
        else:
            out.update(published_tokens_per_s=round(job, 1),
                       tokens_error=round(p["predicted_tokens_per_s"] / job - 1, 4))
    return out


def _p90(values: list[float]) -> float:
    """The 90th percentile (linear between the order statistics, numpy's default); the value itself for one."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def summary(rows: list[dict]) -> dict:
    """The figures over `rows` (each a row of `evaluate`, or of the in-sample bench): counts, memory error (median
    and p90 of |error|, share under-predicted by more than UNDER), verdict accuracy, median |tokens/s error|."""
    planned = [r for r in rows if r.get("planned", True)]
    mem = [r["error"] for r in planned if "error" in r]
    tok = [abs(r["tokens_error"]) for r in planned if "tokens_error" in r]
    right = sum(bool(r["verdict_right"]) for r in planned)
    ooms = [r for r in planned if r.get("published_fits") is False]
    absolute = [abs(e) for e in mem]
    return {
        "rows": len(rows), "planned": len(planned), "not_planned": len(rows) - len(planned),
        "memory": {"n": len(mem),
                   "median_abs_error": round(statistics.median(absolute), 4) if mem else None,
                   "p90_abs_error": round(_p90(absolute), 4) if mem else None,
                   "under_predicted": sum(e < -UNDER for e in mem),
                   "under_predicted_share": round(sum(e < -UNDER for e in mem) / len(mem), 4) if mem else None},
        "verdicts": {"n": len(planned), "right": right,
                     "accuracy": round(right / len(planned), 4) if planned else None,
                     "oom_rows": len(ooms), "oom_right": sum(bool(r["verdict_right"]) for r in ooms)},
        "tokens_per_s": {"n": len(tok), "median_abs_error": round(statistics.median(tok), 4) if tok else None},
    }


def in_sample(path: Path = IN_SAMPLE) -> dict | None:
    """The in-sample bench's rows, summarised as `summary` does: memory over its rows with a published peak
    (`kind: measured`; max_context rows are errors against a card, not a peak), verdicts over every row, tokens/s
    over its throughput rows with an error; over all and over its test part. None when the file is missing."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())

    def rows(part: str | None) -> list[dict]:
        mem = [{"verdict_right": r["verdict_right"], "published_fits": r["kind"] != "oom",
                **({"error": r["error"]} if r["kind"] == "measured" else {})}
               for r in data["cases"] if part in (None, r["part"])]
        tok = [{"verdict_right": True, "tokens_error": r["error"], "time_only": True}
               for r in data["throughput"]["cases"] if part in (None, r["part"]) and "error" in r]
        return mem + tok

    def stats(sel: list[dict]) -> dict:
        s = summary([r for r in sel if not r.get("time_only")])
        s["tokens_per_s"] = summary([r for r in sel if r.get("time_only")])["tokens_per_s"]
        return s
    return {"file": str(path.relative_to(BENCH.parent)), "all": stats(rows(None)), "test": stats(rows("test"))}


def evaluate(spec: dict, set_path: Path = SET, one_row: Callable[[int, dict, dict], dict] | None = None) -> dict:
    """Every row, the rows not planned with their reasons, and the summaries over all, per source and in-sample.
    `set_path` is the YAML `spec` was read from (named in the result); `one_row` evaluates one numbered row (a set
    whose rows carry settings beyond their columns passes its own; by default `evaluate_row` without them)."""
    one_row = one_row or evaluate_row
    rows = [one_row(i, row, spec) for i, row in enumerate(spec["rows"], start=1)]
    return {"set": str(set_path.relative_to(BENCH.parent)), "rows": rows,
            "not_planned": [{k: r[k] for k in ("row", "source", "model", "reason")}
                            for r in rows if not r["planned"]],
            "summary": summary(rows),
            "sources": {n: summary([r for r in rows if r["source"] == n]) for n in spec["sources"]},
            "in_sample": in_sample()}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(result: dict) -> str:
    lines = ["| row | source | model | method | GPUs | strategy | seq | published | predicted GiB | error | "
             "verdict | tok/s published | predicted | error |", "|" + "---|" * 14]
    for r in result["rows"]:
        if not r["planned"]:
            continue
        mem = r.get("published", "OOM" if r["published_fits"] is False else "fits")
        tok = (f"{r['published_tokens_per_s']:,.0f} | {r['predicted_tokens_per_s']:,.0f} | {r['tokens_error']:+.1%}"
               if "tokens_error" in r else "- | - | -")
        err = f"{r['error']:+.1%}" if "error" in r else "-"
        seq = r.get("planned_seq", r["seq"])  # the length planned where the row leaves it unknown
        lines.append(f"| {r['row']} | {r['source']} | {r['planner_model']} | {r['method']} | {r['gpus']} | "
                     f"{r['planner_strategy']} | {seq:,} | {mem} | {r['predicted_total_gib']:.1f} | {err} | "
                     f"{'right' if r['verdict_right'] else 'WRONG'} | {tok} |")
    lines.append("")
    for r in result["not_planned"]:
        lines.append(f"not planned: row {r['row']} ({r['source']}): {r['reason']}")
    lines.append("")
    for name, s in [*result["sources"].items(), ("all (blind)", result["summary"])]:
        lines.append(line(name, s))
    if result["in_sample"]:
        for part in ("all", "test"):
            lines.append(line(f"in-sample {part}", result["in_sample"][part]))
    return "\n".join(lines)


def line(name: str, s: dict) -> str:
    m, v, t = s["memory"], s["verdicts"], s["tokens_per_s"]
    return (f"{name}: planned {s['planned']}/{s['rows']}; memory n={m['n']} median |error| "
            f"{_pct(m['median_abs_error'])}, p90 {_pct(m['p90_abs_error'])}, under by >5% "
            f"{m['under_predicted']}/{m['n']}; verdicts {v['right']}/{v['n']} (OOM {v['oom_right']}/{v['oom_rows']}); "
            f"tokens/s n={t['n']} median |error| {_pct(t['median_abs_error'])}")


def docs_table(result: dict) -> str:
    """The figures table of docs/planning.md ("Measured by outsiders"), written from `result` so that the test can
    check the documented figures against a fresh run."""
    lines = ["| set | rows planned | memory rows | median \\|error\\| | p90 \\|error\\| | under by > 5 % | "
             "verdicts right | OOM verdicts right | tokens/s rows | median \\|error\\| |", "|" + "---|" * 10]
    sets = [("**blind, all (out-of-sample)**", result["summary"])]
    sets += [(f"blind: {n}", s) for n, s in result["sources"].items()]
    if result["in_sample"]:
        sets += [(f"in-sample, {p} ({'test part' if p == 'test' else 'dev and test'})", result["in_sample"][p])
                 for p in ("all", "test")]
    for name, s in sets:
        m, v, t = s["memory"], s["verdicts"], s["tokens_per_s"]
        share = "-" if m["n"] == 0 else f"{m['under_predicted']}/{m['n']}"
        verdicts = "-" if v["n"] == 0 else f"{v['right']}/{v['n']}"
        ooms = "-" if v["oom_rows"] == 0 else f"{v['oom_right']}/{v['oom_rows']}"
        lines.append(f"| {name} | {s['planned']}/{s['rows']} | {m['n']} | {_pct(m['median_abs_error'])} | "
                     f"{_pct(m['p90_abs_error'])} | {share} | {verdicts} | {ooms} | {t['n']} | "
                     f"{_pct(t['median_abs_error'])} |")
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The out-of-sample sentence of the README, written from `result` (the test checks the README holds it)."""
    s = result["summary"]
    m, v, t = s["memory"], s["verdicts"], s["tokens_per_s"]
    return (f"memory median error {_pct(m['median_abs_error'])} over {m['n']} peaks ({m['under_predicted']} "
            f"under by more than 5 %), fits-or-not {v['right']}/{v['n']} (out-of-memory runs "
            f"{v['oom_right']}/{v['oom_rows']}), tokens/s median error {_pct(t['median_abs_error'])} over "
            f"{t['n']} runs")


def run(argv: list[str] | None, description: str, set_path: Path, out: Path, evaluate: Any,
        views: list[Any]) -> None:
    """A blind set's command line: evaluate it, write the results (unless --no-write) and print each view of
    them (the per-row table, the docs' table, the line the README or docs quote)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--no-write", action="store_true", help="print only; leave the results file as it is")
    args = ap.parse_args(argv)
    result = evaluate(yaml.safe_load(set_path.read_text()))
    if not args.no_write:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n\n".join(view(result) for view in views))


def main(argv: list[str] | None = None) -> None:
    run(argv, __doc__.split("\n\n")[0], SET, OUT, evaluate, [markdown, docs_table, headline])


if __name__ == "__main__":
    main()
