"""`shardfit plan`: per-GPU memory of every strategy before anything is loaded (torch only for --simulate)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfit.cli.args import positive_float, positive_int
from shardfit.cli.foreign_args import add_from, foreign_plan
from shardfit.config import Config, load_config
from shardfit.config.schema import GRAD_CKPT, METHODS, PRECISIONS
from shardfit.errors import DoesNotFitError, UserError
from shardfit.foreign.asplanned import format_report
from shardfit.foreign.job import TOOL_NAMES
from shardfit.foreign.read import SCRIPT_SETTABLE
from shardfit.objective import NAMES as OBJECTIVES
from shardfit.objective import get as get_objective
from shardfit.plan.audio import AudioLoad, check_audio_fits, describe_audio
from shardfit.plan.estimate import Candidate
from shardfit.plan.hardware import Hardware, cards_here, detect, parse_gpus
from shardfit.plan.media import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    MediaLoad,
    check_fits,
    describe,
    parse_image_size,
)
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.optimizer_kinds import OPTIMIZERS
from shardfit.plan.pipeline import LAYOUT_HEADER
from shardfit.plan.plan import Alternative, Plan, estimate_all, make_plan, recommend
from shardfit.plan.render import format_table, plot
from shardfit.plan.sdpa_classes import SDPA_FIX, sdpa_refusal
from shardfit.plan.shapes import catalog, resolve_shape
from shardfit.plan.workload import (
    ATTENTIONS,
    LOSSES,
    QUANT_BACKENDS,
    Workload,
    for_target,
    model_workload,
    workload_of,
)
from shardfit.strategy import MULTI_RANK, NAMES

if TYPE_CHECKING:  # the data readers load only for a config with a tower
    from shardfit.data.image_census import MediaSample
    from shardfit.resolve import Resolved
    from shardfit.resolve.pipeline_choice import PipelineChoice
    from shardfit.resolve.resume import Resolution

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
    p.add_argument("--seq", type=positive_int, default=None)
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--grad-ckpt", choices=GRAD_CKPT, default=None,
                   help="none | full | selective (default: the config's; full with --model, as LLaMA-Factory, TRL and "
                        "ms-swift run)")
    _add_parallel_flags(p)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None)
    p.add_argument("--lora-rank", type=positive_int, default=None)
    _add_tool_flags(p)
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
    _add_media_flags(p)
    p.add_argument("--strategy", default=None, help="one strategy, or all (default)")
    p.add_argument("--simulate", action="store_true",
                   help="measure a fake-tensor training step (single, ddp, zero2, zero3) instead of estimating")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--nproc", type=positive_int, default=None, help="with --from: ranks the job launches per node")
    add_from(p, model_flags=False)
    p.set_defaults(func=run)


def _add_tool_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say how another tool's run computes: its loss, the dtypes its libraries leave, its 4-bit
    backend, TF32 and autocast (to predict an HF Trainer / TRL / LLaMA-Factory / axolotl run with --model)."""
    p.add_argument("--loss", choices=LOSSES, default=None,
                   help="chunked: shardfit's loss (default); full: logits of every position at once, as transformers' "
                        "own loss computes them (to predict an HF Trainer / LLaMA-Factory / axolotl / TRL run); "
                        "full_shift: the same with transformers 4.46-4.48, whose loss copied the shifted fp32 "
                        "logits; full_shift16: a GPT-2-style loss that copies the shifted 16-bit logits (older "
                        "remote code, e.g. Qwen v1); chunked_output: torchtune's CEWithChunkedOutputLoss")
    p.add_argument("--frozen-fp32", action="store_true", default=None,
                   help="frozen embeddings, norms and head in fp32, as peft's prepare_model_for_kbit_training leaves "
                        "them (to predict a TRL / axolotl QLoRA run)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="TF32 for fp32 matmuls, as the HF Trainer's tf32 sets it (default: on under --compile "
                        "unless fp16, else off): a bitsandbytes QLoRA's fp32 expert stacks run at that rate")
    p.add_argument("--adapters-16bit", action="store_true", default=None,
                   help="LoRA adapters, their gradients and AdamW states in the 16-bit compute dtype, not fp32 "
                        "(refused with --precision fp32): "
                        "shardfit's lora.dtype bf16 (no autocast); with --tool-autocast or a flag that implies it, "
                        "peft before 0.12 or LLaMA-Factory's pure_bf16 under their tool's autocast")
    p.add_argument("--pure-16bit", action="store_true", default=None,
                   help="every weight, gradient and AdamW state in the 16-bit compute dtype, no autocast (to predict "
                        "a torchtune recipe)")
    p.add_argument("--quant-backend", choices=QUANT_BACKENDS, default=None,
                   help="qlora: what dequantizes the 4-bit weights for each matmul: torchao (shardfit's, eager ops; "
                        "default) or bnb (bitsandbytes' fused kernel, as HF Trainer / TRL / LLaMA-Factory / axolotl "
                        "runs): sets the dequantization's time and temporary")
    p.add_argument("--bnb-compute-fp32", action="store_true", default=None,
                   help="qlora with bitsandbytes computing in fp32: transformers' BitsAndBytesConfig without "
                        "bnb_4bit_compute_dtype (its default); without autocast each weight's backward then holds "
                        "its 16-bit dequantization and an fp32 cast")
    p.add_argument("--bnb-optimizer", action="store_true", default=None,
                   help="AdamW from bitsandbytes (paged_adamw_32bit, adamw_bnb_8bit...): 32-bit states in fp32 "
                        "whatever the trainable weights' dtype")
    p.add_argument("--tool-autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="plan another tool's engine, which autocasts wherever it mixes precision (accelerate, "
                        "Lightning), not shardfit's runner (no autocast under FSDP2 or beside 16-bit adapters); "
                        "default: on with a flag that names another tool's library (--frozen-fp32, --quant-backend "
                        "bnb, --bnb-compute-fp32, --bnb-optimizer), as plan --from plans those runs; else off")


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """The parallel dimensions a plan can add: rows split, experts shared, a pipeline of stages."""
    p.add_argument("--sequence-parallel", type=positive_int, default=None, metavar="N",
                   help="ranks that split every row (Ulysses): each holds 1/N of its activations, plus the "
                        "all-to-alls of its attention (docs/long-context.md)")
    p.add_argument("--expert-parallel", type=positive_int, default=None, metavar="N",
                   help="ranks that share each block's routed experts (ddp, zero2, zero3 rows): each holds 1/N "
                        "of them, plus the all-to-alls that carry the tokens (docs/expert-parallel.md)")
    p.add_argument("--pipeline-parallel", type=positive_int, default=None, metavar="N",
                   help="also plan a pipeline of N stages over --grad-accum micro-batches (1F1B), each stage on "
                        "GPUS / N data-parallel GPUs under ddp, zero2 or zero3 (--strategy names one): where the "
                        "blocks are cut, each stage's memory, the bubble, the activations' traffic and the "
                        "gradients' reduction (default: every N that divides the GPUs, when --grad-accum is at "
                        "least N; docs/pipeline.md)")
    p.add_argument("--pipeline-stages-per-rank", type=positive_int, default=None, metavar="V",
                   help="plan that pipeline as interleaved 1F1B with V looped stages per GPU (a smaller bubble, "
                        "more activations in flight; pipeline_schedule: interleaved_1f1b)")
    p.add_argument("--pipeline-schedule", choices=("1f1b", "interleaved_1f1b", "zero_bubble"), default=None,
                   help="the schedule of that pipeline (the config's pipeline_schedule): zero_bubble plans torch's "
                        "interleaved zero bubble over V looped stages per GPU (--pipeline-stages-per-rank, "
                        "default 2), its bubble (stages-1)/(3 x V x micro-batches + stages-1)")


