"""`shardfit eval` on preference rows (chosen/rejected pairs): how often each model gives the chosen answer the
higher log-probability, and the tuned model's DPO reward accuracy and margin against its base (the reference)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardfit.data.dataset import DataStats
from shardfit.data.preference import PrefSplit, encode_pairs, load_preferences
from shardfit.data.tokenize import ensure_chat_template
from shardfit.errors import UserError


def pair_figures(tuned: Any, base: Any | None, beta: float) -> dict[str, Any]:
    """The table's figures from (pairs, 2) log-probabilities: chosen preferred (a tie counts half) per model, and
    with a base the implicit rewards beta x (tuned - base) of each answer, their accuracy and mean margin."""
    def prefers(lp: Any) -> float:
        return float(((lp[:, 0] > lp[:, 1]).double() + 0.5 * (lp[:, 0] == lp[:, 1]).double()).mean())

    out: dict[str, Any] = {"base": {"prefers_chosen": round(prefers(base), 4)}} if base is not None else {}
    out["tuned"] = {"prefers_chosen": round(prefers(tuned), 4)}
    if base is not None:
        rewards = beta * (tuned - base)
        margin = rewards[:, 0] - rewards[:, 1]
        out["tuned"]["reward_accuracy"] = round(float(((margin > 0).double() + 0.5 * (margin == 0).double()).mean()),
                                                4)
        out["tuned"]["reward_margin"] = round(float(margin.mean()), 6)
    return out


def run_pairs(args: argparse.Namespace, target: Any, device: Any) -> int:
    """Evaluate `target` (and its base) on the preference rows of --data."""
    from shardfit.infer.load import load_for_inference  # torch and transformers: only to evaluate
    from shardfit.train.evaluate import pair_logps

    cfg = target.run_cfg
    objective = cfg.objective if cfg is not None and cfg.objective in ("dpo", "orpo", "simpo") else "dpo"
    split = PrefSplit([], [], DataStats())
    convs = load_preferences(args.data, objective, False, split.stats, None, split.rows)[:args.limit]
    max_len = args.max_seq_len or (cfg.max_seq_len if cfg is not None else 2048)
    loaded = load_for_inference(target, device=device, precision=args.precision,
                                trust_remote_code=args.trust_remote_code)
    ensure_chat_template(loaded.tokenizer)
    pairs = encode_pairs(loaded.tokenizer, split, convs, max_len, False, None)
    if not pairs:
        raise UserError(f"--data {args.data}: no pair keeps an answer token within {max_len} tokens; raise "
                        "--max-seq-len.")
    pad = loaded.tokenizer.pad_token_id

    def score(model: Any) -> Any:
        return pair_logps(model, pad, pairs, micro_batch=args.batch_size, device=loaded.device)

    tuned = score(loaded.model)
    base = None
    if not args.no_base and loaded.has_adapter:
        with loaded.model.disable_adapter():  # the reference: the same weights with the adapter left off
            base = score(loaded.model)
    elif not args.no_base and target.run_cfg is not None:
        del loaded
        base_model = load_for_inference(target, device=device, precision=args.precision, base=True,
                                        trust_remote_code=args.trust_remote_code)
        base = pair_logps(base_model.model, pad, pairs, micro_batch=args.batch_size, device=base_model.device)
    beta = cfg.dpo.beta if cfg is not None else 0.1
    result = {"target": args.target, "data": args.data, "pairs": len(pairs), "dropped": split.stats.dropped,
              "beta": beta, "models": pair_figures(tuned, base, beta)}
    out = Path(args.out) if args.out else None
    if out is not None:
        try:
            out.write_text(json.dumps(result, indent=2))
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write it ({e}).") from None
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{len(pairs)} preference pairs from {args.data} (beta {beta})")
    for name, figures in result["models"].items():
        extra = "" if "reward_accuracy" not in figures else \
            f"; reward accuracy {figures['reward_accuracy']:.1%}, mean reward margin {figures['reward_margin']:+.4f}"
        print(f"  {name:<6} prefers the chosen answer in {figures['prefers_chosen']:.1%} of pairs{extra}")
    return 0
