"""What `compile: auto` and `attn_implementation: auto` should choose on this machine: SmolLM2-135M LoRA training
steps (the demo's LoRA, fp32 or bf16) timed eager vs compiled blocks and SDPA vs eager attention, at a few row lengths,
on the GPU where there is one, else on the CPU.

    python bench/defaults_probe.py                       # writes bench/results/defaults_probe.json
    python bench/defaults_probe.py --lengths 128 256 --reps 2

One process, one model. Each micro-batch is 4 rows of `length` tokens, each row two packed examples (positions
restart mid-row), which is what packing hands the attention kernel: a block-diagonal mask. A row of one example
(no mask: SDPA's causal fast path) is timed too. Variants run interleaved (A, B, C, D, A, B, ...) so load from other
processes on a shared machine hits all alike; the JSON keeps every timing and the medians. Compiled variants also
record their first step (the compile itself, into an empty kernel cache), which a user waits for once per model
and shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _batch(length: int, rows: int, packed: bool, vocab: int):  # noqa: ANN202 - torch is imported in main
    import torch

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(100, vocab - 1, (rows, length), generator=g)
    if packed:
        half = length // 2
        pos = torch.cat([torch.arange(half), torch.arange(length - half)]).repeat(rows, 1)
    else:
        pos = torch.arange(length).repeat(rows, 1)
    targets = ids.roll(-1, dims=1)
    targets[:, : length // 4] = -100  # prompt tokens carry no label
    return ids, pos, targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds; each times 2 steps per variant")
    ap.add_argument("--no-compile", action="store_true", help="eager variants only (no C++ compiler needed)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: frozen weights in bf16 and autocast, as `train` runs precision bf16")
    ap.add_argument("--out", type=Path, default=RESULTS / "defaults_probe.json")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                    help="a model id or folder (bench/gpu.py makes one where the bundled GGUF cannot go)")
    args = ap.parse_args(argv)
    # An empty kernel cache, so the first compiled step shows what a user's first run pays.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="probe-inductor-"))

    import torch

    from shardfit.config import Config, LoraSettings
    from shardfit.models.adapters import skip_adapter_input_casts
    from shardfit.models.anatomy import transformer_blocks
    from shardfit.models.build import build_model
    from shardfit.parallel.compile import compile_blocks
    from shardfit.train.loss import CausalLMLoss
    from shardfit.train.optim import build_optimizer

    # Every (shape, attention) pair is its own graph: more than dynamo's default number of recompiles per block.
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    # On a GPU where there is one (the rule is per device type), else on this CPU.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Config(model=args.model, method="lora", precision=args.precision, lora=LoraSettings(rank=16, alpha=32))
    model = build_model(cfg, "single", weights=True).to(device)
    module = CausalLMLoss(model)
    amp = contextlib.nullcontext()
    if args.precision == "bf16":  # as the recipe runs it: autocast, and no adapter input casts inside it
        amp = torch.autocast(device.type, dtype=torch.bfloat16)
        skip_adapter_input_casts(model)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(params, 1e-4, 0.0)
    blocks = transformer_blocks(model)
    vocab = model.config.vocab_size

    compiled_impl: list = []
    if not args.no_compile:
        compile_blocks(model)
        compiled_impl = [b._compiled_call_impl for b in blocks]

    def set_mode(compiled: bool, attention: str) -> None:
        for b, impl in zip(blocks, compiled_impl, strict=False):
            b._compiled_call_impl = impl if compiled else None  # nn.Module.compile's hook, toggled per variant
        model.set_attn_implementation(attention)

    def step(batch) -> float:  # noqa: ANN001
        t = time.perf_counter()
        with amp:
            loss, n = module(*batch[:2], batch[2])
        (loss / max(n, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":  # the GPU's work, not only its dispatch
            torch.cuda.synchronize()
        return time.perf_counter() - t

    load = round(os.getloadavg()[0], 2)
    variants = [(c, a) for c in ((False, True) if compiled_impl else (False,)) for a in ("sdpa", "eager")]
    results = []
    for length in args.lengths:
        for packed in (True, False):
            batch = [t.to(device) for t in _batch(length, args.rows, packed, vocab)]
            first: dict[str, float] = {}
            times: dict[str, list[float]] = {}
            for compiled, attention in variants:  # warm-up (and compile) once per variant and shape
                name = f"{'compiled' if compiled else 'eager'}+{attention}"
                set_mode(compiled, attention)
                first[name] = round(step(batch), 3)
                times[name] = []
            for _ in range(args.reps):
                for compiled, attention in variants:
                    name = f"{'compiled' if compiled else 'eager'}+{attention}"
                    set_mode(compiled, attention)
                    times[name] += [round(step(batch), 3) for _ in range(2)]
            med = {k: statistics.median(v) for k, v in times.items()}
            base = med["eager+sdpa"]
            row = {"length": length, "rows": args.rows, "packed": packed, "first_step_s": first, "step_s": times,
                   "median_s": med, "speed_vs_eager_sdpa": {k: round(base / v, 3) for k, v in med.items()}}
            results.append(row)
            print(json.dumps({k: row[k] for k in ("length", "packed", "median_s", "speed_vs_eager_sdpa",
                                                  "first_step_s")}), flush=True)
            # Written after every shape: a run stopped early still leaves what it measured.
            machine = torch.cuda.get_device_name(0) if device.type == "cuda" else \
                f"{os.cpu_count()}-core {platform.machine()} CPU"
            out = {"machine": machine, "load_avg_1m_at_start": load,
                   "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "model": cfg.model, "method": "lora r16",
                   "precision": args.precision,
                   "lengths_asked": args.lengths, "results": results}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
