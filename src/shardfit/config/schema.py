"""The config schema as dataclasses: every key, its type, its default and what it means (the `help` metadata is
what docs/reference.md shows), with the allowed values of each choice key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardfit import strategy

METHODS = ("lora", "qlora", "full", "freeze")
PRECISIONS = ("bf16", "fp16", "fp32", "auto")
GRAD_CKPT = ("none", "full", "selective")
BACKENDS = ("fsdp2",)
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
REPORT_TO = ("auto", "none", "tensorboard", "wandb", "mlflow")


def key(default: Any, help: str, **kw: Any) -> Any:
    """A config key: its default and the sentence docs/reference.md shows for it."""
    if callable(default) and not isinstance(default, (str, int, float, bool)):
        return field(default_factory=default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class LoraSettings:
    rank: int = key(8, "rank r of the low-rank update")
    alpha: int = key(16, "scale numerator: the update is multiplied by alpha / rank")
    dropout: float = key(0.0, "dropout on the adapter's input")
    targets: str | list[str] = key("all-linear", "modules that get adapters: all-linear (every linear layer of the "
                                                 "decoder blocks, not the output head) or a list of module names")


@dataclass
class Config:
    model: str = key("HuggingFaceTB/SmolLM2-135M-Instruct",
                     "a local Hugging Face folder, a .gguf file, or a hub id (catalog ids plan without weights)")
    data: str | list[str] = key("data/train.jsonl", "training data: one .json/.jsonl path or a list; alpaca, ShareGPT "
                                                    "or OpenAI messages, detected per file")
    eval_data: str | list[str] | None = key(None, "held-out data (same formats); null splits eval_split off data")
    eval_split: float = key(0.0, "fraction of data held out for evaluation when eval_data is null")
    method: str = key("lora", "lora | qlora | full | freeze (freeze: only freeze_trainable modules train)")
    lora: LoraSettings = key(LoraSettings, "LoRA settings (method lora or qlora)")
    freeze_trainable: list[str] = key(list, "method freeze: module name patterns that train, e.g. ['layers.11']")
    strategy: str = key("auto", "auto (the planner's fastest that fits) or a row of the strategy table")
    backend: str = key("fsdp2", "engine of the sharded strategies")
    precision: str = key("bf16", "bf16 | fp16 | fp32 | auto: the compute precision (mixed precision, fp32 trainables); "
                                 "auto: bf16 where the device computes it fast (GPUs with bf16, CPUs with bf16 "
                                 "units), else fp16 on GPUs and fp32 on CPUs")
    max_seq_len: int = key(1024, "tokens per row; longer examples are truncated")
    packing: bool = key(True, "several examples per row, attention kept within each example")
    micro_batch: int = key(4, "rows per rank per forward pass")
    grad_accum: int = key(1, "micro-batches per optimizer step")
    lr: float = key(2.0e-4, "peak learning rate (AdamW)")
    warmup_ratio: float = key(0.03, "fraction of the steps with a linear warmup before the cosine decay")
    weight_decay: float = key(0.0, "AdamW weight decay")
    max_grad_norm: float = key(1.0, "gradient clipping norm")
    epochs: int = key(1, "passes over the training rows")
    max_steps: int | None = key(None, "optimizer steps; overrides epochs when set")
    grad_ckpt: str = key("none", "activation checkpointing of every decoder block: none | full | selective")
    compile: bool = key(False, "torch.compile each decoder block (needs a C++ compiler on CPU)")
    attn_implementation: str = key("auto", "attention kernel: auto (transformers' default, SDPA) | sdpa | eager | "
                                           "flash_attention_2 | flex_attention")
    loss_chunk: int = key(1024, "rows of logits the chunked loss materialises at once")
    save_steps: int = key(200, "steps between resumable checkpoints")
    save_limit: int = key(3, "checkpoints kept (the newest ones)")
    eval_steps: int = key(200, "steps between evaluations (and one at the end)")
    eval_metrics: list[str] = key(list, "generation metrics computed at every evaluation on eval_samples held-out "
                                        "prompts: exact | contains | regex:PATTERN | py:FILE:FUNC (as `shardfit "
                                        "eval --metric`); [] computes the loss only")
    eval_samples: int = key(16, "held-out examples generated for eval_metrics at each evaluation")
    eval_max_new_tokens: int = key(64, "longest answer generated for eval_metrics")
    log_steps: int = key(10, "steps between lines of metrics.jsonl")
    report_to: list[str] = key(lambda: ["auto"], "where metrics go besides metrics.jsonl: auto (TensorBoard when "
                                                 "installed) | none | tensorboard | wandb | mlflow, or a list")
    run_name: str | None = key(None, "the run's name in TensorBoard, W&B and MLflow (default: output_dir's name)")
    seed: int = key(42, "seed of the data order, the eval split and the initialisation of adapters")
    output_dir: str = key("runs/demo", "the run directory")
    resume: str = key("auto", "auto (the newest checkpoint in output_dir) | never | a checkpoint path")
    drop_modules: list[str] = key(list, "submodules removed before placement (e.g. talker, token2wav)")
    freeze_modules: list[str] = key(list, "submodules whose parameters never train (e.g. a vision tower)")
    device_map: str | dict | None = key(None, "model_parallel only: a dict places modules yourself, a string uses "
                                              "shardfit's balanced map; ignored (with a warning) by every other "
                                              "strategy")
    strict: bool = key(False, "turn what shardfit would override (device_map, ...) into errors")
    force: bool = key(False, "start even when the plan predicts out-of-memory")
    skip_bad_rows: bool = key(False, "skip and count data rows that do not fit their format instead of stopping")
    trust_remote_code: bool = key(False, "allow the model folder's own Python code")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, as written to `config.yaml` in the run directory."""
        return asdict(self)


# Keys whose value must be one of a fixed set; validated in load.py with a "did you mean".
CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "strategy": strategy.CHOICES,
    "precision": PRECISIONS,
    "grad_ckpt": GRAD_CKPT,
    "backend": BACKENDS,
    "attn_implementation": ATTENTION,
}
