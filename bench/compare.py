"""shardfit against the peers users run, on the same fine-tunes (docs/reference.md, `bench/results/latest.json`).

    python bench/compare.py                              # every workload and peer, 3 interleaved rounds
    python bench/compare.py --runs 1                     # one round (the whole bench in < 30 min on 2 cores)
    python bench/compare.py --runs 1 --workloads smollm2-135m-lora --peers trl_sft
    python bench/compare.py --variants sdpa:attn_implementation=sdpa  # shardfit with a setting changed, as a peer

shardfit runs as a user runs it: `python -m shardfit train cfg.yaml` (`--nproc 2` for the 2-rank workload), the
config holding only what the workload sets (bench/workloads.py); compile, attention, packing and what micro_batch
counts are shardfit's defaults of the checkout being measured. The peers (bench/peers.py) get the same model
folder, token ids, LoRA, lr, schedule, seed and epochs, each in two modes:

    same_config     the user's micro_batch / grad_accum / epochs given unchanged to the peer, and no precision
                    unless the workload sets one: each tool computes in its own default precision
    equal_examples  the peer's batch set so it trains as many examples per optimizer step as shardfit did in the
                    same round (shardfit's examples per step = training examples x epochs / its optimizer steps)
    same_precision  the same_config run with the precision shardfit resolved for itself given to the peer (bf16:
                    the Trainer's bf16 autocast, a LoRA base loaded in bf16): what is left when both compute alike

A mode whose batch and precision come out as another mode's reuses that run instead of repeating it. A variant
(`--variants NAME:KEY=VALUE,...`) is shardfit with those config keys set, run after shardfit in each round and
compared with it as a peer is (`shardfit:NAME`, mode `variant`): an A/B of a default on the same footing.

Each run is its own process; a round runs shardfit, then every peer and mode, so machine noise hits all alike; the
JSON keeps every run (with the 1-minute load average when it began) beside the medians and the per-round ratios'
medians. Wall time is the whole process (imports, model load, data preparation, training, saving); training time
is the training loop only (shardfit's summary.json; the peers' trainer.train()). Peak memory is the largest rank's
peak resident set. Eval loss is one evaluator for all (bench/evaluator.py), run after each round, untimed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import PEERS, rows_per_step  # noqa: E402 - bench/ is not a package; its path is set above
from proc import Measured, run_measured  # noqa: E402
from workloads import ROOT, WORKLOADS, Workload, overrides, prepare, tokenized, user_config  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
MODES = ("same_config", "equal_examples", "same_precision")
# Medians kept per side; the ratios are shardfit's over the peer's, per round, then the median.
METRICS = ("tokens_per_s", "train_tokens_per_s", "wall_s", "train_s", "peak_mem_gib", "eval_loss", "steps",
           "examples_per_step", "mfu")
# The targets, at the same user config (whole-process tokens/s): peer -> ratio -> (comparison, bound).
TARGETS = {"hf_trainer": {"speedup": (">=", 2.0), "memory_ratio": ("<=", 0.6), "eval_loss_ratio": ("<=", 1.02)},
           "trl_sft": {"speedup": (">=", 1.3), "memory_ratio": ("<=", 0.8)},
           "deepspeed_zero3": {"speedup": (">=", 1.5), "memory_ratio": ("<=", 0.7)}}
RATIOS = {"speedup": "tokens_per_s", "train_speedup": "train_tokens_per_s", "memory_ratio": "peak_mem_gib",
          "eval_loss_ratio": "eval_loss"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; unknown workloads, peers or modes end with exit 2 and the valid names."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds per workload (medians over them)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), metavar="NAME",
                   help=f"some of: {', '.join(WORKLOADS)}")
    p.add_argument("--peers", nargs="+", default=list(PEERS), metavar="PEER", help=f"some of: {', '.join(PEERS)}")
    p.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE", help=f"some of: {', '.join(MODES)}")
    p.add_argument("--variants", nargs="+", default=[], metavar="NAME:KEY=VALUE,...",
                   help="shardfit runs with config keys set (values as YAML), compared with shardfit's defaults")
    p.add_argument("--out", default=str(RESULTS / "latest.json"), help="the JSON written (others' entries kept)")
    p.add_argument("--work-dir", default=None,
                   help="where runs write, kept (default: a new temporary folder, removed at the end)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="OpenMP threads of a one-process run (ranks get 1 each); on a machine shared with other "
                        "jobs, 1 avoids threads spinning while they wait for a core")
    args = p.parse_args(argv)
    for name, given, valid in (("workload", args.workloads, WORKLOADS), ("peer", args.peers, PEERS),
                               ("mode", args.modes, MODES)):
        bad = [g for g in given if g not in valid]
        if bad:
            p.error(f"unknown {name} {', '.join(bad)}; choose from {', '.join(valid)}")
    if args.runs < 1 or args.threads < 1:
        p.error("--runs and --threads must be at least 1")
    try:
        args.variants = [parse_variant(v) for v in args.variants]
    except ValueError as e:
        p.error(str(e))
    return args


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME:KEY=VALUE,KEY=VALUE` as (name, settings); each value read as YAML (`false`, `64`, `sdpa`)."""
    name, _, body = text.partition(":")
    pairs = [p.partition("=") for p in body.split(",") if p]
    if not name or not pairs or any(not k or not sep for k, sep, _ in pairs):
        raise ValueError(f"--variants {text}: write NAME:KEY=VALUE[,KEY=VALUE], e.g. sdpa:attn_implementation=sdpa")
    return name, {k: yaml.safe_load(v) for k, _, v in pairs}


