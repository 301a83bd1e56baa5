"""`shardfit plan`: per-GPU memory of every strategy before anything is loaded (torch only for --simulate)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardfit.cli.args import positive_float, positive_int, token_count
from shardfit.cli.foreign_args import add_from, foreign_plan
from shardfit.cli.plan_args import add_media_flags, add_parallel_flags, add_tool_flags, check_from_flags, with_flags
from shardfit.cli.plan_job import add_job, add_pipelines, split_alternative
from shardfit.cli.plan_media import with_media
from shardfit.config import Config, load_config
from shardfit.config.schema import GRAD_CKPT, METHODS, PRECISIONS
from shardfit.errors import UserError
from shardfit.foreign.asplanned import format_report
from shardfit.objective import NAMES as OBJECTIVES
from shardfit.plan.audio import describe_audio
from shardfit.plan.hardware import Hardware, cards_here, detect, parse_gpus
from shardfit.plan.media import describe
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.optimizer_kinds import OPTIMIZERS
from shardfit.plan.plan import Plan, make_plan
from shardfit.plan.render import format_table, plot
from shardfit.plan.sdpa_classes import SDPA_FIX, sdpa_refusal
from shardfit.plan.shapes import catalog, resolve_shape
from shardfit.plan.workload import ATTENTIONS, Workload, for_target, model_workload, workload_of
from shardfit.strategy import NAMES

# `plan --model` plans what LLaMA-Factory (disable_gradient_checkpointing: false), TRL's SFTConfig
# (gradient_checkpointing=True) and ms-swift run unless told otherwise: gradient checkpointing on.
MODEL_DEFAULT_NOTE = ("gradient checkpointing on (--grad-ckpt full), as LLaMA-Factory, TRL and ms-swift run by "
                      "default; --grad-ckpt none plans without it")


EXAMPLE = ("example: shardfit plan --model Qwen/Qwen2-VL-72B-Instruct --gpus 8x24GB --method lora --seq 2048\n"
           "         shardfit plan --model Qwen/Qwen2-VL-72B-Instruct --gpus 8x24GB --images-per-sample 2 "
           "--image-size 1024x768\n"
           "         shardfit plan --from llamafactory my_lf.yaml --gpus 8x24GB --nproc 8")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of every strategy, before anything is loaded", epilog=EXAMPLE)
    p.add_argument("config", nargs="?")
    p.add_argument("--model", default=None, help="HF id from the catalog, a local folder or a config.json")
    p.add_argument("--list-models", action="store_true", help="list the catalog's model ids and exit")
    p.add_argument("--gpus", default=None, help="8x24GB, 4xA100-80G, 2xH100, 1x4090 (default: this machine)")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--cpu-mem", type=positive_float, default=None, metavar="GIB", help="host RAM per node, for offload")
    p.add_argument("--method", choices=METHODS, default=None)
    p.add_argument("--precision", choices=PRECISIONS, default=None)
    p.add_argument("--seq", type=token_count, default=None, help="tokens per row: 8192, or 8k (k = 1024)")
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--grad-ckpt", choices=GRAD_CKPT, default=None,
                   help="none | full | selective (default: the config's; full with --model, as LLaMA-Factory, TRL and "
                        "ms-swift run)")
    add_parallel_flags(p)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None)
    p.add_argument("--lora-rank", type=positive_int, default=None)
    add_tool_flags(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile over each block: inductor saves fewer activations and fuses float8's casts "
                        "(default: the config's compile: true, else off, as compile: auto is planned)")
    p.add_argument("--float8", action="store_true", default=None,
                   help="FP8 matmuls in the decoder blocks' linear layers (torchao float8 training, sm_89+ GPUs): "
                        "their FLOPs at the card's FP8 rate, plus the casts (default: the config's float8)")
    p.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                   help="LoRA dropout above 0 keeps each adapter's dropped-out input and mask (default: the config's)")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="sdpa: torch SDPA over packed or padded rows, with a [batch, seq, seq] mask (shardfit's and "
                        "transformers' default); flash: flash-attention 2 / flex attention, no dense mask; eager")
    p.add_argument("--grad-accum", type=positive_int, default=None, metavar="N",
                   help="micro-batches per step; above 1 the gradients are held through each forward (default 1)")
    p.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="what the run optimises (default: the config's, sft with --model): dpo, orpo and simpo "
                        "forward both answers of each pair (twice the rows of a micro-batch); dpo and kto add the "
                        "reference's forward without gradients")
    p.add_argument("--precompute-reference", choices=("auto", "true", "false"), default=None,
                   help="dpo and kto: the reference's log-probabilities once before step 1 (true) or in every "
                        "micro-batch with the adapters switched off (false: lora and qlora only); auto: false for "
                        "lora/qlora, true for full/freeze (default: the config's dpo.precompute_reference)")
    add_media_flags(p)
    p.add_argument("--strategy", default=None, help="one strategy, or all (default)")
    p.add_argument("--simulate", action="store_true",
                   help="measure a fake-tensor training step (single, ddp, zero2, zero3) instead of estimating")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--nproc", type=positive_int, default=None, help="with --from: ranks the job launches per node")
    add_from(p, model_flags=False)
    p.set_defaults(func=run)


def local_precision() -> str:
    """What precision `auto` means on this machine's device."""
    from shardfit.parallel.env import cuda_available, resolve_precision  # torch: detect() has loaded it already

    return resolve_precision("auto", "cuda" if cuda_available() else "cpu")


