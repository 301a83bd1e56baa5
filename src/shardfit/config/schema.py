"""The config schema as dataclasses: every key, its type, its default and what it means (the `help` metadata is
what docs/reference.md shows), with the allowed values of each choice key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from shardfit import method, objective, strategy

METHODS = method.NAMES
PRECISIONS = ("bf16", "fp16", "fp32", "auto")
GRAD_CKPT = ("none", "full", "selective")
BACKENDS = ("fsdp2",)
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
QUANT_TYPES = ("nf4",)
COMPUTE_DTYPES = ("auto", "bf16", "fp16", "fp32")
ADAPTER_DTYPES = ("fp32", "bf16")
WATCHDOG_ACTIONS = ("wait", "abort")
REPORT_TO = ("auto", "none", "tensorboard", "wandb", "mlflow")
# The fields of the data formats (data/formats.py) that `data_columns` may find under another column name.
COLUMN_FIELDS = ("instruction", "input", "output", "system", "history", "conversations", "messages")


def key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, lt: float | None = None,
        nonempty: bool = False) -> Any:
    """A config key: its default, the sentence docs/reference.md shows for it, and the range its value must lie in
    (`ge`/`gt`/`lt` for numbers; `nonempty` for strings and lists). config/load.py checks every declared range, and
    that every float is finite, so a new key is validated by being declared."""
    meta = {"help": help, "ge": ge, "gt": gt, "lt": lt, "nonempty": nonempty}
    if callable(default) and not isinstance(default, (str, int, float, bool)):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LoraSettings:
    rank: int = key(8, "rank r of the low-rank update", ge=1)
    alpha: int = key(16, "scale numerator: the update is multiplied by alpha / rank", gt=0)
    dropout: float = key(0.0, "dropout on the adapter's input; a mixture's routed experts take none (peft), so "
                              "there it needs lora.experts false", ge=0, lt=1)
    targets: str | list[str] = key("all-linear", "modules that get adapters: all-linear (every linear layer of the "
                                                 "decoder blocks, not the output head) or a list of module names",
                                       nonempty=True)
    experts: bool = key(True, "a mixture of experts: adapters on the routed experts too (peft target_parameters on "
                              "their fused weights, a rank per expert); false: attention and shared experts only. "
                              "The router never gets one")
    dtype: str = key("fp32", "the dtype the adapters are stored and computed in. fp32: under "
                             "torch.autocast, which casts them to the precision at every use; bf16 (precision "
                             "bf16 only): no autocast, fewer cast kernels per layer, and the optimizer keeps fp32 "
                             "master copies of them (docs/training.md). Under zero2/zero3 FSDP2 already computes "
                             "them in bf16 from fp32 shards")


@dataclass
class QLoraSettings:
    quant_type: str = key("nf4", "4-bit data type of the frozen weights: nf4 (NormalFloat4, QLoRA's)")
    double_quant: bool = key(True, "quantize the per-block scales to 8 bits too (0.127 bit per weight instead of "
                                   "0.5); torchao's NF4 always does, so only true is accepted")
    compute_dtype: str = key("auto", "dtype the 4-bit weights dequantize to for each matmul: auto (the run's "
                                     "precision) | bf16 | fp16 | fp32")


@dataclass
class DpoSettings:
    beta: float = key(0.1, "strength of the preference term: DPO/KTO's beta (the KL penalty's inverse), ORPO's "
                           "lambda, SimPO's reward scale (SimPO's paper uses about 2)", gt=0)
    loss: str = key("sigmoid", "objective dpo: sigmoid (DPO's) | ipo | hinge | robust (label noise, with "
                               "label_smoothing)")
    label_smoothing: float = key(0.0, "dpo sigmoid/robust and simpo: the assumed share of pairs whose labels are "
                                      "flipped", ge=0, lt=0.5)
    precompute_reference: bool | str = key("auto", "dpo and kto: compute the reference model's log-probabilities "
                                                   "once before the first step (true), or each step with the "
                                                   "adapters switched off (false; lora and qlora only); auto: "
                                                   "false for lora/qlora, true for full/freeze. Neither keeps a "
                                                   "second copy of the weights")
    simpo_gamma: float = key(0.5, "objective simpo: the target margin between chosen and rejected rewards", ge=0)
    desirable_weight: float = key(1.0, "objective kto: weight of the desirable rows' loss", gt=0)
    undesirable_weight: float = key(1.0, "objective kto: weight of the undesirable rows' loss", gt=0)


@dataclass
class Config:
    model: str = key("HuggingFaceTB/SmolLM2-135M-Instruct",
                     "a local Hugging Face folder, a .gguf file, or a hub id (catalog ids plan without weights)",
                     nonempty=True)
    data: str | list[str] = key("data/train.jsonl", "training data: one .json/.jsonl path or a list; alpaca, ShareGPT "
                                                    "or OpenAI messages, detected per file", nonempty=True)
    eval_data: str | list[str] | None = key(None, "held-out data (same formats); null splits eval_split off data")
    data_columns: dict[str, str] = key(dict, "where the format's fields are in rows that name them otherwise, as "
                                             "{field: column} for every data file: fields instruction, input, "
                                             "output, system, history (alpaca), conversations (ShareGPT), messages "
                                             "(OpenAI); e.g. {input: review, output: label} (LLaMA-Factory's "
                                             "dataset_info.json columns, carried by convert)")
    eval_split: float = key(0.0, "fraction of data held out for evaluation when eval_data is null", ge=0, lt=1)
    objective: str = key("sft", "sft | dpo | orpo | simpo | kto: what the run optimises (dpo/orpo/simpo read "
                                "chosen/rejected pairs, kto unpaired rows with a desirable label; docs/preference.md)")
    dpo: DpoSettings = key(DpoSettings, "preference objectives: beta, the DPO loss and the reference")
    method: str = key("lora", "lora | qlora | full | freeze (freeze: only freeze_trainable modules train)")
    lora: LoraSettings = key(LoraSettings, "LoRA settings (method lora or qlora)")
    qlora: QLoraSettings = key(QLoraSettings, "method qlora: how the frozen decoder weights are stored in 4 bits "
                                              "(torchao NF4, sharded by zero3)")
    freeze_trainable: list[str] = key(list, "method freeze: module name patterns that train, e.g. ['layers.11']")
    strategy: str = key("auto", "auto (the planner's fastest that fits) or a row of the strategy table")
    backend: str = key("fsdp2", "engine of the sharded strategies")
    precision: str = key("bf16", "bf16 | fp16 | fp32 | auto: the compute precision (mixed precision, fp32 trainables); "
                                 "auto: bf16 where the device computes it fast (GPUs with bf16, CPUs with bf16 "
                                 "units), else fp16 on GPUs and fp32 on CPUs")
    float8: bool = key(False, "FP8 matmuls for the decoder blocks' linear layers (torchao float8 training, dynamic "
                              "per-tensor scales; the head, embeddings, routers and LoRA adapters stay in the "
                              "precision): precision bf16 on a GPU of compute capability 8.9+ (L4, L40S, RTX "
                              "4090/5090, H100, H200, B200); not with qlora or a pipeline. On a CPU it is emulated "
                              "(tests only). Needs torchao (docs/planning.md has the time model)")
    max_seq_len: int = key(1024, "tokens per row; longer examples are truncated", ge=1)
    packing: bool = key(True, "pack each micro-batch's examples into as few rows as fit max_seq_len (attention kept "
                              "within each example) where padding to the longest would be a quarter or more of its "
                              "tokens; the examples per step and the steps stay those of an unpacked run. Models with "
                              "recurrent blocks (Mamba, Gated DeltaNet) train unpacked: their state would run across "
                              "examples")
    data_cache: bool = key(True, "reuse the tokenised data of an earlier run with the same data files, tokenizer and "
                                 "max_seq_len (kept in $XDG_CACHE_HOME/shardfit/data, default ~/.cache); the "
                                 "environment variable SHARDFIT_DATA_CACHE=0 turns it off too")
    micro_batch: int = key(4, "examples per rank per forward pass, with packing on or off (packing puts them in "
                              "fewer rows, taking out padding); one optimizer step takes micro_batch x grad_accum x "
                              "ranks examples (more ranks: more examples per step, fewer steps)", ge=1)
    grad_accum: int = key(1, "micro-batches per optimizer step", ge=1)
    lr: float = key(2.0e-4, "peak learning rate (AdamW)", gt=0)
    warmup_ratio: float = key(0.03, "fraction of the steps with a linear warmup before the cosine decay "
                              "(rounded down; the first warmup step already trains at lr / warmup steps)", ge=0,
                              lt=1)
    weight_decay: float = key(0.0, "AdamW weight decay", ge=0)
    max_grad_norm: float = key(1.0, "gradient clipping norm", gt=0)
    epochs: int = key(1, "passes over the training rows", ge=1)
    max_steps: int | None = key(None, "optimizer steps; overrides epochs when set", ge=1)
    sequence_parallel: int = key(1, "ranks that split every row between them (DeepSpeed-Ulysses: each holds a "
                                    "contiguous 1/N of the row and an all-to-all around attention gives each 1/N "
                                    "of the heads over the whole row); must divide the ranks, the data is split "
                                    "over the rest. Text models with full attention (dense or experts), objective sft; "
                                    "docs/long-context.md",
                                 ge=1)
    pipeline_parallel: int | Literal["auto"] = key(
        "auto", "pipeline stages the decoder blocks are cut into, one per rank group (torch.distributed.pipelining, "
                "1F1B over the step's grad_accum micro-batches; grad_accum must be at least the stages); must divide "
                "the ranks. Dense text models, Qwen2-VL and Qwen2.5-VL, objective sft. auto: none (1), unless "
                "strategy is auto and the plan recommends a pipeline over every strategy (it fits, train runs it "
                "and it is faster): then its stages, 1F1B; docs/pipeline.md", ge=1)
    pipeline_schedule: str = key("1f1b", "the pipeline's schedule: 1f1b (one stage per rank) | interleaved_1f1b "
                                          "(pipeline_stages_per_rank stages per rank, looped: rank r holds stages "
                                          "r, r+N, ...; a smaller bubble for more activations in flight) | "
                                          "zero_bubble (the same stages, each backward split into input- and "
                                          "weight-gradient passes that fill the bubble: torch's interleaved "
                                          "zero bubble); "
                                          "docs/pipeline.md")
    pipeline_stages_per_rank: int = key(2, "stages each rank holds under pipeline_schedule: interleaved_1f1b or "
                                           "zero_bubble (V; "
                                           "the decoder is cut into pipeline_parallel x V stages)", ge=2)
    expert_parallel: int = key(1, "ranks that share each mixture-of-experts block's routed experts (each holds "
                                  "experts/N of them; tokens travel to their experts' ranks and back by "
                                  "all-to-all); must divide the data-parallel ranks and the expert count. "
                                  "Strategy ddp/zero2/zero3 (the experts outside it), full or LoRA without expert "
                                  "adapters; docs/expert-parallel.md",
                               ge=1)
    grad_ckpt: str = key("none", "activation checkpointing of every decoder block: none | full | selective")
    static_shape: bool | str = key("auto", "auto | true | false: every training micro-batch one row of exactly "
                                           "micro_batch x max_seq_len tokens (its examples side by side, padding "
                                           "only at the end), attention kept within each example: one input shape "
                                           "for the whole run. auto: on a GPU with packing and an attention kernel "
                                           "that takes example boundaries (flash_attention_2, flex_attention); "
                                           "other kernels compute the whole masked square of the row. SFT only: "
                                           "preference pairs and sequence parallelism keep their rows")
    compile: bool | str = key("auto", "torch.compile each decoder block: auto | true | false (true needs a C++ "
                                      "compiler on CPU). auto compiles only on a GPU, with packing off or "
                                      "static_shape on (float8 wants it: uncompiled, its casts cost more than FP8 "
                                      "saves), and not with expert_parallel: a compiled run wants one input shape (it "
                                      "pads unpacked micro-batches to one; static_shape packs them into one), and "
                                      "its first run waits for the compile, which did not pay on CPU")
    attn_implementation: str = key("auto", "attention kernel: auto | sdpa | eager | flash_attention_2 | "
                                           "flex_attention. auto: eager for compiled blocks on CPU with packed rows "
                                           "of at most 256 tokens (measured faster than SDPA's masked kernel there) "
                                           "and, uncompiled in bf16 on CPU, for each micro-batch of rows at most 192 "
                                           "tokens wide, else transformers' default (SDPA); on a GPU without compiled "
                                           "blocks, SDPA leaves out cuDNN's kernel when its plans, one per new row "
                                           "shape, would cost over 5% of the run's predicted time")
    loss_chunk: int | Literal["auto"] = key("auto", "rows of logits the chunked loss materialises at once: auto (the "
                                                    "most whose fp32 logits fit 32 MiB, but no fewer than keep the "
                                                    "head's matmul compute-bound on the device: for a 49k vocabulary "
                                                    "128 rows on the bench's CPU, 512 on an H100; at most 1024) or a "
                                                    "number", ge=1)
    save_steps: int = key(200, "steps between resumable checkpoints", ge=1)
    save_limit: int = key(3, "checkpoints kept (the newest ones; the newest is never deleted)", ge=1)
    profile_steps: int = key(0, "optimizer steps to profile with torch.profiler after the process's first (0: none): "
                                "profile/ in the run directory gets each rank's ops by time and a Chrome trace", ge=0)
    eval_steps: int = key(200, "steps between evaluations (and one at the end)", ge=1)
    eval_metrics: list[str] = key(list, "generation metrics computed at every evaluation on eval_samples held-out "
                                        "prompts: exact | contains | regex:PATTERN | py:FILE:FUNC (as `shardfit "
                                        "eval --metric`); [] computes the loss only")
    eval_samples: int = key(16, "held-out examples generated for eval_metrics at each evaluation", ge=1)
    eval_max_new_tokens: int = key(64, "longest answer generated for eval_metrics", ge=1)
    log_steps: int = key(10, "steps between lines of metrics.jsonl", ge=1)
    report_to: list[str] = key(lambda: ["auto"], "where metrics go besides metrics.jsonl: auto (TensorBoard when "
                                                 "installed) | none | tensorboard | wandb | mlflow, or a list")
    run_name: str | None = key(None, "the run's name in TensorBoard, W&B and MLflow (default: output_dir's name)")
    watchdog_factor: float = key(10.0, "the watchdog fires when a step, an evaluation or a checkpoint save runs "
                                       "longer than this many times the median of the last 20 steps (and "
                                       "watchdog_min_s): every rank writes its stacks to output_dir/watchdog/ and "
                                       "rank 0 names the stuck rank; 0 turns it off", ge=0)
    watchdog_min_s: float = key(300.0, "seconds any phase may take before the watchdog fires (covers the first "
                                       "step, long evaluations and saves)", gt=0)
    watchdog_action: str = key("wait", "after a watchdog report: wait (keep waiting for the phase) | abort (stop "
                                       "every rank, exit 1)")
    # torch's generators take a 64-bit seed; the data order seeds each epoch's with seed + epoch.
    seed: int = key(42, "seed of the data order, the eval split and the initialisation of adapters", ge=0,
                    lt=2**63)
    output_dir: str = key("runs/demo", "the run directory", nonempty=True)
    resume: str = key("auto", "auto (the newest intact checkpoint of this run in output_dir) | never (start over in "
                              "output_dir) | a checkpoint path", nonempty=True)
    freeze_vision_tower: bool = key(True, "vision-language models: keep the vision tower's weights frozen (LoRA "
                                          "then adapts the language model only)")
    train_projector: bool = key(False, "vision-language models: train the merger that projects vision features "
                                       "into the language model (in full precision), even with a frozen tower")
    image_max_pixels: int | None = key(None, "images with more pixels are resized down, keeping the aspect ratio "
                                             "(fewer image tokens); null: the model's image processor default",
                                       ge=1)
    image_min_pixels: int | None = key(None, "images with fewer pixels are resized up, keeping the aspect ratio; "
                                             "null: the model's image processor default", ge=1)
    freeze_audio_tower: bool = key(True, "models with an audio tower (Qwen2.5-Omni, Qwen3-Omni): keep its weights "
                                         "frozen (LoRA then leaves it alone)")
    audio_max_seconds: float | None = key(None, "audio clips longer than this are cut to it (fewer audio tokens); "
                                                "null: the feature extractor's window (300 s for Qwen2.5-Omni)",
                                       gt=0)
    video_max_frames: int = key(64, "videos (Qwen2-VL, Qwen2.5-VL) with more frames than this, after sampling, "
                                    "are thinned to this many, evenly over the video", ge=1)
    video_fps: float = key(2.0, "frames per second the model sees: a video file is sampled at this rate; frame "
                                "images are taken to be at it (Qwen2.5-VL places a video's tokens in time by it)",
                           gt=0)
    drop_modules: list[str] = key(list, "submodules removed before placement (e.g. talker, token2wav)")
    freeze_modules: list[str] = key(list, "submodules whose parameters never train (e.g. a vision tower)")
    device_map: str | dict | None = key(None, "model_parallel only: a dict places modules yourself, a string uses "
                                              "shardfit's balanced map; ignored (with a warning) by every other "
                                              "strategy")
    strict: bool = key(False, "turn what shardfit would override (device_map, ...) into errors")
    force: bool = key(False, "start even when the plan predicts out-of-memory")
    skip_bad_rows: bool = key(False, "skip and count data rows that do not fit their format instead of stopping")
    max_bad_rows: float = key(0.05, "the most rows that may be lost: skipped (skip_bad_rows) or dropped for having "
                                    "no answer within max_seq_len; a fraction below 1, or a count from 1; beyond it "
                                    "the run refuses to start", ge=0)
    trust_remote_code: bool = key(False, "allow the model folder's own Python code")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, as written to `config.yaml` in the run directory."""
        return asdict(self)


# Keys whose value must be one of a fixed set; validated in load.py with a "did you mean".
CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "objective": objective.NAMES,
    "dpo.loss": objective.DPO_LOSSES,
    "dpo.precompute_reference": ("auto", True, False),
    "strategy": strategy.CHOICES,
    "precision": PRECISIONS,
    "grad_ckpt": GRAD_CKPT,
    "backend": BACKENDS,
    "attn_implementation": ATTENTION,
    "pipeline_schedule": ("1f1b", "interleaved_1f1b", "zero_bubble"),
    "compile": ("auto", True, False),
    "static_shape": ("auto", True, False),
    "lora.dtype": ADAPTER_DTYPES,
    "qlora.quant_type": QUANT_TYPES,
    "qlora.compute_dtype": COMPUTE_DTYPES,
    "watchdog_action": WATCHDOG_ACTIONS,
}