THREADS = {"n": os.cpu_count() or 1}  # set from --threads by main()


def _env(nproc: int, deepspeed: bool = False, extra: dict[str, str] | None = None) -> dict[str, str]:
    src = str(ROOT / "src")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # Ranks share the cores, one thread each, as shardfit's launcher sets.
               OMP_NUM_THREADS=str(THREADS["n"] if nproc == 1 else 1))
    if deepspeed:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(extra or {})
    return env


def _failed(what: str, m: Measured) -> SystemExit:
    sys.stderr.write(m.output_tail)
    return SystemExit(f"bench run failed ({what}, exit {m.returncode}); its output is above")


def run_shardfit(w: Workload, cfg: dict, run_dir: Path, n_examples: int, env: dict[str, str] | None = None) -> dict:
    """shardfit as a user runs it: the config file and the CLI (torchrun through `--nproc` for several ranks);
    `env`: variables set for this run only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg))  # JSON is YAML: the config loader reads it as the user's file
    cmd = [sys.executable, "-m", "shardfit", "train", str(path)] + (["--nproc", str(w.nproc)] if w.nproc > 1 else [])
    m = run_measured(cmd, _env(w.nproc, extra=env))
    if m.returncode != 0:
        raise _failed(f"shardfit {w.name}", m)
    out = Path(cfg["output_dir"])
    summary = json.loads((out / "summary.json").read_text())
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    ranks = summary["peak_mem_gib"]
    return _record("shardfit", None, m, tokens=summary["tokens"], train_s=summary["train_s"],
                   steps=summary["steps"], examples=n_examples * w.epochs, rank_peaks=ranks,
                   batch=w.micro_batch, saved=out / ("adapter" if w.method == "lora" else "model"),
                   extra={"strategy": summary.get("strategy"), "precision": resolved["precision"],
                          "attn_implementation": resolved["attn_implementation"], "compile": resolved["compile"],
                          "predicted_tokens_per_s": summary.get("predicted_tokens_per_s")})


def run_peer(w: Workload, peer: str, mode: str, cfg: dict, run_dir: Path, batch: int,
             env: dict[str, str] | None = None) -> dict:
    """One peer in its own process (under torchrun for several ranks); `env`: variables set for this run only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, result = run_dir / "config.json", run_dir / "result.json"
    path.write_text(json.dumps(cfg))
    script = [str(BENCH / "peers.py"), "--peer", peer, "--config", str(path), "--batch", str(batch),
              "--result", str(result)]
    if w.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={w.nproc}", "--standalone", *script]
    else:
        cmd = [sys.executable, *script]
    m = run_measured(cmd, _env(w.nproc, deepspeed=peer.startswith("deepspeed"), extra=env))
    if m.returncode != 0:  # a peer that cannot run the config (killed for memory, say) is a result, not a bench bug
        why = "killed (out of memory?)" if m.returncode in (-9, 137) else f"exit {m.returncode}"
        sys.stderr.write(m.output_tail[-1500:])
        return {"who": peer, "mode": mode, "batch_per_device": batch, "failed": why, "wall_s": m.wall_s,
                "asked_precision": cfg.get("precision"),
                "process_peak_rss_gib": m.peak_rss_gib, "load_avg_1m": m.load_avg_1m, "saved": None}
    ranks = [json.loads(result.read_text())] if w.nproc == 1 else \
        [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(w.nproc)]
    r0 = ranks[0]
    if r0["trainer_world"] != w.nproc:  # a peer that did not shard its data would be measured doing other work
        raise SystemExit(f"{peer} {w.name}: the Trainer saw {r0['trainer_world']} process(es), not {w.nproc}")
    extra = {k: v for k, v in r0.items()
             if k.startswith("trl_") or k in ("packed_rows", "trainer_world", "distributed_type", "precision")}
    extra["asked_precision"] = cfg.get("precision")
    return _record(peer, mode, m, tokens=r0["tokens"], train_s=max(r["train_s"] for r in ranks), steps=r0["steps"],
                   examples=r0["examples"] * w.epochs, rank_peaks=[r["peak_mem_gib"] for r in ranks], batch=batch,
                   saved=Path(cfg["output_dir"]) / ("adapter" if w.method == "lora" else "model"), extra=extra)