def _add_media_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say what images and audio each sample holds (vision-language and Omni models)."""
    p.add_argument("--images-per-sample", type=positive_int, default=None, metavar="N",
                   help="vision-language models: images in each training sample; the plan counts their patches and "
                        "the tokens they take within --seq (with a CONFIG and neither flag: counted from a sample "
                        "of its data's rows, the most images in one row at the largest size seen)")
    p.add_argument("--image-size", default=None, metavar="WxH", help="pixel size of those images, e.g. 1024x768")
    p.add_argument("--image-max-pixels", type=positive_int, default=None, metavar="N",
                   help="images with more pixels are resized down first (image_max_pixels; default the Qwen2-VL "
                        "processor's 12845056)")
    p.add_argument("--audio-per-sample", type=positive_int, default=None, metavar="N",
                   help="Qwen2.5-Omni: audio clips in each training sample; the plan counts their tokens within --seq")
    p.add_argument("--audio-seconds", type=float, default=None, metavar="S", help="length of those clips in seconds")


def local_precision() -> str:
    """What precision `auto` means on this machine's device."""
    from shardfit.parallel.env import cuda_available, resolve_precision  # torch: detect() has loaded it already

    return resolve_precision("auto", "cuda" if cuda_available() else "cpu")


# The tools whose job file leaves the model's preparation to a training script the reader does not run: there
# --frozen-fp32 and --bnb-compute-fp32 say what the script does (foreign/read.py `_script_flags`).
FROM_SCRIPT_FLAGS = ("hf", "deepspeed")
# Where the other tools decide those dtypes themselves, as the plan reads them.
FROZEN_BY_TOOL = {
    "llamafactory": "LLaMA-Factory loads them in its compute dtype and never runs peft's "
                    "prepare_model_for_kbit_training",
    "swift": "ms-swift loads them in its torch_dtype and never runs peft's prepare_model_for_kbit_training",
    "axolotl": "axolotl's loader decides (peft's prepare_model_for_kbit_training for a 4/8-bit model), as the plan "
               "reads its adapter and load_in_4bit keys"}
