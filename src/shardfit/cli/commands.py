"""Subcommands other than train: export (plan, check and diagnose register here as they land)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from shardfit.errors import UserError


def cmd_export(args: argparse.Namespace) -> int:
    import torch
    import yaml

    run = Path(args.run_dir)
    adapter = run / "adapter"
    cfg_file = run / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{run} is not a shardfit run directory (no config.yaml).")
    base = yaml.safe_load(cfg_file.read_text())["model"]
    if not args.merge:
        if not adapter.is_dir():
            raise UserError(f"{run} has no adapter/ (a full fine-tune already wrote model/).")
        out = Path(args.out or run / "adapter-export")
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        print(f"adapter copied to {out}")
        return 0
    if not adapter.is_dir():
        if (run / "model").is_dir():
            print(f"{run / 'model'} is already a full model; nothing to merge.")
            return 0
        raise UserError(f"{run} has no adapter/ to merge.")
    from shardfit.train.export import merge_adapter

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out = merge_adapter(base, adapter, Path(args.out or run / "model"), dtype)
    print(f"merged model written to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="copy the adapter, or merge it into a Hugging Face model folder")
    p.add_argument("run_dir")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of the merged weights")
    p.set_defaults(func=cmd_export)