def run_from(args: argparse.Namespace) -> int:
    """`plan --from TOOL FILE`: the job as its tool would run it, shardfit's strategies for the same workload, and
    what would fit. Exit 3 when the job as configured is predicted not to fit."""
    if args.simulate:
        raise UserError("--simulate runs shardfit's own step; drop it with --from (plan the job analytically).")
    if not args.config:
        raise UserError(f"--from {args.from_tool} needs the job's file, e.g. shardfit plan --from {args.from_tool} "
                        f"FILE --gpus 8x24GB.")
    check_from_flags(args)
    fp = foreign_plan(args)
    if args.json:
        print(json.dumps(fp.to_json(), indent=2))
    else:
        print(format_report(fp, format_table(fp.plan)))
    if args.plot:
        write_plot(fp.plan, args.plot, quiet=args.json)
    return 0 if fp.configured.fits else 3


def write_plot(plan: Plan, path: str, *, quiet: bool) -> None:
    """The plan's chart at `path`; a path that cannot be written is bad input (exit 2), not a crash."""
    try:
        plot(plan, path)
    except (OSError, ValueError) as e:  # ValueError: an extension matplotlib cannot write
        raise UserError(f"--plot {path}: cannot write it ({getattr(e, 'strerror', None) or e}); give a .png path "
                        "in an existing folder.") from None
    if not quiet:
        print(f"plot written to {path}")


