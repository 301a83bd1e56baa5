"""`shardfit chat`: talk to a trained model in the terminal, or answer one prompt or a file of prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardfit.errors import UserError
from shardfit.gc_policy import end_of_startup
from shardfit.infer.prompts import read_requests, request_of

EXAMPLE = """examples:
  shardfit chat runs/demo                                  interactive (/reset, /system TEXT, /exit)
  shardfit chat runs/demo --prompt "Extract: Ana, 31, Lisbon"
  shardfit chat runs/demo --input prompts.jsonl --output answers.jsonl
  shardfit chat runs/vl --image photo.png --prompt "What colour is this?"   (Qwen2-VL, Qwen2.5-VL)
  shardfit chat path/to/base-model --adapter runs/demo/adapter"""


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Where and how a command generates (shared by chat and eval)."""
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder applied to MODEL (not merged)")
    p.add_argument("--device", default="auto", help="auto (the first GPU, else the CPU) | cpu | cuda | cuda:N")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="compute dtype (auto: bf16 where the device is fast at it, else fp16 on GPUs, fp32 on CPUs)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="longest reply, in tokens")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together (--input)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own Python code")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a trained model, or answer --prompt / --input prompts",
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="RUN_DIR|MODEL",
                   help="a run directory (its adapter or model), a Hugging Face folder, a .gguf file or a bundled id")
    add_sampling_args(p, 256)
    p.add_argument("--system", default=None, help="system prompt for every conversation")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (reproducible); above 0 samples")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling when --temperature > 0")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    how.add_argument("--input", default=None, metavar="FILE.jsonl",
                     help="answer every row ({\"prompt\": ...}, alpaca, ShareGPT or OpenAI messages) as JSONL")
    p.add_argument("--output", default=None, metavar="FILE.jsonl", help="with --input: write here (default stdout)")
    p.add_argument("--image", default=None, action="append", metavar="PATH",
                   help="vision-language models: an image the --prompt asks about (repeat for several; the prompt's "
                        "<image> placeholders place them, else they come before its text)")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}.")
    if not args.temperature >= 0 or args.temperature == float("inf"):  # nan samples from garbage probabilities
        raise UserError(f"--temperature must be 0 (greedy) or more, got {args.temperature}.")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p is the probability mass sampled from, in (0, 1], got {args.top_p}; e.g. "
                        "--top-p 0.9.")
    if args.output and not args.input:
        raise UserError("--output goes with --input FILE.jsonl.")
    if args.output and (Path(args.output).is_dir() or not Path(args.output).parent.is_dir()):
        # said before the model loads, not after every answer is generated
        raise UserError(f"--output {args.output}: not a file in an existing folder; name the JSONL file to write, "
                        "e.g. --output answers.jsonl.")
    if args.image and args.prompt is None:
        raise UserError("--image goes with --prompt TEXT, e.g. --image photo.png --prompt \"What is in it?\".")
    if args.input and not Path(args.input).is_file():
        raise UserError(f"--input {args.input}: no such file.")


def run(args: argparse.Namespace) -> int:
    _check(args)
    # torch, transformers and peft: only once a model is actually used
    from shardfit.infer.chat import chat_loop
    from shardfit.infer.generate import Sampling, generate_batch
    from shardfit.infer.load import load_for_inference, pick_device, resolve_target

    target = resolve_target(args.target, args.adapter)
    requests = read_requests(args.input, args.system) if args.input else None
    if args.image:
        from shardfit.infer.images import check_image

        images = [check_image(p) for p in args.image]  # a bad image stops here, before the model loads
    loaded = load_for_inference(target, device=pick_device(args.device), precision=args.precision,
                                trust_remote_code=args.trust_remote_code)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
    if args.image:
        from shardfit.infer.images import generate_with_images, vision_processor_for

        vp = vision_processor_for(target, loaded.tokenizer, args.trust_remote_code)
        req = request_of({"prompt": args.prompt}, "--prompt", args.system)
        print(generate_with_images(loaded.model, loaded.tokenizer, vp, req.messages, images, sampling))
        return 0
    if args.prompt is not None:
        req = request_of({"prompt": args.prompt}, "--prompt", args.system)
        print(generate_batch(loaded.model, loaded.tokenizer, [req.messages], sampling)[0])
        return 0
    if requests is not None:
        answers = generate_batch(loaded.model, loaded.tokenizer, [r.messages for r in requests], sampling,
                                 batch_size=args.batch_size, show=True)
        out = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115 - stdout is not ours to close
        try:
            for req, answer in zip(requests, answers, strict=True):
                out.write(json.dumps({"prompt": req.messages[-1]["content"], "response": answer,
                                      "expected": req.expected, "where": req.where}) + "\n")
        finally:
            if args.output:
                out.close()
        if args.output:
            print(f"{len(answers)} answers written to {args.output}", file=sys.stderr)
        return 0
    print(f"chatting with {target.label} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')})",
          file=sys.stderr)
    end_of_startup()  # the model lives as long as the conversation
    chat_loop(loaded.model, loaded.tokenizer, sampling, system=args.system)
    return 0