BNB_COMPUTE_BY_TOOL = {
    "llamafactory": "LLaMA-Factory passes its compute dtype to bitsandbytes as bnb_4bit_compute_dtype",
    "swift": "ms-swift takes it from --bnb_4bit_compute_dtype, by default from --torch_dtype (fp32 for float16 and "
             "float32, bf16 for bfloat16): set that argument in the job",
    "axolotl": "axolotl passes its torch_dtype to bitsandbytes as bnb_4bit_compute_dtype"}
OPTIMIZER_KEYS = {"llamafactory": "optim", "swift": "--optim", "axolotl": "optimizer", "hf": "--optim",
                  "deepspeed": "the JSON's optimizer section, else the training script's optimizer (DeepSpeed steps "
                               "fp32 masters whatever it is)"}
# `plan`'s workload flags that a job's file says instead (`with_flags` applies them to --model and a config only).
# Those in SCRIPT_SETTABLE apply to a job whose script decides them (hf, deepspeed) where its file does not say them.
FROM_IGNORES = ("precision", "optimizer", "lora_rank", "loss", "adapters_16bit", "pure_16bit", "quant_backend",
                "tf32", "compile", "float8", "lora_dropout", "attention", "grad_accum", "objective",
                "precompute_reference", "sequence_parallel", "expert_parallel", "pipeline_parallel",
                "pipeline_stages_per_rank", "pipeline_schedule", "images_per_sample", "image_size",
                "image_max_pixels", "audio_per_sample", "audio_seconds")


def _flag(dest: str, value: object) -> str:
    """The command-line spelling of `dest` as given: `--float8`, `--no-compile` (a BooleanOptionalAction's
    False), `--precision fp16`."""
    name = dest.replace("_", "-")
    return f"--{name}" if value is True else f"--no-{name}" if value is False else f"--{name} {value}"


def check_from_flags(args: argparse.Namespace) -> None:
    """`plan --from TOOL FILE` with `plan`'s workload flags: each either applies on top of the file, where the file
    cannot say it (--frozen-fp32 and --bnb-compute-fp32 for a job whose script prepares the model, --method, --seq,
    --batch, --grad-ckpt), changes nothing (--tool-autocast: a tool's engine is how --from plans), or is refused
    with exit 2, naming the flag, where the file or its tool decides and the plan reads it from there."""
    tool = args.from_tool
    name = TOOL_NAMES[tool]
    if args.frozen_fp32 and tool not in FROM_SCRIPT_FLAGS:
        raise UserError(f"--frozen-fp32 with --from {tool}: {FROZEN_BY_TOOL[tool]}, and the plan follows {name} "
                        f"there. Drop the flag (it says what a training script does: --from hf or deepspeed).")
    if args.bnb_compute_fp32 and tool not in FROM_SCRIPT_FLAGS:
        raise UserError(f"--bnb-compute-fp32 with --from {tool}: {BNB_COMPUTE_BY_TOOL[tool]}. Drop the flag (it "
                        f"says what a training script's BitsAndBytesConfig does: --from hf or deepspeed).")
    if args.bnb_optimizer:
        raise UserError(f"--bnb-optimizer with --from {tool}: the job's optimizer is {OPTIMIZER_KEYS[tool]}, which "
                        f"the plan reads (bitsandbytes' for adamw_bnb_8bit, paged_adamw_32bit...). Name the "
                        f"optimizer there and drop the flag.")
    if args.tool_autocast is False:
        raise UserError(f"--no-tool-autocast plans shardfit's own runner, but a --from job runs under {name}'s "
                        f"engine, which autocasts wherever it mixes precision (how --from plans it). Drop the flag, "
                        f"or convert the job (shardfit convert --from {tool} FILE) and plan the config.")
    if args.strategy not in (None, "all") and args.strategy not in NAMES:
        raise UserError(f"--strategy {args.strategy}: choose one of {', '.join(NAMES)} or all.")
    given = [dest for dest in FROM_IGNORES if getattr(args, dest, None) is not None
             and not (tool in FROM_SCRIPT_FLAGS and dest in SCRIPT_SETTABLE)]
    if given:
        flags = ", ".join(_flag(d, getattr(args, d)) for d in given)
        raise UserError(f"{flags} with --from {tool}: the plan takes {'this' if len(given) == 1 else 'these'} from "
                        f"the job's file, or {name}'s own default where the file leaves it out, as {name} runs it. "
                        f"Change the file, or plan the model with the flags instead (shardfit plan --model ID "
                        f"{flags.replace(', ', ' ')} ...).")


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


