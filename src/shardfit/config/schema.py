"""The config schema (CONTRACTS.md section 7) as dataclasses, with the allowed values of each choice key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

METHODS = ("lora", "qlora", "full", "freeze")
STRATEGIES = ("auto", "single", "ddp", "zero2", "zero3", "zero3_offload", "model_parallel")
PRECISIONS = ("bf16", "fp16", "fp32")
GRAD_CKPT = ("none", "full", "selective")
BACKENDS = ("fsdp2",)
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")


@dataclass
class LoraSettings:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    targets: str | list[str] = "all-linear"


@dataclass
class Config:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    data: str | list[str] = "data/train.jsonl"
    eval_data: str | list[str] | None = None
    eval_split: float = 0.0
    method: str = "lora"
    lora: LoraSettings = field(default_factory=LoraSettings)
    freeze_trainable: list[str] = field(default_factory=list)
    strategy: str = "auto"
    backend: str = "fsdp2"
    precision: str = "bf16"
    max_seq_len: int = 1024
    packing: bool = True
    micro_batch: int = 4
    grad_accum: int = 1
    lr: float = 2.0e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1
    max_steps: int | None = None
    grad_ckpt: str = "none"
    compile: bool = False
    attn_implementation: str = "auto"
    loss_chunk: int = 1024
    save_steps: int = 200
    save_limit: int = 3
    eval_steps: int = 200
    log_steps: int = 10
    seed: int = 42
    output_dir: str = "runs/demo"
    resume: str = "auto"
    drop_modules: list[str] = field(default_factory=list)
    freeze_modules: list[str] = field(default_factory=list)
    device_map: str | dict | None = None
    strict: bool = False
    force: bool = False
    skip_bad_rows: bool = False
    trust_remote_code: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, as written to `config.yaml` in the run directory."""
        return asdict(self)


# Keys whose value must be one of a fixed set; validated in load.py with a "did you mean".
CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "strategy": STRATEGIES,
    "precision": PRECISIONS,
    "grad_ckpt": GRAD_CKPT,
    "backend": BACKENDS,
    "attn_implementation": ATTENTION,
}
