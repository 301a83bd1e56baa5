"""`shardfit export`: copy a run's adapter, or merge it into a Hugging Face model folder."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from shardfit.config import load_config
from shardfit.errors import UserError

EXAMPLE = "example: shardfit export runs/demo --merge --out merged/"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="copy the adapter, or merge it into a Hugging Face model folder", epilog=EXAMPLE)
    p.add_argument("run_dir")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of the merged weights")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    adapter = run_dir / "adapter"
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{run_dir} is not a shardfit run directory (no config.yaml).")
    run_cfg = load_config(cfg_file, check_files=False)
    if not args.merge:
        if not adapter.is_dir():
            raise UserError(f"{run_dir} has no adapter/ (a full fine-tune already wrote model/).")
        out = Path(args.out or run_dir / "adapter-export")
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        print(f"adapter copied to {out}")
        return 0
    if not adapter.is_dir():
        if (run_dir / "model").is_dir():
            print(f"{run_dir / 'model'} is already a full model; nothing to merge.")
            return 0
        raise UserError(f"{run_dir} has no adapter/ to merge.")
    import torch  # torch, transformers and peft: only for a merge

    from shardfit.train.export import merge_adapter

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out = merge_adapter(run_cfg, adapter, Path(args.out or run_dir / "model"), dtype, show=True)
    print(f"merged model written to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0