def _record(who: str, mode: str | None, m: Measured, *, tokens: int, train_s: float, steps: int, examples: int,
            rank_peaks: list[float], batch: int, saved: Path, extra: dict) -> dict:
    return {"who": who, "mode": mode, "batch_per_device": batch, "wall_s": m.wall_s, "train_s": train_s,
            "tokens": tokens, "tokens_per_s": tokens / m.wall_s, "train_tokens_per_s": tokens / train_s,
            "steps": steps, "examples_per_step": examples / max(steps, 1), "peak_mem_gib": max(rank_peaks),
            "rank_peak_rss_gib": rank_peaks, "process_peak_rss_gib": m.peak_rss_gib,
            "load_avg_1m": m.load_avg_1m, "saved": str(saved), **extra}


def evaluate_round(records: list[dict], cfg: dict, work: Path) -> None:
    """The shared evaluator over every run of a round, in one process (untimed); fills each record's eval_loss."""
    path, result = work / "eval-config.json", work / "eval-result.json"
    path.write_text(json.dumps(cfg))
    dirs = list(dict.fromkeys(r["saved"] for r in records if r["saved"]))
    m = run_measured([sys.executable, str(BENCH / "evaluator.py"), "--config", str(path), "--dirs", *dirs,
                      "--result", str(result)], _env(1))
    if m.returncode != 0:
        raise _failed("evaluator", m)
    losses = json.loads(result.read_text())
    for r in records:
        if r["saved"]:
            r["eval_loss"] = losses[r["saved"]]


def peer_batch(w: Workload, peer: str, mode: str, sf_examples_per_step: float, n_examples: int,
               packed_rows: int | None) -> int:
    """Per-device batch of a peer: the user's micro_batch (same_config), or what trains shardfit's examples per
    optimizer step (equal_examples; packed rows for TRL, which packs)."""
    if mode in ("same_config", "same_precision"):
        return w.micro_batch
    per_device = sf_examples_per_step / (w.grad_accum * w.nproc)
    if peer == "trl_sft" and packed_rows is not None:
        return rows_per_step(per_device, n_examples, packed_rows)
    return max(1, round(per_device))


def same_run(rec: dict, batch: int, precision: str | None) -> bool:
    """Whether a peer's finished run `rec` is the run a mode asking for `batch` and `precision` (None: the peer's
    default) would make: the same batch, and the same precision asked for or, asked explicitly, the one it ran."""
    if "failed" in rec or rec["batch_per_device"] != batch:
        return False
    return rec.get("asked_precision") == precision or (precision is not None and rec.get("precision") == precision)