def audio_load(args: argparse.Namespace, config_max_seconds: float | None) -> AudioLoad | None:
    """The audio clips of a sample from --audio-per-sample / --audio-seconds (both or neither)."""
    if args.audio_per_sample is None and args.audio_seconds is None:
        return None
    if args.audio_per_sample is None or args.audio_seconds is None or args.audio_seconds <= 0:
        raise UserError("--audio-per-sample and --audio-seconds go together, e.g. --audio-per-sample 1 "
                        "--audio-seconds 10.")
    return AudioLoad(args.audio_per_sample, args.audio_seconds, config_max_seconds)


def media_load(args: argparse.Namespace, config_max_pixels: int | None) -> MediaLoad | None:
    """The images of a sample from --images-per-sample / --image-size (both or neither)."""
    if args.images_per_sample is None and args.image_size is None:
        return None
    if args.images_per_sample is None or args.image_size is None:
        raise UserError("--images-per-sample and --image-size go together, e.g. --images-per-sample 2 --image-size "
                        "1024x768.")
    width, height = parse_image_size(args.image_size)
    max_pixels = args.image_max_pixels or config_max_pixels or DEFAULT_MAX_PIXELS
    return MediaLoad(args.images_per_sample, width, height, max_pixels=max_pixels)


def data_sample(cfg: Config) -> Callable[[], MediaSample]:
    """The config's sampled rows, read on first use and once for the image and the audio census."""
    from shardfit.data.image_census import sampled_media  # the data readers: only for a config with a tower

    return functools.cache(lambda: sampled_media(cfg.data))


def audio_from_data(cfg: Config, sample: MediaSample, quiet: bool) -> AudioLoad | None:
    """The clips of a sample as the config's data holds them (a sample of rows, WAV headers only); the line
    saying so goes to stderr unless `quiet`."""
    from shardfit.data.audio_census import audio_census  # the data readers: only for a config with an audio tower

    census = audio_census(sample)
    if census is None:
        return None
    if not quiet:
        print(f"plan: {census.describe()}", file=sys.stderr)
    return AudioLoad(census.most_per_row, census.seconds, cfg.audio_max_seconds)


def media_from_data(cfg: Config, sample: MediaSample, quiet: bool) -> MediaLoad | None:
    """The images of a sample as the config's data holds them (a sample of rows, image headers only); the line
    saying what was taken goes to stderr (stdout stays the plan, JSON included)."""
    from shardfit.data.image_census import image_census  # Pillow and the data readers: only for a VL config

    census = image_census(sample)
    if census is None:
        return None
    if not quiet:
        print(f"plan: {census.describe()}", file=sys.stderr)
    return MediaLoad(census.most_per_row, census.width, census.height,
                     min_pixels=cfg.image_min_pixels or DEFAULT_MIN_PIXELS,
                     max_pixels=cfg.image_max_pixels or DEFAULT_MAX_PIXELS)


def resolved_job(cfg: Config, args: argparse.Namespace) -> tuple[Resolved | None, str | None]:
    """The job `train` would run for the config on the hardware planned (as `check` prints it), where output_dir
    holds a run to resume, as train resumes it (resolve/resume.py `resumed_job`); None when no strategy fits it
    (the table says why), with the refusal's first line where it is the resumed run's job that does not fit."""
    from shardfit.resolve import DeviceFacts, resolve_job
    from shardfit.resolve.resume import ResumeDoesNotFit, resumed_job

    if args.gpus:  # planned GPUs compute in bf16
        node = parse_gpus(args.gpus, 1, args.cpu_mem)

        def resolve(c: Config) -> Resolution:
            return resolve_job(c, node, DeviceFacts("cuda", True), nnodes=args.nodes)
    else:
        from shardfit.parallel.job import resolve_here  # torch: detect() has loaded it already

        def resolve(c: Config) -> Resolution:
            return resolve_here(c, nproc=None, nnodes=args.nodes)
    try:
        return resumed_job(cfg, resolve)[0], None
    except ResumeDoesNotFit as e:
        return None, str(e).split("\n")[0]
    except DoesNotFitError:
        return None, None


