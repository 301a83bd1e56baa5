"""`shardfit export`: copy a run's adapter, or merge it into a Hugging Face model folder."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from shardfit.config import load_config
from shardfit.config.load import read_yaml
from shardfit.errors import RemoteCodeRefused, UserError

EXAMPLE = ("example: shardfit export runs/demo --merge --out merged/\n"
           "         shardfit export --base HuggingFaceTB/SmolLM2-135M-Instruct --out models/smollm2")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="copy the adapter, or merge it into a Hugging Face model folder", epilog=EXAMPLE)
    p.add_argument("run_dir", nargs="?", help="the run directory (not with --base)")
    p.add_argument("--base", default=None, metavar="MODEL",
                   help="instead: write MODEL (a .gguf file, or a hub id shardfit bundles as GGUF) as a Hugging Face "
                        "folder to --out, for configs and adapters to name")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of the merged weights")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model folder's own Python code (a run's config.yaml cannot allow it)")
    p.set_defaults(func=run)


def out_folder(out: str | Path) -> Path:
    """The --out folder, refused up front when a file (or a link to one) is in its place: writing into it would
    fail halfway through a merge, after the slow part."""
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"--out {out} is a file; name a folder (new or existing) to write into.")
    if not p.exists() and p.parent.exists() and not p.parent.is_dir():
        raise UserError(f"--out {out}: {p.parent} is a file, not a folder.")
    return p


def run_base(args: argparse.Namespace) -> int:
    """`export --base MODEL --out DIR`: the model itself as a Hugging Face folder (de-quantized from GGUF)."""
    if not args.out:
        raise UserError("--base needs --out DIR, the folder to write the model to.")
    out_dir = out_folder(args.out)

    from shardfit.dtypes import DTYPES  # torch: only when exporting
    from shardfit.train.export import export_base

    dtype = DTYPES[args.dtype]
    try:
        out = export_base(args.base, out_dir, dtype, args.trust_remote_code)
    except RemoteCodeRefused as e:
        raise e.for_command_line() from None
    print(f"{args.base} written to {out}; name it in a config (model: {out}) and adapters trained on it will name "
          "a base that AutoModelForCausalLM.from_pretrained loads")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.base:
        return run_base(args)
    if not args.run_dir:
        raise UserError("export needs a RUN_DIR (e.g. shardfit export runs/demo --merge), or --base MODEL --out DIR.")
    run_dir = Path(args.run_dir)
    adapter = run_dir / "adapter"
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{run_dir} is not a shardfit run directory (no config.yaml).")
    raw, _ = read_yaml(cfg_file)  # bad YAML, deep nesting or binary text: a message naming the file
    if not isinstance(raw, dict) or not raw.get("model"):
        raise UserError(f"{cfg_file} does not name the run's model; it is not the config.yaml a shardfit run writes. "
                        "Export from the run directory that training wrote.")
    run_cfg = load_config(cfg_file, check_files=False)
    asked = run_cfg.trust_remote_code
    # A run directory is files anyone can hand you: only the command line lets the model folder's Python run.
    run_cfg = dataclasses.replace(run_cfg, trust_remote_code=args.trust_remote_code)
    if not args.merge:
        if not adapter.is_dir():
            raise UserError(f"{run_dir} has no adapter/ (a full fine-tune already wrote model/).")
        out = out_folder(args.out or run_dir / "adapter-export")
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        print(f"adapter copied to {out}")
        return 0
    if not adapter.is_dir():
        if (run_dir / "model").is_dir():
            print(f"{run_dir / 'model'} is already a full model; nothing to merge.")
            return 0
        raise UserError(f"{run_dir} has no adapter/ to merge.")

    from shardfit.dtypes import DTYPES  # torch: only when exporting
    from shardfit.train.export import merge_adapter

    dtype = DTYPES[args.dtype]
    try:
        out = merge_adapter(run_cfg, adapter, out_folder(args.out or run_dir / "model"), dtype, show=True)
    except RemoteCodeRefused as e:
        raise e.for_command_line(cfg_file if asked else None) from None
    loader = "AutoModelForImageTextToText and AutoImageProcessor" if (out / "preprocessor_config.json").is_file() \
        else "AutoModelForCausalLM"
    print(f"merged model written to {out} (load with {loader}.from_pretrained)")
    return 0