def trl_packed_rows(train: list[Any], max_seq_len: int) -> int:
    """How many rows TRL's packing (its default strategy) makes of the training examples."""
    import datasets
    from trl.data_utils import pack_dataset

    ds = datasets.Dataset.from_list([{"input_ids": ex.input_ids} for ex in train])
    return len(pack_dataset(ds, max_seq_len))


def bench_workload(w: Workload, args: argparse.Namespace, work: Path) -> dict:
    """Every round of one workload: shardfit, then each peer in each mode; returns its JSON entry."""
    paths = prepare(w, work)
    peers = [p for p in w.peers if p in args.peers]
    base = user_config(w, paths, str(work / "unused"))
    train, _, _ = tokenized(dict(base, eval_data=None))
    n = len(train)
    packed = trl_packed_rows(train, w.max_seq_len) if "trl_sft" in peers else None
    runs: list[dict] = []
    for i in range(args.runs):
        rnd: list[dict] = []
        sf = run_shardfit(w, user_config(w, paths, str(work / f"{w.name}-r{i}-shardfit")),
                          work / f"{w.name}-r{i}-shardfit-cfg", n)
        rnd.append(sf)
        _say(w, i, sf)
        for name, settings in args.variants:
            out = work / f"{w.name}-r{i}-shardfit-{name}"
            var = run_shardfit(w, {**user_config(w, paths, str(out)), **settings}, work / f"{out.name}-cfg", n)
            rnd.append(dict(var, who=f"shardfit:{name}", mode="variant", settings=settings))
            _say(w, i, rnd[-1])
        for peer in peers:
            done: list[dict] = []
            for mode in args.modes:
                batch = peer_batch(w, peer, mode, sf["examples_per_step"], n, packed)
                out = work / f"{w.name}-r{i}-{peer}-{mode}"
                cfg = user_config(w, paths, str(out))
                if mode == "same_precision":
                    cfg["precision"] = sf["precision"]
                same = next((r for r in done if same_run(r, batch, cfg.get("precision"))), None)
                if same is not None:  # the same run as another mode's: keep it once, under both names
                    rnd.append(dict(same, mode=mode, same_run_as=same["mode"]))
                    continue
                rec = run_peer(w, peer, mode, cfg, work / f"{out.name}-cfg", batch)
                done.append(rec)
                rnd.append(rec)
                _say(w, i, rec)
        evaluate_round(rnd, dict(base, eval_data=paths["eval"]), work)
        for r in rnd:
            r["round"] = i
        runs += rnd
    peak = gpu_peak_flops()
    if peak is not None:
        per_token = model_flops_per_token(base)
        for r in runs:
            if "train_tokens_per_s" in r:
                r["mfu"] = r["train_tokens_per_s"] * per_token / peak
    return summarise(w, runs, args.runs)