def resumed_choice(cfg: Config, job: Resolved) -> str:
    """The line recommending the job of the run in output_dir that `train` resumes, where it keeps the job its run
    directory recorded (resolve/resume.py); empty where train resolves the job anew."""
    if not job.kept_as_recorded:
        return ""
    split = f" with each row split over {job.sequence_parallel} GPUs" if job.sequence_parallel > 1 else ""
    stages = f" in {job.pipeline_parallel} pipeline stages" if job.pipeline_parallel > 1 else ""
    return (f"recommended: {job.strategy}{split}{stages}, the job below: the run in {cfg.output_dir} resumes as it "
            "was recorded, which train runs (resume: never, or a new output_dir, resolves the job anew)")


def pipeline_strategies(args: argparse.Namespace, cfg: Config | None) -> tuple[str, ...]:
    """The strategies over a stage's data-parallel GPUs to plan: the one --strategy (or the config) names where it
    runs in stages, else each that does."""
    from shardfit.resolve.pipeline import PP_DP_STRATEGIES

    named = args.strategy if args.strategy not in (None, "all") else (cfg.strategy if cfg is not None else None)
    return (named,) if named in PP_DP_STRATEGIES else PP_DP_STRATEGIES


def auto_choice(cfg: Config, plan: Any, job: Any) -> str:
    """The line recommending the job `strategy: auto` resolved where it is not the plan's best strategy over whole
    rows (auto split the rows over ranks, resolve/decide.py, as train runs the job on these GPUs); empty where it
    is, where the config names the strategy, or where a pipeline's own line recommends it."""
    if cfg.strategy != "auto" or cfg.sequence_parallel != 1 or job.pipeline_parallel > 1 \
            or job.sequence_parallel == 1:
        return ""
    split = plan_for_split(cfg, job)
    rate = f", ~{split.step_s:.0f} s/step, {split.tokens_per_s:,.0f} tokens/s" \
        if split is not None and split.tokens_per_s and split.step_s else ""
    a = plan.adjusted
    lone = f"; {plan.recommended} with whole rows, in one process, trains {c.tokens_per_s:,.0f} tokens/s" \
        if plan.recommended and (c := plan.candidate(plan.recommended)) is not None and c.tokens_per_s else \
        f"; with whole rows only {a.strategy} with {a.what} fits, {a.tokens_per_s:,.0f} tokens/s" \
        if not plan.recommended and a is not None and a.tokens_per_s else ""
    return (f"recommended: {job.strategy} with each row split over {job.sequence_parallel} GPUs "
            f"(sequence_parallel {job.sequence_parallel}{rate}), the job below, which train runs on these "
            f"{job.hardware.world} GPUs{lone}")


def plan_for_split(cfg: Config, job: Any) -> Candidate | None:
    """The job's strategy planned with its rows split as the job runs them (the job's own plan)."""
    from shardfit.plan.choose import plan_for_config

    split = plan_for_config(dataclasses.replace(cfg, sequence_parallel=job.sequence_parallel,
                                                precision=job.precision), job.hardware)
    return split.candidate(job.strategy) if split is not None else None


# The flags that plan the images or audio of another workload than the config's data holds (`_with_media`).
MEDIA_FLAGS = ("images_per_sample", "image_size", "image_max_pixels", "audio_per_sample", "audio_seconds")
# The flags that plan other pipelines than those `pipeline_parallel: auto` weighs (every count, as 1F1B).
PIPELINE_FLAGS = ("pipeline_parallel", "pipeline_stages_per_rank", "pipeline_schedule")


def plans_the_job(args: argparse.Namespace, cfg: Config | None) -> bool:
    """Whether the table plans what `train CONFIG` resolves on these GPUs: a config under `strategy: auto`, every
    strategy planned (no --strategy), and no flag that plans another workload (--seq, --batch, --method, media,
    pipelines ...). Only then may the plan's recommendation follow the job auto resolves; else the table's
    recommendation is for what the table plans, which the job line (the config's) does not run."""
    if cfg is None or cfg.strategy != "auto" or args.strategy not in (None, "all"):
        return False
    if any(getattr(args, k) is not None for k in (*MEDIA_FLAGS, *PIPELINE_FLAGS)):
        return False
    base = workload_of(cfg)
    return with_flags(base, args) == base


