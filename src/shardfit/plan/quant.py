"""The layout of QLoRA's 4-bit (NF4) weights, as torchao's NF4Tensor stores them: what they take in memory, what
their dequantization allocates, and how they split across ranks. Torch-free: the planner sizes it, and
models/quantize.py builds the tensors with exactly these block sizes.

An NF4 weight of n elements is 4-bit codes, two per byte (n/2 bytes), one int8 scale per block of BLOCK elements
(double quantization: the block scales are themselves quantized to 8 bits), one scale factor in the dequantized
dtype per `scaler_block_size` block scales, plus a scalar mean and the 16-value code book.
"""

from __future__ import annotations

BLOCK = 64  # elements per absmax block (the QLoRA paper's and every tool's default)
MAX_SCALER_BLOCK = 256  # block scales per second-level scale factor (the QLoRA paper's)
# The block scales are grouped so that a weight still splits into this many equal row shards (FSDP2 shards dim 0,
# and torchao splits the codes, scales and factors of an NF4 weight alike): up to 8 ranks whatever the width.
SHARD_GROUPS = 8
CODEBOOK = 16


def quantizable(rows: int, cols: int) -> bool:
    """Whether a weight can be stored in NF4 (whole blocks); one that cannot stays in the compute dtype."""
    return (rows * cols) % BLOCK == 0


def scaler_block_size(numel: int) -> int:
    """Block scales per second-level factor: 256 where the weight still splits into SHARD_GROUPS shards of whole
    factor groups (every weight of the usual widths), else the largest power of two that does, else the largest
    that divides the block count (SmolLM2's 192x576 k_proj has 1,728 blocks: groups of 8)."""
    n_blocks = numel // BLOCK
    for size in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if n_blocks % (size * SHARD_GROUPS) == 0:
            return size
    for size in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if n_blocks % size == 0:
            return size
    return 1


def nf4_bytes(rows: int, cols: int, dtype_bytes: int) -> int:
    """Bytes an NF4 weight of rows x cols keeps: codes, int8 block scales, factors, mean and code book (the last
    two in the dequantized dtype)."""
    n = rows * cols
    n_blocks = n // BLOCK
    return n // 2 + n_blocks + (n_blocks // scaler_block_size(n)) * dtype_bytes + dtype_bytes + CODEBOOK * dtype_bytes


def nf4_single_bytes(rows: int, cols: int) -> int:
    """Bytes of an NF4 weight without double quantization, as bitsandbytes' quantize_4bit stores it with
    compress_statistics=False (bitsandbytes/functional.py, 0.42.0): 4-bit codes, two per byte, and one fp32 absmax
    per block of BLOCK elements."""
    n = rows * cols
    return (n + 1) // 2 + -(-n // BLOCK) * 4


def weight_bytes(rows: int, cols: int, dtype_bytes: int, double_quant: bool = True) -> int:
    """What a frozen weight of a decoder block's linear layer takes under QLoRA: NF4 where it can be (with
    double-quantized block scales, or fp32 ones), else dense."""
    if not quantizable(rows, cols):
        return rows * cols * dtype_bytes
    return nf4_bytes(rows, cols, dtype_bytes) if double_quant else nf4_single_bytes(rows, cols)


def dequantize_peak_bytes(numel: int, dtype_bytes: int) -> int:
    """The most torchao's dequantization of one NF4 weight holds at once (NF4Tensor.get_original_weight): both
    nibbles of every byte as int64 indices (8 bytes per pair of elements each), their code-book values, the
    scaled values and their interleaved result (the weight in `dtype_bytes`), and the block scales expanded to one
    per element for the half being scaled."""
    half = numel // 2
    indices = 2 * half * 8
    values = 2 * half * dtype_bytes  # code-book values of both halves
    scaled = 2 * half * dtype_bytes
    result = numel * dtype_bytes
    # The interleaving stack runs after both halves are scaled; the scale expansion (half the elements) while the
    # second half is scaled, when the result does not exist yet: the stack is the larger moment.
    return indices + values + scaled + max(result, half * dtype_bytes)


# The most elements of an NF4 expert stack dequantized at once (models/quantize_experts.py): its transients, about
# seven times the slice's values (`dequantize_peak_bytes`), stay under a gigabyte in 16 bits, in a handful of slices
# for the stacks of today's mixtures (Qwen3-30B-A3B's gate/up: 8 slices of 16 experts).
SLICE_ELEMENTS = 1 << 26


def experts_per_slice(shape: tuple[int, ...], scaler_block: int) -> int:
    """Experts of a stack of `shape` ([experts, rows, cols]) dequantized together: the most, up to SLICE_ELEMENTS
    elements (the fewest where one expert is larger), in slices that split its codes, block scales and factors
    evenly (torchao splits an NF4 weight only into equal row chunks of whole factor groups: BLOCK x `scaler_block`
    elements); all of them where no smaller slice does."""
    experts, rows, cols = shape
    group = BLOCK * scaler_block
    even = [per for per in range(1, experts + 1) if experts % per == 0 and (per * rows * cols) % group == 0]
    under = [per for per in even if per * rows * cols <= SLICE_ELEMENTS]
    return max(under) if under else min(even, default=experts)


def stack_dequantize_peak_bytes(shape: tuple[int, ...], dtype_bytes: int) -> int:
    """The most dequantizing a whole NF4 expert stack holds at once: its result, and the last slice's transients
    beside it (`experts_per_slice`; a stack in one slice holds `dequantize_peak_bytes`)."""
    experts, rows, cols = shape
    numel = experts * rows * cols
    per = experts_per_slice(shape, scaler_block_size(numel))
    if per >= experts:
        return dequantize_peak_bytes(numel, dtype_bytes)
    return numel * dtype_bytes + dequantize_peak_bytes(per * rows * cols, dtype_bytes)


def shard_problem(rows: int, cols: int, world: int) -> str | None:
    """Why an NF4 weight of rows x cols cannot be split into `world` equal row shards (FSDP2's dim-0 sharding, which
    torchao's NF4 supports only along whole factor groups), or None when it can."""
    if world <= 1 or not quantizable(rows, cols):
        return None
    n = rows * cols
    group = BLOCK * scaler_block_size(n)
    if rows % world:
        return f"its {rows} rows do not divide into {world} shards"
    if (n // world) % group:
        return f"its shards of {n // world} elements do not hold whole groups of {group} (4-bit blocks x scales)"
    return None