def gpu_peak_flops() -> float | None:
    """The local GPU's dense bf16 peak in FLOP/s (the planner's card table), or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    from shardfit.plan.cards import card_of
    from shardfit.plan.hardware import detect

    return card_of(detect()).bf16_flops


def model_flops_per_token(cfg: dict) -> float:
    """FLOPs per trained token of the workload `cfg` (the planner's count: forward and backward, no weight
    gradients for LoRA's frozen base, no recomputation, attention over max_seq_len): the same for every tool, so
    MFU ratios are tokens/s ratios. Rows shorter than max_seq_len do less attention than counted."""
    import dataclasses

    from shardfit.config import load_config
    from shardfit.plan.flops import step_flops_per_token
    from shardfit.plan.shapes import resolve_shape
    from shardfit.plan.workload import workload_of

    config = load_config(None, overrides({k: v for k, v in cfg.items() if v is not None}))
    w = dataclasses.replace(workload_of(config), grad_ckpt="none")
    return step_flops_per_token(resolve_shape(config.model), w)


def machine_name() -> str:
    """This machine in words: its GPU where it has one (the runs train there), its CPU cores and memory."""
    import torch

    host = (f"{os.cpu_count()}-core CPU ({platform.machine()}), "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)} (torch {torch.__version__}), {host}"
    return host


def _say(w: Workload, i: int, r: dict) -> None:
    who = r["who"] + (f" ({r['mode']}, batch {r['batch_per_device']})" if r["mode"] else "")
    if "failed" in r:
        print(f"{w.name} round {i + 1}: {who}: failed, {r['failed']}", flush=True)
        return
    print(f"{w.name} round {i + 1}: {who}: {r['tokens_per_s']:.0f} tok/s whole process, "
          f"{r['train_tokens_per_s']:.0f} training, {r['wall_s']:.1f} s, {r['steps']} steps, "
          f"peak {r['peak_mem_gib']:.2f} GiB, load {r['load_avg_1m']:.1f}", flush=True)


def summarise(w: Workload, runs: list[dict], n_rounds: int) -> dict:
    """A workload's JSON entry: medians per side, per-round ratios' medians per peer and mode, every run kept.
    The section-8 keys (hf_trainer, speedup, ...) are the first peer's same-config comparison."""
    sf = [r for r in runs if r["who"] == "shardfit"]
    entry: dict[str, Any] = {"name": w.name, "date": time.strftime("%Y-%m-%d"),
                             "shardfit": {**medians(sf), "precision": sf[0].get("precision"),
                                          "attn_implementation": sf[0].get("attn_implementation")},
                             "runs": n_rounds, "nproc": w.nproc, "workload": workload_json(w), "peers": {}}
    for peer in dict.fromkeys(r["who"] for r in runs if r["who"] != "shardfit"):
        entry["peers"][peer] = {}
        for mode in dict.fromkeys(r["mode"] for r in runs if r["who"] == peer):
            mine = [r for r in runs if r["who"] == peer and r["mode"] == mode]
            ok = [r for r in mine if "failed" not in r]
            entry["peers"][peer][mode] = {**medians(ok), **ratios(sf, ok), "precision": ok[0].get("precision")} \
                if ok else {"failed": mine[0]["failed"], "batch_per_device": mine[0]["batch_per_device"]}
            if all("same_run_as" in r for r in mine):
                entry["peers"][peer][mode]["same_run_as"] = mine[0]["same_run_as"]
    peer = next((p for p in entry["peers"] if p in PEERS), None)  # a tool, not one of shardfit's variants
    first = entry["peers"][peer] if peer else None
    legacy = first.get("same_config") or next(iter(first.values())) if first else None
    if legacy and "failed" not in legacy:
        entry["hf_trainer"] = {k: legacy[k] for k in ("tokens_per_s", "wall_s", "peak_mem_gib", "eval_loss")}
        entry["legacy_peer"] = peer
        entry.update({k: legacy[k] for k in RATIOS})
    entry["load_avg_1m"] = [round(r["load_avg_1m"], 2) for r in runs]
    entry["all_runs"] = runs
    return entry


def medians(runs: list[dict]) -> dict[str, float]:
    """The median of each metric over runs."""
    return {k: statistics.median(r[k] for r in runs) for k in METRICS if all(k in r for r in runs)}


def ratios(sf: list[dict], peer: list[dict]) -> dict[str, float]:
    """shardfit's metric over the peer's, per round (matched by round), then the median over rounds."""
    by_round = {r["round"]: r for r in peer}
    pairs = [(a, by_round[a["round"]]) for a in sf if a["round"] in by_round]
    return {name: statistics.median(a[k] / b[k] for a, b in pairs) for name, k in RATIOS.items()}


def workload_json(w: Workload) -> dict:
    """The workload's settings, for the record."""
    from dataclasses import asdict

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(w).items()}


def merge(report: dict, path: Path) -> dict:
    """`report` with the entries of workloads not run this time taken from the file already there (each entry has
    its date); `report` itself is left as it is, so merging after every workload never keeps a stale entry."""
    if not path.exists():
        return report
    done = {e["name"] for e in report["workloads"]}
    old = [e for e in json.loads(path.read_text()).get("workloads", []) if e["name"] not in done
           and e["name"] in WORKLOADS]
    order = list(WORKLOADS)
    return dict(report, workloads=sorted(old + report["workloads"], key=lambda e: order.index(e["name"])))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    THREADS["n"] = args.threads
    with work_folder(args.work_dir, "shardfit-bench-") as work:
        run_bench(args, work)


