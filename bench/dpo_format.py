"""Does preference training change behaviour? The functional DPO check docs/preference.md reports.

    python bench/dpo_format.py                   # SmolLM2-135M-Instruct, LoRA DPO, 20 steps (~15 min, 2-core CPU)
    python bench/dpo_format.py --objective orpo  # the same with ORPO (its SFT term on the chosen answers)

The task comes from the demo's rows: each note's contact record written two ways, the record format
(`name=...; city=...; ext=...`) chosen and the same facts in prose (`Anya Khan (Denver), extension 2485`)
rejected. The script trains DPO on the demo's training rows with `shardfit train`, then, with `shardfit eval` on the
demo's held-out notes (never trained on), measures before (the base: the adapter switched off) and after:

- reward accuracy: the share of held-out pairs whose chosen answer gains more log-probability over the base than
  the rejected one (a tie, as every pair is before training, counts half);
- prefers chosen: the share of held-out pairs to which the model itself gives the chosen answer the higher
  log-probability;
- the format of greedy answers: the share of held-out prompts answered in the record format, and in prose.

Results: bench/results/{dpo,orpo}_format.json; docs/preference.md's table is generated from it (tests/test_preference.py
holds it).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "src" / "shardfit" / "demo"
RESULTS = ROOT / "bench" / "results"
SCORERS = ROOT / "bench" / "dpo_format_scorers.py"


def prose(output: str) -> str:
    """The demo's record `name=A; city=B; ext=C` as the rejected answer: the same facts in prose."""
    name, city, ext = (part.split("=", 1)[1] for part in output.split("; "))
    return f"{name} ({city}), extension {ext}"


def demo_pairs(src: Path, out: Path, limit: int | None = None) -> Path:
    """TRL-style pairs from the demo's alpaca rows: the record chosen, the prose rejected."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()][:limit]
    pairs = [{"prompt": [{"role": "user", "content": f"{r['instruction']}\n\n{r['input']}"}],
              "chosen": [{"role": "assistant", "content": r["output"]}],
              "rejected": [{"role": "assistant", "content": prose(r["output"])}]} for r in rows]
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out


BLOCK = ("<!-- dpo-format: generated from bench/results/*_format.json by bench/dpo_format.py "
         "(tests/test_preference.py holds it) -->", "<!-- end: dpo-format -->")


def result_path(objective: str) -> Path:
    return RESULTS / f"{objective}_format.json"


def results() -> list[dict]:
    """The last result of each objective run, DPO first."""
    return [json.loads(p.read_text()) for o in ("dpo", "orpo", "simpo") if (p := result_path(o)).is_file()]


def doc_table(runs: list[dict]) -> str:
    """The before/after table of `runs` (what the bench puts between the BLOCK markers)."""
    rows = [("reward accuracy (chosen gains more than rejected; ties half)", "reward_accuracy"),
            ("prefers the chosen answer (higher log-probability)", "prefers_chosen"),
            ("greedy answers in the chosen record format", "record_format"),
            ("greedy answers in the rejected prose format", "prose_format")]
    head = " | ".join(f"after {r['steps']} {r['config']['objective'].upper()} steps" for r in runs)
    lines = [f"| {runs[0]['heldout_pairs']} held-out notes | before | {head} |", "|---|---|" + "---|" * len(runs)]
    lines += [f"| {label} | {runs[0]['before'][key]:.0%} | " + " | ".join(f"{r['after'][key]:.0%}" for r in runs)
              + " |" for label, key in rows]
    seen = ", ".join(f"{r['config']['objective'].upper()} lr {r['config']['lr']:g}, {r['train_pairs']} pairs"
                     for r in runs)
    return "\n".join(lines) + f"\n\n{runs[0]['machine']}, LoRA r16, beta 0.1; {seen}.\n"


def write_doc(runs: list[dict], doc: Path = ROOT / "docs" / "preference.md") -> None:
    text = doc.read_text()
    head, rest = text.split(BLOCK[0], 1)
    _, tail = rest.split(BLOCK[1], 1)
    doc.write_text(f"{head}{BLOCK[0]}\n{doc_table(runs)}{BLOCK[1]}{tail}")


def shardfit(*args: str, show: bool = False) -> subprocess.CompletedProcess:
    """`shardfit ARGS` in a subprocess; `show`: its progress goes to this terminal (training)."""
    r = subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=not show, text=True)
    if r.returncode != 0:
        sys.exit(f"shardfit {' '.join(args)} failed ({r.returncode}):\n{(r.stderr or '')[-3000:]}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", default="dpo", choices=("dpo", "orpo", "simpo"))
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=48, help="held-out notes (the demo has 48)")
    ap.add_argument("--write-doc", action="store_true", help="only rewrite docs/preference.md's table from the results")
    args = ap.parse_args()
    if args.write_doc:
        write_doc(results())
        return
    work = Path(tempfile.mkdtemp(prefix="dpo-format-"))
    train = demo_pairs(DEMO / "train.jsonl", work / "train_pairs.jsonl")
    held = demo_pairs(DEMO / "heldout.jsonl", work / "heldout_pairs.jsonl", args.prompts)
    config = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "data": str(train), "objective": args.objective,
              "dpo": {"beta": 0.1, "loss": "sigmoid"}, "method": "lora",
              "lora": {"rank": 16, "alpha": 32, "targets": "all-linear"}, "precision": "auto", "max_seq_len": 256,
              "micro_batch": 4, "lr": args.lr, "warmup_ratio": 0.05, "max_steps": args.steps, "log_steps": 5,
              "save_steps": 1000, "eval_steps": 1000, "output_dir": str(work / "run"), "resume": "never",
              "report_to": ["none"]}
    cfg = work / "dpo.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    t0 = time.perf_counter()
    shardfit("train", str(cfg), show=True)
    train_s = time.perf_counter() - t0
    pairs = json.loads(shardfit("eval", str(work / "run"), "--data", str(held), "--json").stdout)
    metrics = [f"py:{SCORERS}:record_format", f"py:{SCORERS}:prose_format"]
    gen = json.loads(shardfit("eval", str(work / "run"), "--data", str(DEMO / "heldout.jsonl"), "--limit",
                              str(args.prompts), "--max-new-tokens", "32",
                              *[x for m in metrics for x in ("--metric", m)], "--json").stdout)
    summary = json.loads((work / "run" / "summary.json").read_text())
    result = {"model": config["model"], "machine": f"{platform.processor() or platform.machine()} CPU",
              "steps": args.steps, "train_pairs": summary["examples_per_step"] * args.steps,
              "heldout_pairs": pairs["pairs"], "train_s": round(train_s, 1),
              "final_train_loss": summary["train_loss"], "config": config,
              "before": {"reward_accuracy": 0.5, "prefers_chosen": pairs["models"]["base"]["prefers_chosen"],
                         **{k: gen["models"]["base"]["metrics"][k] for k in ("record_format", "prose_format")}},
              "after": {"reward_accuracy": pairs["models"]["tuned"]["reward_accuracy"],
                        "prefers_chosen": pairs["models"]["tuned"]["prefers_chosen"],
                        **{k: gen["models"]["tuned"]["metrics"][k] for k in ("record_format", "prose_format")}},
              "samples": gen["samples"][:4]}
    result_path(args.objective).write_text(json.dumps(result, indent=2) + "\n")
    write_doc(results())
    print(json.dumps({k: result[k] for k in ("before", "after", "train_s")}, indent=2))


if __name__ == "__main__":
    main()
