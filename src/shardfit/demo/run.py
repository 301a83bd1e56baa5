"""`shardfit train` with no config: fine-tune the bundled SmolLM2 on the demo task and show before/after."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from shardfit.config import Config, load_config
from shardfit.demo.evaluate import accuracy, generate_answers, report
from shardfit.models.build import build_model, load_tokenizer, weights_cached
from shardfit.models.gguf_reads import GGUFReads
from shardfit.models.source import resolve_model
from shardfit.parallel.env import DistEnv
from shardfit.parallel.job import job_of_rank
from shardfit.parallel.watchdog import Watchdog
from shardfit.resolve.decide import settled
from shardfit.train.recipe import train

DEMO_DIR = Path(__file__).resolve().parent


def demo_config_path() -> Path:
    return DEMO_DIR / "demo.yaml"


def load_base(cfg: Config, experts: str | None) -> tuple[Any, nn.Module, bool | None]:
    """The tokenizer and the model as training builds them (on the CPU), and whether the model cache held the
    weights. The bundled model is a GGUF file: its config, tokenizer and weights are each read by their own
    transformers loader, which parsed the whole file every time (three parses on a first run); here it is parsed
    once for all three (models/gguf_reads.py)."""
    cached = weights_cached(cfg)
    reads = GGUFReads()
    with reads.shared():
        tok = load_tokenizer(resolve_model(cfg.model))
        model = build_model(cfg, "single", weights=True, experts=experts)
    return tok, model, cached


def run_demo(env: DistEnv, overrides: Sequence[str] = (), watchdog: Watchdog | None = None) -> dict:
    """Evaluate the base model, fine-tune it, evaluate again; print the table and return the numbers."""
    t0 = time.perf_counter()
    # The bundled files by absolute path: a relative one is tried against the working directory first, where a
    # user's own train.jsonl would silently replace the demo's data.
    bundled = [f"data={DEMO_DIR / 'train.jsonl'}", f"eval_data={DEMO_DIR / 'heldout.jsonl'}"]
    cfg = load_config(demo_config_path(), [*bundled, *overrides])
    job, _ = job_of_rank(cfg, env)
    cfg = settled(cfg, job)  # the model built here is the one training uses
    heldout = [json.loads(line) for line in Path(cfg.eval_data).read_text().splitlines() if line.strip()]
    if env.is_main:
        print(f"shardfit demo: LoRA fine-tune of {cfg.model} on a record-extraction task "
              f"({sum(1 for _ in open(cfg.data))} train / {len(heldout)} held-out examples)")
    t_load = time.perf_counter()
    # The model as training builds it: its fresh LoRA adapters add nothing yet, so this is the base model's answer.
    tok, model, cached = load_base(cfg, job.experts)
    model = model.to(env.device)
    load_s = round(time.perf_counter() - t_load, 2)
    before = generate_answers(model, tok, heldout, show=True, desc="base model answers") if env.is_main else []
    if env.is_main:
        print(f"base model: {accuracy(before):.1%} exact match before training")
    result = train(cfg, env, model=model, tokenizer=tok, job=job, watchdog=watchdog)
    if not env.is_main:
        return {}
    tuned = result.model.to(env.device)
    after = generate_answers(tuned, tok, heldout, show=True, desc="tuned model answers")
    print(report(before, after))
    out = {"before_accuracy": accuracy(before), "after_accuracy": accuracy(after),
           "eval_loss": result.summary["eval_loss"], "train_wall_s": result.summary["wall_s"],
           "total_wall_s": round(time.perf_counter() - t0, 1), "run_dir": str(result.run_dir),
           "model_load_s": load_s, "model_cache_hit": cached}
    (result.run_dir / "demo.json").write_text(json.dumps(out, indent=2))
    run = result.run_dir
    print(f"adapter: {run / 'adapter'}   merge: shardfit export {run} --merge")
    print(f"next:    shardfit chat {run}    |    shardfit eval {run} --data {cfg.eval_data}    |    "
          f"shardfit report {run}")
    print(f"demo finished in {out['total_wall_s']:.0f} s")
    return out