@contextlib.contextmanager
def work_folder(asked: str | None, prefix: str) -> Iterator[Path]:
    """Where a bench's runs write: `asked` (kept), or a new temporary folder removed at the end, since every run's
    saved model and checkpoints come to gigabytes a bench."""
    work = Path(asked) if asked else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not asked:
            shutil.rmtree(work, ignore_errors=True)


def run_bench(args: argparse.Namespace, work: Path) -> None:
    """Every asked workload in `work`; the JSON merged into --out after each, the tables printed at the end."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%d"), "command": "python bench/compare.py " + " ".join(sys.argv[1:]),
        "omp_threads": args.threads, "load_avg_1m_at_start": os.getloadavg()[0], "workloads": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = report
    for name in args.workloads:
        report["workloads"].append(bench_workload(WORKLOADS[name], args, work))
        # Written after every workload: a bench stopped half-way keeps what it measured.
        report["bench_s"] = round(time.perf_counter() - t0, 1)
        written = merge(report, out)
        out.write_text(json.dumps(written, indent=1))
    print(markdown(written))


def target_table(report: dict) -> str:
    """Each target against its same-config ratio, per workload: met or missed."""
    lines = ["| workload | peer | ratio | target | measured | |", "|---|---|---|---|---|---|"]
    for e in report["workloads"]:
        for peer, bounds in TARGETS.items():
            v = e.get("peers", {}).get(peer, {}).get("same_config")
            if not v or "failed" in v:
                continue
            for ratio, (op, bound) in bounds.items():
                met = v[ratio] >= bound if op == ">=" else v[ratio] <= bound
                lines.append(f"| {e['name']} | {peer} | {ratio} | {op} {bound} | {v[ratio]:.2f} | "
                             f"{'met' if met else 'missed'} |")
    return "\n".join(lines)


def _mfu(side: dict) -> str:
    """A side's training MFU as the tables print it (GPU runs only)."""
    return f" (training MFU {side['mfu']:.1%})" if side.get("mfu") is not None else ""


def markdown(report: dict) -> str:
    """One table per workload: every peer and mode against shardfit (ratios are shardfit / peer)."""
    lines = [f"Measured on {report['machine']}, {report['date']} (median of interleaved rounds; ratios are "
             "shardfit / peer; tokens/s over the whole process).", ""]
    for e in report["workloads"]:
        if "peers" not in e:
            continue
        s = e["shardfit"]
        lines += [f"**{e['name']}** ({e['runs']} round(s); shardfit {s.get('precision', 'fp32')} "
                  f"{s['tokens_per_s']:.0f} tok/s whole{_mfu(s)}, "
                  f"{s['steps']:.0f} steps, {s['examples_per_step']:.1f} examples/step, peak "
                  f"{s['peak_mem_gib']:.2f} GiB, eval loss {s['eval_loss']:.4f}; load "
                  f"{min(e['load_avg_1m']):.1f}-{max(e['load_avg_1m']):.1f})", "",
                  "| peer | mode | peer steps | peer tok/s | speedup (whole) | speedup (training) | memory ratio | "
                  "peer eval loss | eval loss ratio |", "|---|---|---|---|---|---|---|---|---|"]
        for peer, modes in e["peers"].items():
            for mode, v in modes.items():
                if "failed" in v:
                    lines.append(f"| {peer} | {mode} | - | failed: {v['failed']} (batch {v['batch_per_device']}) "
                                 "| | | | | |")
                    continue
                named = f"{mode} (the {v['same_run_as']} run)" if "same_run_as" in v else mode
                named += f", {v['precision']}" if v.get("precision") else ""
                lines.append(f"| {peer} | {named} | {v['steps']:.0f} | {v['tokens_per_s']:.0f}{_mfu(v)} | "
                             f"{v['speedup']:.2f}x | {v['train_speedup']:.2f}x | {v['memory_ratio']:.2f} | "
                             f"{v['eval_loss']:.4f} | {v['eval_loss_ratio']:.3f} |")
        lines.append("")
    return "\n".join(lines + ["Targets at the same user config:", "", target_table(report)])


if __name__ == "__main__":
    main()