def job_rivals(args: argparse.Namespace, cfg: Config | None, plan: Any,
               hw: Hardware) -> tuple[list[Candidate] | None, int]:
    """What a pipeline is weighed against: where the table plans the config's own job (`plans_the_job`) on named
    GPUs, what `train` would otherwise run on them with the processes left to auto (resolve/decide.py
    `auto_rivals`, the decision `pipeline_parallel: auto` follows), so that the pipeline recommended is the job's;
    else the plan's recommended strategy (None)."""
    if cfg is None or not args.gpus or hw.world < 2 or not plans_the_job(args, cfg):
        return None, 1
    from shardfit.resolve import DeviceFacts
    from shardfit.resolve.decide import auto_rivals

    whole = dataclasses.replace(cfg, pipeline_parallel=1)
    return auto_rivals(whole, DeviceFacts("cuda", True), plan, None, args.nodes, hw.gpus_per_node)


def named_without_stages(args: argparse.Namespace, choice: PipelineChoice) -> PipelineChoice:
    """`choice` as the plan recommends it where --strategy names a strategy that does not run in stages (single,
    model_parallel, zero3_offload): the layouts stay planned, but the recommendation stays among the strategy
    named, so none of them is recommended."""
    from shardfit.resolve.pipeline import PP_DP_STRATEGIES

    named = args.strategy
    if named in (None, "all") or named in PP_DP_STRATEGIES or not choice.recommended:
        return choice
    return dataclasses.replace(choice, recommended=False, why=(
        f"not {choice.pick.layout}: --strategy {named} plans that strategy alone, and a pipeline's stages run "
        f"{', '.join(PP_DP_STRATEGIES)} (plan with --strategy all to weigh the pipelines)"))


