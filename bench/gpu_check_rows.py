"""The rows the GPU check's speed runs trained on, as shardfit tokenises them: how wide each micro-batch really was.

    python bench/gpu.py export /tmp/assets                       # the tokenizer the check's models carry
    python bench/gpu_check_rows.py /tmp/assets --out bench/results/gpu_check_h200_rows.json

The speed runs (bench/gpu_check.py `speed`) plan for rows full to max_seq_len (2048), but their examples are demo
notes put together to about 95 % of it: each row holds one example (two never fit in 2048 tokens, so no row restarts
its positions and SDPA runs its causal kernel without a mask), and a micro-batch is as wide as its longest row. This
rebuilds the same data (seed 0) with the same tokenizer and config and records each example's tokens, so the plan
can be compared with the measured peak at the width the runs had (tests/test_plan_gpu_bf16.py). CPU only, seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import GPU, base_config, long_rows, write_jsonl  # noqa: E402


def row_lengths(assets: Path, rows: int, work: Path) -> list[int]:
    """Tokens of each training example of the speed runs' data of `rows` rows (`speed_micro_batch` x steps)."""
    from transformers import AutoTokenizer

    from shardfit.config import Config
    from shardfit.data.dataset import build_datasets

    tok = AutoTokenizer.from_pretrained(assets)
    data = write_jsonl(work / f"long{rows}.jsonl", long_rows(rows, GPU.speed_seq, tok))
    raw = base_config(assets, data, work / "run", GPU.speed_seq, GPU.speed_micro_batch, rows // GPU.speed_micro_batch)
    cfg = Config(**{k: v for k, v in raw.items() if k in Config.__dataclass_fields__})
    train, _, _ = build_datasets(cfg, tok)
    return [e.n_tokens for e in train]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("assets", type=Path, help="the folder `bench/gpu.py export` wrote (tokenizer)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfit-gpu-check-rows"))
    args = p.parse_args(argv)
    record: dict = {"note": "Tokens per example of the GPU check's speed runs (bench/gpu_check_rows.py): 12 steps x "
                            "micro_batch 4 (gpu_check_h200.json) and 30 steps (gpu_check_h200_more.json); one "
                            "example per row, a micro-batch as wide as its longest row.",
                    "max_seq_len": GPU.speed_seq, "micro_batch": GPU.speed_micro_batch, "runs": {}}
    for steps in (GPU.speed_steps, 30):
        lengths = row_lengths(args.assets, steps * GPU.speed_micro_batch, args.work_dir)
        record["runs"][f"{steps}_steps"] = {"examples": len(lengths), "widest": max(lengths),
                                            "mean": round(sum(lengths) / len(lengths), 1), "tokens": sum(lengths)}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["runs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
