"""The bench's workloads: what each trains, on which data, and the user config every peer is given.

A workload is a user's config (model, data, method, LoRA, max_seq_len, micro_batch, grad_accum, lr, epochs, seed):
shardfit gets it as a YAML file, with nothing else set, as a user would run it; each peer gets the same values
through its own arguments. Data and model folders are made once per bench invocation, so every run reads the
same files.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "src" / "shardfit" / "demo"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Workload:
    """One fine-tune, as a user would configure it."""

    name: str
    model: str  # "smollm2" (the bundled GGUF, converted once to a safetensors folder) or "qwen2-small"
    method: str  # "lora" or "full"
    data: str  # "demo" (the first `rows` demo notes) or "longtail" (`rows` conversations, lengths long-tailed)
    rows: int
    max_seq_len: int
    micro_batch: int
    lr: float
    peers: tuple[str, ...]
    grad_accum: int = 1
    epochs: int = 1
    nproc: int = 1
    strategy: str | None = None  # None: shardfit's default (auto)
    lora_rank: int = 8
    lora_alpha: int = 16
    eval_rows: int = 48  # held-out rows the shared evaluator scores (the demo has 48)
    precision: str | None = None  # None: each tool's own default (shardfit: bf16; the Trainer: fp32; TRL: bf16)


SINGLE = ("hf_trainer", "trl_sft")
WORKLOADS = {w.name: w for w in (
    # Runs of tens of optimizer steps, as a user's smallest real fine-tune (the issue's own example: 240 rows, 60
    # steps): a run of a few steps measures mostly the imports every tool pays. One round of every workload and
    # peer stays under an hour on 2 cores.
    Workload("smollm2-135m-lora", "smollm2", "lora", "demo", 240, 256, 4, 1e-3, SINGLE),
    # Most conversations hold one note, some up to twelve: padding to the longest wastes most of a batch.
    Workload("smollm2-135m-lora-longtail", "smollm2", "lora", "longtail", 96, 512, 4, 1e-3, SINGLE),
    Workload("qwen2-small-full-longtail", "qwen2-small", "full", "longtail", 96, 1024, 2, 5e-4, SINGLE),
    Workload("qwen2-small-full-zero3", "qwen2-small", "full", "longtail", 64, 1024, 2, 5e-4,
             ("deepspeed_zero3", "deepspeed_zero2"), nproc=2, strategy="zero3"),
)}


def longtail_rows(n: int, seed: int = 7) -> list[dict]:
    """`n` alpaca rows built from the demo notes: 70% hold one note, the rest 2..12 (a long tail of lengths)."""
    rng = random.Random(seed)
    notes = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    rows = []
    for _ in range(n):
        k = 1 if rng.random() < 0.7 else rng.randint(2, 12)
        picked = rng.sample(notes, k)
        rows.append({"instruction": "Extract every contact record from these notes, one per line.",
                     "input": "\n".join(n["input"] for n in picked),
                     "output": "\n".join(n["output"] for n in picked)})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(w: Workload, work: Path) -> tuple[Path, Path]:
    out = work / f"data-{w.data}-{w.rows}"
    if w.data == "demo":
        train = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()][:w.rows]
        held = [json.loads(line) for line in (DEMO / "heldout.jsonl").read_text().splitlines()][:w.eval_rows]
    else:
        # Held-out rows come from the same generator after the training rows, so they follow the same mix.
        rows = longtail_rows(w.rows + w.eval_rows)
        train, held = rows[:w.rows], rows[w.rows:]
    return _write_jsonl(out / "train.jsonl", train), _write_jsonl(out / "eval.jsonl", held)


def _smollm2_folder(out: Path) -> Path:
    """The bundled GGUF as a fp32 safetensors folder: every peer and shardfit then load the same files the same
    way (the GGUF's dequantisation is not what is being compared)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardfit.models.build import load_tokenizer
    from shardfit.models.source import resolve_model

    if (out / "config.json").is_file():
        return out
    src = resolve_model(SMOLLM2)
    gguf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained (it counts as quantized): copy its dequantised weights into
    # a plain one of the same architecture.
    config = gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    return out


def qwen2_small_folder(out: Path, tokenizer: Any = None) -> Path:
    """A small Qwen2-architecture model (random init, fixed seed) with the SmolLM2 tokenizer (`tokenizer`, or
    the bundled GGUF's)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from shardfit.models.build import load_tokenizer
    from shardfit.models.source import resolve_model

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    (tokenizer or load_tokenizer(resolve_model(SMOLLM2))).save_pretrained(out)
    return out


def prepare(w: Workload, work: Path) -> dict[str, str]:
    """Model folder and data paths of a workload (made once per bench invocation, shared by its workloads)."""
    train, evals = _data(w, work)
    model = _smollm2_folder(work / "smollm2") if w.model == "smollm2" else qwen2_small_folder(work / "qwen2")
    return {"model": str(model), "train": str(train), "eval": str(evals)}


def user_config(w: Workload, paths: dict[str, str], output_dir: str) -> dict[str, Any]:
    """The config a user writes for this workload: only what they would set; everything else stays each tool's
    default (precision, compile, attention, packing, loss chunking, ...)."""
    cfg: dict[str, Any] = {
        "model": paths["model"], "data": paths["train"], "method": w.method,
        "max_seq_len": w.max_seq_len, "micro_batch": w.micro_batch, "grad_accum": w.grad_accum, "lr": w.lr,
        "epochs": w.epochs, "warmup_ratio": 0.05, "seed": 42, "output_dir": output_dir, "resume": "never"}
    if w.method == "lora":
        cfg["lora"] = {"rank": w.lora_rank, "alpha": w.lora_alpha}
    if w.strategy:
        cfg["strategy"] = w.strategy
    if w.precision:
        cfg["precision"] = w.precision
    return cfg


def overrides(cfg: dict[str, Any]) -> list[str]:
    """`key=value` overrides (nested keys dotted) that rebuild `cfg` through shardfit's config loader."""
    out = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out += [f"{k}.{kk}={vv}" for kk, vv in v.items()]
        else:
            out.append(f"{k}={v}")
    return out


def tokenized(cfg: dict[str, Any]) -> tuple[list[Any], list[Any], Any]:
    """Train and held-out examples tokenised by shardfit's data code (the chat template, the prompt masked): every
    peer trains on these same token ids and the shared evaluator scores these same held-out rows."""
    from shardfit.config import load_config
    from shardfit.data.dataset import build_datasets
    from shardfit.models.build import load_tokenizer
    from shardfit.models.source import resolve_model

    full = dict(cfg, eval_data=cfg.get("eval_data"))
    config = load_config(None, overrides({k: v for k, v in full.items() if v is not None}))
    tok = load_tokenizer(resolve_model(config.model))
    train, evals, _ = build_datasets(config, tok)
    return train, evals, tok