def run(args: argparse.Namespace) -> int:
    if args.plot and not Path(args.plot).expanduser().resolve().parent.is_dir():
        raise UserError(f"--plot {args.plot}: the folder {Path(args.plot).resolve().parent} does not exist; create "
                        "it or write the plot elsewhere.")
    if args.from_tool:
        return run_from(args)
    if args.list_models:
        print("\n".join(sorted(catalog())))
        return 0
    cfg, shape, w, source, hw = _job_of(args)
    if w.precision == "auto":  # planned GPUs compute in bf16; this machine's device decides for itself
        w = dataclasses.replace(w, precision="bf16" if args.gpus else local_precision())
    if args.strategy not in (None, "all") and args.strategy not in NAMES:
        raise UserError(f"--strategy {args.strategy}: choose one of {', '.join(NAMES)} or all.")
    w, media, audio = with_media(args, cfg, shape, w)
    plan = make_plan(shape, w, hw, NAMES if args.strategy in (None, "all") else (args.strategy,))
    split = split_alternative(shape, w, hw, source) if plan.alternatives is not None else None
    if split is not None:  # nothing fits whole rows: the split auto would choose comes first
        plan.alternatives = [split, *(plan.alternatives or [])]
    if args.model and not args.config and args.grad_ckpt is None:
        plan.notes.append(MODEL_DEFAULT_NOTE)
    if args.bnb_optimizer and w.optimizer == "adamw8bit":
        plan.notes.append("--bnb-optimizer with 8-bit AdamW: planned as the HF Trainer builds it, 8-bit states "
                          "but fp32 ones for a trained input embedding (the Trainer's 32-bit override for "
                          "nn.Embedding) and for tensors under 4,096 elements")
    if w.float8 and (args.pipeline_parallel or (cfg.pipeline_parallel if cfg is not None else 1)) not in (1, "auto"):
        plan.notes.append("float8 with pipeline stages: check and train refuse it (the FP8 layers are not carried "
                          "into the stages); the pipeline's times here assume them")
    if args.simulate:
        from shardfit.simulate.step import simulate_plan  # torch and transformers: only when simulating

        # A fake-tensor step of the same rows: the simulator runs SFT's loss; a preference micro-batch is as many
        # rows, and the reference's forward saves nothing (its time stays the time model's).
        rows = dataclasses.replace(w, objective="sft", micro_batch=w.rows)
        plan = simulate_plan(plan, shape, rows, hw, source if Path(source).exists() else None)
    out = plan.to_json()
    if media is not None:
        out["media"] = media.to_json()
    if audio is not None:
        out["audio"] = audio.to_json()
    lines = [describe(media)] if media else []
    lines += [describe_audio(audio)] if audio else []
    table = format_table(plan)
    pipeline, pipe_lines = add_pipelines(args, cfg, plan, shape, w, hw, source)
    if pipeline is not None:
        out["pipeline"] = pipeline
        lines += pipe_lines
        if pipeline["recommended"]:  # one recommendation: the strategies' best is then only the best strategy
            table = table.replace("\nrecommended: ", "\nbest strategy: ", 1)
    table, lines, chosen = add_job(args, cfg, plan, pipeline, out, table, lines) if args.config \
        else (table, lines, "")
    print(json.dumps(out, indent=2) if args.json else "\n".join([table, *lines]))
    if args.plot:
        write_plot(plan, args.plot, quiet=args.json)
    # Nothing fits as configured but checkpointing or a smaller micro-batch makes it fit with the same trained
    # result: that is the recommendation (printed with the flags it takes), not a failure; so is the job auto
    # resolves with the rows split.
    return 0 if plan.recommended or plan.adjusted or chosen else 3


def _job_of(args: argparse.Namespace) -> tuple[Config | None, ModelShape, Workload, str, Hardware]:
    """The config (None with --model), the model's shape, the workload with the flags applied, the model's source
    and the hardware; the layout's rules checked before anything is planned."""
    cfg = None
    if args.config:
        cfg = load_config(args.config, check_files=False)
        shape, w, source = resolve_shape(cfg.model), workload_of(cfg), cfg.model
        # the rank's load refuses it (models/build.py `_attention`, the same rule)
        if cfg.attn_implementation == "sdpa" and (refusal := sdpa_refusal(
                shape.model_type, "'attn_implementation: sdpa'", SDPA_FIX, text_type=shape.text_model_type)):
            raise UserError(f"{args.config}: {refusal}")
    elif args.model:  # the workload users of other tools run by default (MODEL_DEFAULT); the flags change it
        w = model_workload()
        shape, source = resolve_shape(args.model), args.model
    else:
        raise UserError("plan needs a CONFIG.yaml or --model ID_OR_PATH (e.g. --model meta-llama/Llama-3.1-8B).")
    w = with_flags(w, args)
    if w.sequence_parallel > 1:  # heads that share out, a text model with full attention
        from shardfit.resolve.sequence import check_model, check_objective, facts_of_shape

        check_model(w.sequence_parallel, facts_of_shape(shape), source)
        check_objective(w.sequence_parallel, w.objective)
    if w.expert_parallel > 1:  # experts that share out
        from shardfit.resolve.experts_rules import check_ep_method, check_ep_model, check_ep_objective

        check_ep_model(w.expert_parallel, shape.experts, source, every_expert=shape.every_expert)
        check_ep_method(w.expert_parallel, w.method)
        check_ep_objective(w.expert_parallel, w.objective)
    hw = parse_gpus(args.gpus, args.nodes, args.cpu_mem) if args.gpus else detect(args.nodes)
    # GPUs named are planned as their machine runs the model.
    w = for_target(w, shape.mamba_blocks, lambda: bool(args.gpus) and not cards_here(hw))
    if w.expert_parallel > 1 or w.sequence_parallel > 1:  # the splits fit in the planned GPUs' ranks
        from shardfit.resolve.dims import ParallelDims

        ParallelDims(world=hw.world, sp=w.sequence_parallel, ep=w.expert_parallel).check()
    return cfg, shape, w, source, hw
