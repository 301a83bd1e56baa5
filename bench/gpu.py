"""The peer bench on a GPU machine that reaches no network and takes few files along.

    python bench/gpu.py export .gpu                          # here: SmolLM2-135M's config and tokenizer (3 MB)
    python bench/gpu.py run .gpu --out gpu.json [--runs N]   # there: compare.py's single-process workloads
    python bench/gpu.py models .gpu --work-dir W             # there: only the model folders (W/smollm2, W/qwen2)
    python bench/gpu.py run .gpu --variants cudnn:attn_implementation=sdpa   # an A/B of a default, as compare.py
    python bench/gpu.py check --out bench/results/gpu_check.json   # the ten-minute check (bench/gpu_check.py)

The bundled SmolLM2 GGUF (94 MB) is more than such a machine takes along, so `run` builds SmolLM2-135M-Instruct's
architecture from its config with random weights (seed 0, fp32 safetensors, the same folder for every tool).
Tokens/s, MFU and memory do not depend on the weights' values; the eval losses then compare the tools from the
same random start, not the quality of a fine-tune of the real model. The full fine-tune workloads' small Qwen2 is
random-initialised on the CPU bench as well. Everything else is bench/compare.py as it runs on a CPU: the same
workloads, configs, peers, rounds and evaluator, with the peers on the GPU (the Trainer's `use_cpu` off) and peak
memory counted as allocated GPU memory for every tool.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import compare  # noqa: E402 - bench/ is not a package; its path is set above
from workloads import SMOLLM2, WORKLOADS, qwen2_small_folder  # noqa: E402

SINGLE_PROCESS = [name for name, w in WORKLOADS.items() if w.nproc == 1]


def export(to: Path) -> None:
    """SmolLM2-135M-Instruct's config.json and tokenizer files (no weights) from the bundled GGUF, into `to`."""
    from transformers import AutoConfig

    from shardfit.models.build import load_tokenizer
    from shardfit.models.source import resolve_model

    src = resolve_model(SMOLLM2)
    config = AutoConfig.from_pretrained(src.folder, gguf_file=src.gguf_file)
    if hasattr(config, "quantization_config"):  # the GGUF's own; the bench's folders hold plain fp32 weights
        del config.quantization_config
    to.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(to)
    load_tokenizer(src).save_pretrained(to)


def model_folders(assets: Path, work: Path) -> None:
    """The folders compare.py's workloads load (work/smollm2, work/qwen2), made from `assets` without the GGUF."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets)
    smol = work / "smollm2"
    if not (smol / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets), dtype=torch.float32)
        model.save_pretrained(smol)
        tokenizer.save_pretrained(smol)
    qwen2_small_folder(work / "qwen2", tokenizer)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:  # the ten-minute check has its own options (bench/gpu_check.py)
        import gpu_check

        sys.exit(gpu_check.main(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=("export", "models", "run"))
    p.add_argument("assets", type=Path, help="the folder `export` writes and `run` reads")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfit-gpu-bench"))
    args, rest = p.parse_known_args(argv)
    if args.verb == "export":
        export(args.assets)
        return
    if not (args.assets / "tokenizer_config.json").is_file():
        p.error(f"{args.assets}: no exported assets; run `python bench/gpu.py export {args.assets}` first")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_folders(args.assets, args.work_dir)
    if args.verb == "models":
        return
    # compare.py's options, with these defaults where `rest` does not give its own.
    defaults = {"--peers": ["hf_trainer"], "--modes": ["same_config", "same_precision"],
                "--workloads": SINGLE_PROCESS}
    chosen = [x for opt, vals in defaults.items() if opt not in rest for x in (opt, *vals)]
    compare.main([*chosen, *rest, "--work-dir", str(args.work_dir)])


if __name__ == "__main__":
    main()
