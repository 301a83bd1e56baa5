"""Subcommands other than train: export (plan, check and diagnose register here as they land)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from shardfit.config.schema import GRAD_CKPT, METHODS, PRECISIONS
from shardfit.errors import UserError
from shardfit.plan.estimate import ATTENTIONS, FULL_LOSSES


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


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from shardfit.plan.build import format_table, make_plan, plot
    from shardfit.plan.estimate import STRATEGIES, Workload
    from shardfit.plan.hardware import detect, parse_gpus
    from shardfit.plan.shapes import resolve_shape

    if args.config:
        from shardfit.config import load_config
        from shardfit.plan.choose import shape_of_config, workload_of

        cfg = load_config(args.config, check_files=False)
        shape, sim_source = shape_of_config(cfg)
        w = workload_of(cfg)
    elif args.model:
        shape = resolve_shape(args.model)
        w = Workload()
        sim_source = args.model if Path(args.model).exists() else None
    else:
        raise UserError("plan needs a CONFIG.yaml or --model ID_OR_PATH (e.g. --model meta-llama/Llama-3.1-8B).")
    overrides = {"method": args.method, "precision": args.precision, "seq_len": args.seq, "micro_batch": args.batch,
                 "grad_ckpt": args.grad_ckpt, "optimizer": args.optimizer, "lora_rank": args.lora_rank,
                 "loss": args.loss, "grad_accum": args.grad_accum, "frozen_fp32": args.frozen_fp32,
                 "attention": args.attention, "adapters_16bit": args.adapters_16bit}
    w = dataclasses.replace(w, **{k: v for k, v in overrides.items() if v is not None})
    hw = parse_gpus(args.gpus, args.nodes, args.cpu_mem) if args.gpus else detect(args.nodes)
    strategies = STRATEGIES if args.strategy in (None, "all") else (args.strategy,)
    if args.strategy not in (None, "all") and args.strategy not in STRATEGIES:
        raise UserError(f"--strategy {args.strategy}: choose one of {', '.join(STRATEGIES)} or all.")
    plan = make_plan(shape, w, hw, strategies)
    if args.simulate:
        from shardfit.plan.simulate import simulate_plan

        plan = simulate_plan(plan, shape, w, hw, sim_source)
    print(json.dumps(plan, indent=2) if args.json else format_table(plan))
    if args.plot:
        plot(plan, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if plan["recommended"] else 3


def cmd_diagnose(args: argparse.Namespace) -> int:
    import json

    from shardfit.diagnose.engine import analyze
    from shardfit.diagnose.report import format_text, read_input, to_json

    analysis = analyze(read_input(args.file))
    out = json.dumps(to_json(analysis), indent=2, ensure_ascii=False) + "\n" if args.json else format_text(analysis)
    print(out, end="")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import json

    from shardfit.check.findings import is_ok
    from shardfit.check.run import check_config, format_findings
    from shardfit.config import load_config
    from shardfit.plan.hardware import parse_gpus

    cfg = load_config(args.config, args.overrides)
    hw = parse_gpus(args.gpus, args.nodes) if args.gpus else None
    strategy, findings = check_config(cfg, args.nproc, hw)
    ok = is_ok(findings)
    if args.json:
        print(json.dumps({"ok": ok, "findings": [f.to_json() for f in findings]}, indent=2))
    else:
        print(format_findings(strategy, findings))
    return 0 if ok else 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("check", help="preflight: find placement, sharding and precision problems before training")
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--nproc", type=int, default=None, help="ranks the run will use (default: from the strategy)")
    c.add_argument("--gpus", default=None, help="check for these GPUs, e.g. 8x24GB (default: this machine)")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("diagnose", help="paste an error log from any framework: root cause and fix")
    d.add_argument("file", nargs="?", default=None, help="log file, or - (default) for stdin")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("plan", help="per-GPU memory of every strategy, before anything is loaded")
    p.add_argument("config", nargs="?")
    p.add_argument("--model", default=None, help="HF id from the catalog, a local folder or a config.json")
    p.add_argument("--gpus", default=None, help="8x24GB, 4xA100-80G, 2xH100, 1x4090 (default: this machine)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--cpu-mem", type=float, default=None, metavar="GIB", help="host RAM per node, for offload")
    p.add_argument("--method", choices=METHODS, default=None)
    p.add_argument("--precision", choices=PRECISIONS, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--grad-ckpt", choices=GRAD_CKPT, default=None)
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default=None)
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--loss", choices=("chunked", *FULL_LOSSES), default=None,
                   help="chunked: shardfit's loss (default); full: logits of every position at once, as transformers' "
                        "own loss computes them (to predict an HF Trainer / LLaMA-Factory / axolotl / TRL run); "
                        "full_shift: the same with transformers 4.46-4.48, whose loss copied the shifted fp32 "
                        "logits; full_shift16: a GPT-2-style loss that copies the shifted 16-bit logits (older "
                        "remote code, e.g. Qwen v1)")
    p.add_argument("--frozen-fp32", action="store_true", default=None,
                   help="frozen embeddings, norms and head in fp32, as peft's prepare_model_for_kbit_training leaves "
                        "them (to predict a TRL / axolotl QLoRA run)")
    p.add_argument("--adapters-16bit", action="store_true", default=None,
                   help="LoRA adapters, their gradients and AdamW states in the 16-bit compute dtype, not fp32 (peft "
                        "before 0.12, LLaMA-Factory's pure_bf16)")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="sdpa: torch SDPA over packed or padded rows, with a [batch, seq, seq] mask (shardfit's and "
                        "transformers' default); flash: flash-attention 2 / flex attention, no dense mask; eager")
    p.add_argument("--grad-accum", type=int, default=None, metavar="N",
                   help="micro-batches per step; above 1 the gradients are held through each forward (default 1)")
    p.add_argument("--strategy", default=None, help="one strategy, or all (default)")
    p.add_argument("--simulate", action="store_true",
                   help="measure a fake-tensor training step (single, ddp, zero2, zero3) instead of estimating")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("export", help="copy the adapter, or merge it into a Hugging Face model folder")
    p.add_argument("run_dir")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of the merged weights")
    p.set_defaults(func=cmd_export)
