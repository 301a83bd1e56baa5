"""`shardfit eval`: held-out loss and perplexity on assistant tokens, and generation metrics, for the tuned model
and its base side by side."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import Any

from shardfit.cli.args import token_count
from shardfit.cli.chat_cmd import add_sampling_args
from shardfit.data.reader import read_rows
from shardfit.errors import UserError
from shardfit.evals.generation import sample_json, score_answers, scored_requests
from shardfit.evals.scorers import parse_metrics
from shardfit.evals.table import format_eval
from shardfit.infer.prompts import read_requests

EXAMPLE = """examples:
  shardfit eval runs/demo --data heldout.jsonl
  shardfit eval runs/demo --data heldout.jsonl --metric contains --metric "regex:(\\d+)" --json
  shardfit eval runs/demo --data heldout.jsonl --metric py:my_scorer.py:score --no-base"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out loss, perplexity and generation metrics, base vs tuned",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="RUN_DIR|MODEL", help="a run directory, or a model (with --adapter)")
    p.add_argument("--data", required=True, help="held-out rows (alpaca, ShareGPT, OpenAI messages, or "
                                                 "{\"prompt\", \"expected\"}); the last answer is what is expected. "
                                                 "Preference pairs (prompt, chosen, rejected): how often each model "
                                                 "prefers the chosen answer, and the reward accuracy")
    p.add_argument("--metric", dest="metrics", action="append", default=None,
                   help="exact | contains | regex:PATTERN | py:FILE.py:FUNC (repeatable; default: exact)")
    p.add_argument("--no-base", action="store_true", help="evaluate the tuned model only")
    p.add_argument("--no-generate", action="store_true", help="the loss only (no generation metrics)")
    p.add_argument("--limit", type=int, default=None, help="the first N rows only")
    p.add_argument("--max-seq-len", type=token_count, default=None,
                   help="tokens per example for the loss: 2048, or 2k (k = 1024; default: the run's max_seq_len, "
                        "else 2048)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", default=None, help="also write the JSON here (default for a run: RUN_DIR/eval.json)")
    add_sampling_args(p, 64)
    p.set_defaults(func=run)


def _evaluate_model(loaded: Any, requests: list, scorers: list, args: argparse.Namespace, max_seq_len: int,
                    label: str, generate: bool, name: str) -> tuple[dict[str, Any], Any]:
    from shardfit.infer.generate import Sampling, generate_batch  # torch and transformers: only to evaluate
    from shardfit.train.evaluate import heldout_loss

    answered = scored_requests(requests)
    convs = [r.messages + [{"role": "assistant", "content": r.expected}] for r in answered]
    loss = heldout_loss(loaded.model, loaded.tokenizer, convs, max_seq_len=max_seq_len, micro_batch=args.batch_size,
                        device=loaded.device)
    scored = None
    if generate:
        answers = generate_batch(loaded.model, loaded.tokenizer, [r.messages for r in requests],
                                 Sampling(args.max_new_tokens), batch_size=args.batch_size, show=True,
                                 desc=f"eval {name}")
        scored = score_answers(requests, answers, scorers)
    col = {"label": label, "loss": None if loss.loss is None else round(loss.loss, 6),
           "perplexity": None if loss.perplexity is None else round(loss.perplexity, 4),
           "metrics": scored.means if scored else {}}
    return col, (scored, loss.tokens)


def _has_images(row: Any) -> bool:
    """A row with an `images` list or image content parts (data/media.py's layouts)."""
    if not isinstance(row, dict):
        return False
    parts = [p for t in row.get("messages") or [] if isinstance(t, dict) and isinstance(t.get("content"), list)
             for p in t["content"]]
    return bool(row.get("images")) or any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                                          for p in parts)


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}.")
    if not Path(args.data).is_file():
        raise UserError(f"--data {args.data}: no such file.")
    # torch, transformers and peft: only once a model is actually used
    from shardfit.cli.eval_preference import run_pairs
    from shardfit.data.formats import detect_preference
    from shardfit.infer.load import load_for_inference, pick_device, resolve_target

    scorers = parse_metrics(args.metrics or ["exact"])
    target = resolve_target(args.target, args.adapter)
    with_images = next((r.where for r in read_rows(args.data) if _has_images(r.data)), None)
    if with_images:
        raise UserError(f"{with_images}: eval reads text rows only; image rows are evaluated by training's held-out "
                        "loss (eval_data) or answered one by one with `shardfit chat RUN --image PATH --prompt "
                        "TEXT`. Remove the image rows from --data.")
    first = next(iter(read_rows(args.data)), None)
    if first is not None and detect_preference(first.data):
        if detect_preference(first.data) != "pairs":
            raise UserError(f"{first.where}: eval reads preference pairs (prompt, chosen, rejected); KTO's unpaired "
                            "rows have no pair to compare.")
        return run_pairs(args, target, pick_device(args.device))
    requests = read_requests(args.data, limit=args.limit)
    n_scored = sum(r.expected is not None for r in requests)
    if n_scored == 0:
        raise UserError(f"--data {args.data}: no row has an expected answer (an alpaca output, a last assistant "
                        "turn, or \"expected\"); nothing to evaluate.")
    generate = not args.no_generate
    max_seq_len = args.max_seq_len or (target.run_cfg.max_seq_len if target.run_cfg else 2048)
    device = pick_device(args.device)
    loaded = load_for_inference(target, device=device, precision=args.precision,
                                trust_remote_code=args.trust_remote_code)
    models: dict[str, Any] = {}
    columns: dict[str, Any] = {}
    tuned_name = "tuned" if (target.adapter or target.run_cfg) else "model"
    models[tuned_name], (columns[tuned_name], tokens) = _evaluate_model(
        loaded, requests, scorers, args, max_seq_len, target.label, generate, tuned_name)
    if not args.no_base and tuned_name == "tuned":
        base_label = f"{target.base_model}, before fine-tuning"
        if loaded.has_adapter:
            with loaded.model.disable_adapter():  # the same weights with the adapter left off: no second load
                models["base"], (columns["base"], _) = _evaluate_model(
                    loaded, requests, scorers, args, max_seq_len, base_label, generate, "base")
        else:
            del loaded
            gc.collect()
            base = load_for_inference(target, device=device, precision=args.precision, base=True,
                                      trust_remote_code=args.trust_remote_code)
            models["base"], (columns["base"], _) = _evaluate_model(
                base, requests, scorers, args, max_seq_len, base_label, generate, "base")
        models = {"base": models["base"], tuned_name: models[tuned_name]}
    result = {"target": args.target, "data": args.data, "examples": len(requests), "scored": n_scored,
              "tokens": tokens, "metrics": [s.name for s in scorers] if generate else [],
              "max_new_tokens": args.max_new_tokens, "models": models,
              "samples": sample_json(requests, columns) if generate else []}
    out = Path(args.out) if args.out else (Path(args.target) / "eval.json" if target.run_cfg else None)
    if args.out:
        try:
            out.write_text(json.dumps(result, indent=2))
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write it ({e}).") from None
    elif out is not None:
        with contextlib.suppress(OSError):  # a read-only run directory still gets its table printed
            out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_eval(result))
        if out is not None:
            print(f"written to {out}", file=sys.stderr)
    return 0