def add_pipelines(args: argparse.Namespace, cfg: Config | None, plan: Any, shape: ModelShape, w: Workload,
                  hw: Hardware, source: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The pipeline layouts planned beside the strategies: their JSON and text lines (a table of the layouts, the
    fastest that fits described, and whether the plan recommends it over the strategies: the decision
    resolve/pipeline_choice.py makes, which `strategy: auto` follows); (None, []) without any."""
    from shardfit.resolve.pipeline import LOOPED, stages_per_rank
    from shardfit.resolve.pipeline_choice import choose_pipeline, rules_config

    configured = cfg.pipeline_parallel if cfg is not None and cfg.pipeline_parallel != "auto" else 1
    asked = args.pipeline_parallel or configured
    per_rank = args.pipeline_stages_per_rank or (stages_per_rank(cfg) if cfg is not None else 1)
    named = args.pipeline_schedule or (cfg.pipeline_schedule if cfg is not None else "1f1b")
    if args.pipeline_schedule == "1f1b":
        per_rank = 1
    elif named in LOOPED and per_rank == 1:  # a looped schedule named without V: the config's (default) V
        per_rank = (cfg or Config()).pipeline_stages_per_rank
    # Looped stages are planned as the schedule named, interleaved 1F1B unless it is zero bubble.
    schedule = "zero_bubble" if named == "zero_bubble" else "interleaved_1f1b"
    looped = asked > 1 and per_rank > 1
    rules = rules_config(cfg, w, schedule if looped else "1f1b")
    rivals, split = job_rivals(args, cfg, plan, hw)
    choice = choose_pipeline(plan, shape, w, hw, source, rules, asked=asked, per_rank=per_rank,
                             names=pipeline_strategies(args, cfg), schedule=schedule, rivals=rivals, split=split)
    if choice is None:
        return None, []
    choice = named_without_stages(args, choice)
    pipe, note, why = choice.pick, choice.note, choice.why
    out = {**pipe.to_json(), "note": note, "recommended": choice.recommended, "versus": why,
           "layouts": [p.to_json() for p in choice.layouts]}
    table = [LAYOUT_HEADER, *(p.row() for p in choice.layouts)] if len(choice.layouts) > 1 or pipe.dp > 1 else []
    return out, [*table, pipe.describe() + (f"\n  {note}" if note else "") + f"\n  {why}"]


def split_alternative(shape: ModelShape, w: Workload, hw: Hardware, source: str) -> Alternative | None:
    """When nothing fits: the fewest GPUs splitting every row (`sequence_parallel`) under which a multi-rank
    strategy fits, found by the rule `strategy: auto` follows (resolve/decide.py `smallest_split`). On several
    nodes, where no split dividing their ranks fits, a split that fits on another node count (fewer nodes first,
    then up to twice as many), the count given as the Alternative's `nodes` and said in its words. None where the
    rows are split already, the split's rules refuse the model or the objective, or no split fits on any of
    those node counts."""
    from shardfit.resolve.decide import smallest_split
    from shardfit.resolve.sequence import check_model, facts_of_shape

    if w.sequence_parallel != 1 or get_objective(w.objective).preference:
        return None

    def allowed(n: int) -> bool:
        try:
            check_model(n, facts_of_shape(shape), source)
        except UserError:
            return False
        return True

    def fits_on(on: Hardware) -> Callable[[int], Candidate | None]:
        def fits(n: int) -> Candidate | None:
            cands = estimate_all(shape, dataclasses.replace(w, sequence_parallel=n), on, MULTI_RANK)
            best, _ = recommend(cands, on)
            return next(c for c in cands if c.strategy == best) if best else None
        return fits

    found = smallest_split(hw.world, allowed, fits_on(hw))
    if found is not None:
        n, c = found
        return Alternative(f"every row split over {n} GPUs", (("sequence_parallel", n),), None, c.strategy,
                           c.per_gpu_gib.total, hw.unit)
    # A split must divide the ranks: on 3 nodes of 8 (24 ranks) a 16-way split, which a 64-head model allows and
    # which fits, cannot be laid out, while 2 or 4 such nodes take it. Fewer nodes first (the GPUs at hand). On one
    # node every split divides some node count: more nodes are the "twice the GPUs" alternative's to offer.
    for nodes in [*range(hw.nodes - 1, 0, -1), *range(hw.nodes + 1, 2 * hw.nodes + 1)] if hw.nodes > 1 else []:
        on = dataclasses.replace(hw, nodes=nodes)
        found = smallest_split(on.world, lambda n: hw.world % n != 0 and allowed(n), fits_on(on))
        if found is not None:
            n, c = found
            return Alternative(f"every row split over {n} GPUs, on {nodes} node(s) ({n} does not divide the "
                               f"{hw.world} ranks of {hw.nodes} nodes: a split must divide the ranks and the heads)",
                               (("sequence_parallel", n),), nodes, c.strategy, c.per_gpu_gib.total, hw.unit)
    return None


def names_a_tool(args: argparse.Namespace) -> bool:
    """Whether a flag names what only another tool's stack does (peft's prepare_model_for_kbit_training,
    bitsandbytes' kernels or optimizer): the run is then that tool's, under its engine's autocast, as `plan --from`
    plans it (`Workload.tool_autocast`); the one rule behind --tool-autocast's default."""
    return bool(args.frozen_fp32 or args.quant_backend == "bnb" or args.bnb_compute_fp32 or args.bnb_optimizer)


def with_flags(w: Workload, args: argparse.Namespace) -> Workload:
    """The workload with the fields the flags set (the others as the config, or `train`'s defaults, have them)."""
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        raise UserError(f"--lora-dropout {args.lora_dropout}: a probability in [0, 1), e.g. --lora-dropout 0.05.")
    precompute = {"true": True, "false": False}.get(args.precompute_reference, args.precompute_reference)
    overrides = {"method": args.method, "precision": args.precision, "seq_len": args.seq, "micro_batch": args.batch,
                 "grad_ckpt": args.grad_ckpt, "optimizer": args.optimizer, "lora_rank": args.lora_rank,
                 "loss": args.loss, "grad_accum": args.grad_accum, "frozen_fp32": args.frozen_fp32,
                 "attention": args.attention, "adapters_16bit": args.adapters_16bit, "pure_16bit": args.pure_16bit,
                 "compile": args.compile, "tf32": args.tf32, "lora_dropout": args.lora_dropout,
                 "objective": args.objective,
                 "precompute_reference": precompute, "sequence_parallel": args.sequence_parallel,
                 "quant_backend": args.quant_backend, "expert_parallel": args.expert_parallel,
                 "float8": args.float8, "bnb_compute_fp32": args.bnb_compute_fp32,
                 "bnb_optimizer": args.bnb_optimizer}
    if args.optimizer not in (None, w.optimizer):  # the dtypes of the job's own optimizer's states go with it
        overrides["optimizer_dtypes"] = ()
    w = dataclasses.replace(w, **{k: v for k, v in overrides.items() if v is not None})
    tool = args.tool_autocast if args.tool_autocast is not None else names_a_tool(args) or None
    if tool is not None:
        w = dataclasses.replace(w, tool_autocast=tool)
    if w.adapters_16bit and w.precision == "fp32":
        # 16-bit adapters are planned 2 bytes in any run (TRL's cast of a k-bit model's trainables is bf16 in an
        # fp32 run too); shardfit's train refuses them at fp32, and peft < 0.12's adapters take an fp32 base's dtype
        raise UserError("16-bit LoRA adapters (--adapters-16bit or lora.dtype: bf16) with precision fp32: train "
                        "refuses bf16 adapters without bf16 weights, and peft before 0.12 keeps an fp32 base's "
                        "adapters in fp32. Use --precision bf16, or drop --adapters-16bit / lora.dtype.")
    if args.bnb_compute_fp32 and not w.bnb:
        # the compute dtype is bitsandbytes' Linear4bit's: any other run would plan exactly as without the flag
        raise UserError(f"--bnb-compute-fp32 sets bitsandbytes' 4-bit compute dtype, but this run is method "
                        f"{w.method} with quant backend {w.quant_backend}: add --method qlora --quant-backend bnb, "
                        "or drop the flag.")
    if w.precompute_reference is False and w.reference is not None and not w.trains_adapters:
        raise UserError(f"precompute_reference false: method {w.method} has no adapters to switch off for "
                        f"{w.objective}'s reference; use --precompute-reference auto or true (computed once before "
                        "step 1), or --method lora.")
    return w


def add_job(args: argparse.Namespace, cfg: Config, plan: Any, pipeline: dict[str, Any] | None, out: dict[str, Any],
            table: str, lines: list[str]) -> tuple[str, list[str], str]:
    """The job `train` runs for the config (`resolved_job`) added to the plan's JSON and text: its line and why,
    and where the table plans that job, the recommendation of it (the job auto split, or a resumed run's job);
    the table and lines as they are then, and the line recommending the job (empty where the table's own
    recommendation stands)."""
    job, refused = resolved_job(cfg, args)
    chosen = ""
    if refused:  # train would refuse the resumed run's job before loading: say so with the table
        out["resume_refused"] = refused
        lines = [*lines, refused]
    if job is None:
        return table, lines, chosen
    out["resolved"] = job.to_json()
    if plans_the_job(args, cfg):  # the table plans the job train resolves: recommend that job
        resumed = resumed_choice(cfg, job)
        chosen = resumed or auto_choice(cfg, plan, job)
        if resumed and pipeline is not None and pipeline["recommended"] and job.pipeline_parallel == 1:
            lines = [x.replace("recommended over the strategies above", "fastest over the strategies above")
                     for x in lines]
        if chosen:  # the job, not the best strategy over whole rows (or a smaller micro-batch), is what to run
            table = table.replace("\nrecommended: ", "\nbest strategy: ", 1).replace(
                "\nnothing fits as configured. recommended: ", "\nnothing fits as configured with whole rows: ", 1)
            lines = [*lines, chosen]
        if chosen or (pipeline is not None and pipeline["recommended"] and job.pipeline_parallel > 1):
            out["recommended"] = job.strategy  # the strategy the recommended job runs (`resolved` says how)
    from shardfit.resolve.decide import LONE_WHY, PIPE_WHY, SPLIT_WHY  # resolved_job imported it
    from shardfit.resolve.resume import RESUMED_WHY

    # auto split the rows or turned a pipeline on, a pipeline's lone stages run as ddp, or the run resumes as
    # recorded: why
    return table, [*lines, job.describe(), *(f"  {w}" for w in job.why if w.startswith(
        (SPLIT_WHY, PIPE_WHY, LONE_WHY, RESUMED_WHY)))], chosen


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
    w, media, audio = _with_media(args, cfg, shape, w)
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


def _with_media(args: argparse.Namespace, cfg: Config | None, shape: ModelShape,
                w: Workload) -> tuple[Workload, Any, Any]:
    """The workload with each sample's images and audio (from the flags, else from a sample of the config's
    data), and what was counted of them."""
    sample = data_sample(cfg) if args.config else None
    media = media_load(args, cfg.image_max_pixels if args.config else None)
    if media is None and sample is not None and (shape.vision is not None or shape.soft_tower is not None):
        media = media_from_data(cfg, sample(), args.json)
    if media is not None:
        if shape.vision is not None:  # the tower's own geometry (every Qwen-VL so far: 14-pixel patches, 2x2)
            media = dataclasses.replace(media, patch=shape.vision.patch, merge=shape.vision.merge)
        elif shape.soft_tower is not None:  # Gemma 3: mm_tokens_per_image tokens per image, any size
            media = shape.soft_tower.load(media)
        check_fits(media, w.seq_len)
        rows, cols = media.grid()
        w = dataclasses.replace(w, images=media.images_per_sample, image_rows=rows, image_cols=cols)
    audio = audio_load(args, cfg.audio_max_seconds if args.config else None)
    if audio is None and sample is not None and shape.audio is not None:
        audio = audio_from_data(cfg, sample(), args.json)
    if audio is not None:
        if shape.audio is not None:  # the tower's own token count (Qwen3-Omni's per chunk of frames)
            audio = dataclasses.replace(audio, chunk=shape.audio.token_chunk)
        check_audio_fits(audio, w.seq_len, media.tokens_per_sample() if media is not None else 0)
        w = dataclasses.replace(w, audio_clips=audio.clips_per_sample, audio_frames=audio.frames())
    return w, media, audio
