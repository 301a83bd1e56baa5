"""What `compile: auto` and `attn_implementation: auto` become for a run, and how a mixture's experts compute: the
fastest choice measured for the device and the row shape (bench/defaults_probe.py and bench/moe_experts.py; their
bench/results/*.json hold the measurements, docs/training.md the rule in words).

- compile: compiled blocks want one static shape, so a compiled run pads every micro-batch to micro_batch rows of
  max_seq_len, which gives back what packing saved, and the first run of a model pays the compile itself. `auto`
  compiles only where neither cost applies: a GPU, with packing off or with `static_shape` on (packed rows laid
  into one row of micro_batch x max_seq_len tokens: one shape, packing kept).
- attention: with packing the kernel gets a block-diagonal mask, and SDPA's CPU kernel then computes the whole
  masked square. Compiled, the plain matmul-mask-softmax attention (`eager`, fused by inductor) beat it for packed
  rows of 256 tokens (2.8 -> 2.15 s per step); uncompiled in fp32 it did not (0.76x SDPA's speed at 4 x 128
  packed). In bf16 on a CPU with bf16 matrix units, uncompiled, the plain attention's batched matmuls run on those
  units while SDPA's CPU kernel does not gain as much: eager was 1.14-1.17x SDPA's step at 4 x 128 tokens and
  0.93-0.94x at 4 x 256 (bench/results/defaults_probe_bf16.json). So `auto` is `eager` for compiled blocks on CPU
  with packed rows up to EAGER_ATTENTION_MAX_LEN tokens; uncompiled bf16 text models on CPU run eager attention
  for each micro-batch at most EAGER_ATTENTION_BF16_MAX_WIDTH tokens wide and SDPA for wider ones
  (models/attention_by_width.py), which also keeps eager's saved probabilities, quadratic in the width, out of the
  widest steps; transformers' default (SDPA) everywhere else.
"""

from __future__ import annotations

import dataclasses

from shardfit import objective as objectives
from shardfit.config import Config
from shardfit.resolve.pipeline import stages_of

# Longest packed row at which compiled eager attention was measured faster than SDPA on CPU.
EAGER_ATTENTION_MAX_LEN = 256
# Widest micro-batch (tokens per row) that runs uncompiled bf16 eager attention on CPU: between the widths measured
# faster (128) and slower (256) than SDPA.
EAGER_ATTENTION_BF16_MAX_WIDTH = 192


def resolve_compile(value: bool | str, device_type: str, packing: bool, sequence_parallel: int = 1,
                    pipeline_parallel: int = 1, static_shape: bool = False, expert_parallel: int = 1) -> bool:
    """`compile` as a bool: `auto` compiles on GPUs where the micro-batches have one shape at no cost: rows not
    packed (padded to one static shape), or packed into `static_shape` rows (one row of micro_batch x max_seq_len
    tokens: the compiled blocks meet one input shape for the whole run, and packing is kept). Packed rows without
    `static_shape` stay eager, float8 or not: compiled, each micro-batch would be padded to micro_batch x
    max_seq_len tokens (check warns that float8 then runs its casts uncompiled). Not under sequence parallelism
    (its all-to-all attention is not compiled; resolve/sequence.py refuses `true`), in a pipeline's stages (not
    tried yet; resolve/pipeline.py refuses `true`) nor with expert parallelism (its dispatch is not compiled)."""
    if value != "auto":
        return bool(value)
    return device_type == "cuda" and (not packing or static_shape) and sequence_parallel == 1 \
        and pipeline_parallel == 1 and expert_parallel == 1


def compiled_for(cfg: Config, device_type: str) -> bool:
    """`resolve_compile` for `cfg` on `device_type`, its `static_shape` decided first (from the kernel the config
    names: `auto` never becomes one that takes example boundaries, so the resolved kernel decides the same)."""
    static = resolve_static_shape(cfg.static_shape, device_type, cfg.packing, cfg.attn_implementation,
                                  objectives.get(cfg.objective).preference, cfg.sequence_parallel)
    return resolve_compile(cfg.compile, device_type, cfg.packing, cfg.sequence_parallel, stages_of(cfg),
                           static, cfg.expert_parallel)


# Attention kernels that take a packed row's example boundaries from its positions (variable-length flash attention)
# or a block mask (flex attention) instead of computing the whole masked square.
BOUNDARY_KERNELS = ("flash_attention_2", "flash_attention_3", "flex_attention")


def resolve_static_shape(value: bool | str, device_type: str, packing: bool, attention: str,
                         preference: bool = False, sequence_parallel: int = 1) -> bool:
    """`static_shape` as a bool: `auto` is on for a GPU's packed SFT rows with a kernel in BOUNDARY_KERNELS (a
    dense mask over micro_batch x max_seq_len tokens costs micro_batch times the attention of separate rows).
    Preference pairs and sequence-parallel slices keep their own rows whatever the setting (a pair's sides, a
    rank's slice of a row, are laid out by their own rules)."""
    if value != "auto":
        return bool(value) and not preference and sequence_parallel == 1
    return device_type == "cuda" and packing and attention in BOUNDARY_KERNELS and not preference \
        and sequence_parallel == 1


