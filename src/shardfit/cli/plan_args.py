"""`plan`'s flags beyond the model and the GPUs: the groups of them `add_parser` adds (another tool's stack,
the parallel dimensions, the media), the workload they set (`with_flags`), and which of them a job's file
says instead under `--from` (`check_from_flags`)."""

from __future__ import annotations

import argparse
import dataclasses

from shardfit.cli.args import positive_int
from shardfit.errors import UserError
from shardfit.foreign.job import TOOL_NAMES
from shardfit.foreign.read import SCRIPT_SETTABLE
from shardfit.plan.workload import LOSSES, QUANT_BACKENDS, Workload
from shardfit.strategy import NAMES


def add_tool_flags(p: argparse.ArgumentParser) -> None:
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


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
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


def add_media_flags(p: argparse.ArgumentParser) -> None:
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