def resolve_attention(value: str, device_type: str, packing: bool, max_seq_len: int, compiled: bool) -> str:
    """`attn_implementation` for the run: `auto` becomes `eager` for compiled blocks on CPU with packed rows of at
    most EAGER_ATTENTION_MAX_LEN tokens; it stays `auto` (transformers' default, SDPA, or the choice per
    micro-batch of `eager_attention_max_width`) otherwise."""
    if value != "auto":
        return value
    if device_type == "cpu" and compiled and packing and max_seq_len <= EAGER_ATTENTION_MAX_LEN:
        return "eager"
    return "auto"


def eager_attention_max_width(value: str, device_type: str, compiled: bool, precision: str) -> int:
    """Under `auto` (as resolve_attention leaves it), the widest micro-batch in tokens per row that runs eager
    attention, wider ones keeping the model's kernel: EAGER_ATTENTION_BF16_MAX_WIDTH for uncompiled bf16 on a CPU,
    0 (one kernel for the whole run) elsewhere."""
    if value == "auto" and device_type == "cpu" and not compiled and precision == "bf16":
        return EAGER_ATTENTION_BF16_MAX_WIDTH
    return 0


# What a new input shape costs under SDPA with cuDNN's kernel, fwd and bwd plans together: on an H100 the first
# step at each new row length took 0.09-0.13 s more under SDPA than under eager attention (bench/results/
# gpu_h100.json, defaults_probe_bf16 first_step_s), PyTorch keying its cuDNN attention plans on the exact batch and
# lengths and building one on every miss.
CUDNN_PLAN_S = 0.11
# The share of a run's predicted time that cuDNN's plan builds may take. Below it cuDNN's kernel stays in PyTorch's
# choice: once a shape's plan is built its kernel is the fastest on Hopper for masked attention, which packed rows
# need (memory-efficient attention ran 36-54 % slower on masked H100 shapes, sgl-project/sglang-omni#2067).
CUDNN_PLAN_SHARE = 0.05


def cudnn_attention_allowed(value: str, device_type: str, compiled: bool, *, new_shapes: float = 0.0,
                            run_s: float | None = None) -> bool:
    """Whether SDPA may choose cuDNN's attention kernel. Always on a CPU, for compiled blocks (one static shape:
    one plan) and where `sdpa` is named; for `auto` on a GPU only while the plans of the run's `new_shapes` shapes
    (CUDNN_PLAN_S each) stay within CUDNN_PLAN_SHARE of its predicted `run_s` (None: not known, so not). Flash and
    memory-efficient attention build nothing per shape."""
    if device_type != "cuda" or value != "auto" or compiled:
        return True
    return run_s is not None and new_shapes * CUDNN_PLAN_S <= CUDNN_PLAN_SHARE * run_s


# Row widths on CPU under bf16 are rounded up to a multiple of this. oneDNN, which runs bf16 matmuls there, builds
# and caches a kernel per matmul shape (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default, about 0.5 MB each): with a
# new row width every step, a LoRA run on SmolLM2 rose to 1.55 GB resident and paid the kernel builds each step;
# widths in steps of 16 tokens held it at 1.34 GB at the same speed (the padding costs what the reuse saves). Wider
# rows step by an eighth of their power of two (collate): 32 widths up to 1024 instead of 64, and a full fine-tune
# with widths of 96-1024 trained 1.05x faster (fewer kernel builds) at a lower peak. MKL's fp32 matmuls keep no
# such cache, and there the padding only cost time (9 %), so fp32 keeps exact widths.
CPU_BF16_WIDTH_MULTIPLE = 16


def row_width_multiple(device_type: str, precision: str, compiled: bool) -> int:
    """What each micro-batch's row width is rounded up to a multiple of (1: the longest row, as it is)."""
    if device_type == "cpu" and precision == "bf16" and not compiled:
        return CPU_BF16_WIDTH_MULTIPLE
    return 1


# How a mixture's routed experts compute (transformers' `experts_implementation`), by device. bench/moe_experts.py
# trained two-block Qwen3-MoE (32 experts, top-8) and gpt-oss (32, top-4) layouts one step, LoRA and full, at 128,
# 512 and 2048 tokens on a 2-core EPYC in fp32, one thread (bench/results/moe_experts.json): grouped_mm was the
# fastest in 11 of 12 cases (eager's loop over the experts 1.25-6.2x its time; at 2048 tokens of gpt-oss LoRA a tie,
# 0.98x), batched_mm's per-token weight copies 3.7-30x slower and gigabytes, with the same loss and gradients to
# 1e-6. On a GPU grouped_mm is torch's grouped kernel (bf16 on compute capability 8+; other dtypes run PyTorch's own
# per-expert loop), which transformers also defaults to; not measured here (no GPU).
# Where a model cannot take grouped_mm, transformers keeps eager (models/experts.py `use_experts`).
EXPERTS_BY_DEVICE = {"cpu": "grouped_mm", "cuda": "grouped_mm"}


def resolve_experts(device_type: str) -> str:
    """The experts implementation a run on `device_type` sets on a mixture-of-experts model."""
    return EXPERTS_BY_DEVICE.get(device_type, "grouped_mm")


def resolve_speed_settings(cfg: Config, device_type: str) -> Config:
    """`cfg` with `compile` and `attn_implementation` resolved for `device_type` (what config.yaml records)."""
    compiled = compiled_for(cfg, device_type)
    return dataclasses.replace(cfg, compile=compiled, attn_implementation=resolve_attention(
        cfg.attn_implementation, device_type, cfg.packing, cfg.max_seq_len, compiled))
