"""Eager attention's L x L scores by op chain: which chain a model runs (`score_chain`), what its score-sized
tensors hold in memory (saved for backward, and the peaks above those in the forward, the backward and a forward
without gradients), and the ops on them the host launches.

transformers' eager attention materialises every head's scores over the whole row (a window or chunk is a dense
mask under eager), and the op chains differ in what they keep: Llama's eager_attention_forward softmaxes in fp32
and casts back (the fp32 softmax output and its 16-bit cast are saved); Gemma 2's softcapping adds a tanh, which
keeps its output; GPT-2 softmaxes in the scores' dtype (its output alone is saved where that is the values'
dtype); GPT-J's `_attn` upcasts q and k (fp32 scores from QK^T on, then Llama's softmax and cast); BLOOM's baddbmm
adds ALiBi inside the matmul (Llama's chain after it); gpt-oss's sinks join a column per row and softmax in the
scores' dtype. The scores' dtype follows the additive mask's where that is wider (an fp32 mask over 16-bit scores:
fp32 master weights under autocast). Attention dropout (ATen's native_dropout on a GPU) keeps a 1-byte bool mask
and the dropped probabilities beside the softmax's output.

Measured by bench/eager_attention_memory.py on one real tiny decoder layer of each chain's family (transformers
5.23, torch 2.13, CPU; dropout run as CUDA's native_dropout), solved per head and score over six shapes and exact
on a held-out one (bench/results/eager_attention_memory.json). Checkpointed layers, full or selective, keep none
of the scores (shardfit's selective policy keeps mm/addmm and the SDPA/flash kernels' outputs only), so only the
one block alive at a time holds them: the recomputed block under checkpointing, and on top of every block's
saved set without it."""

from __future__ import annotations

from shardfit.plan.precision import compute_bytes, residual_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

LLAMA_CHAIN, SINKS_CHAIN, SOFTCAP_CHAIN, PLAIN_CHAIN, FP32_QK_CHAIN, ALIBI_CHAIN = (
    "llama", "sinks", "softcap", "plain", "fp32_qk", "alibi")
# The families whose class runs its own chain, by model_type; any other runs Llama's. Gemma 2's softcapping follows
# the config's attn_logit_softcapping (`ModelShape.attn_softcap`, read for the families whose class applies it:
# plan/config_shape.py SOFTCAP_TYPES; Gemma 3's class ignores the key).
SCORE_CHAIN_TYPES = {"gpt2": PLAIN_CHAIN, "gptj": FP32_QK_CHAIN, "codegen": FP32_QK_CHAIN,
                     "gpt_neo": FP32_QK_CHAIN, "bloom": ALIBI_CHAIN}


def score_chain(shape: ModelShape) -> str:
    """The op chain `shape`'s eager attention runs on its scores: gpt-oss's sinks; softcapping wherever the config
    sets attn_logit_softcapping (a Gemma 2 config with it null runs Llama's chain); else by the family's
    model_type (SCORE_CHAIN_TYPES; a composite's by its text model's type, whose class runs the decoder)."""
    if shape.attention_sinks:
        return SINKS_CHAIN
    if shape.attn_softcap:
        return SOFTCAP_CHAIN
    return SCORE_CHAIN_TYPES.get(shape.text_model_type or shape.model_type, LLAMA_CHAIN)


# Bytes per head and score of the score-sized tensors, keyed by (chain, precision kind, attention dropout on):
# (saved for backward, forward peak, backward peak, peak of a forward without gradients), each peak counting every
# score-sized tensor of the block alive at once (its saved ones included). Kinds (`score_kind`): bf16 (16-bit
# weights; fp16 counted alike), fp32, amp (fp32 weights under 16-bit autocast: an fp32 mask over 16-bit scores).
# The mask itself, built once per forward, is held_mask_bytes' (plan/activations.py).
EAGER_SCORE_MEMORY: dict[tuple[str, str, bool], tuple[float, float, float, float]] = {
    (LLAMA_CHAIN, "bf16", False): (6, 10, 12, 10), (LLAMA_CHAIN, "bf16", True): (7, 10, 12, 10),
    (LLAMA_CHAIN, "fp32", False): (4, 8, 12, 8), (LLAMA_CHAIN, "fp32", True): (9, 9, 13, 9),
    (LLAMA_CHAIN, "amp", False): (6, 8, 12, 8), (LLAMA_CHAIN, "amp", True): (7, 11, 13, 9),
    (SOFTCAP_CHAIN, "bf16", False): (8, 12, 14, 10), (SOFTCAP_CHAIN, "bf16", True): (9, 12, 14, 10),
    (SOFTCAP_CHAIN, "fp32", False): (8, 12, 16, 8), (SOFTCAP_CHAIN, "fp32", True): (13, 13, 17, 9),
    (SOFTCAP_CHAIN, "amp", False): (8, 10, 14, 8), (SOFTCAP_CHAIN, "amp", True): (9, 13, 15, 9),
    (PLAIN_CHAIN, "bf16", False): (2, 4, 6, 4), (PLAIN_CHAIN, "bf16", True): (5, 5, 7, 5),
    (PLAIN_CHAIN, "fp32", False): (4, 8, 12, 8), (PLAIN_CHAIN, "fp32", True): (9, 9, 13, 9),
    (PLAIN_CHAIN, "amp", False): (6, 8, 12, 8), (PLAIN_CHAIN, "amp", True): (7, 9, 12, 8),
    (FP32_QK_CHAIN, "bf16", False): (6, 8, 12, 8), (FP32_QK_CHAIN, "bf16", True): (7, 9, 12, 8),
    (FP32_QK_CHAIN, "fp32", False): (4, 8, 12, 8), (FP32_QK_CHAIN, "fp32", True): (9, 9, 13, 9),
    (FP32_QK_CHAIN, "amp", False): (6, 8, 12, 8), (FP32_QK_CHAIN, "amp", True): (7, 9, 12, 8),
    (ALIBI_CHAIN, "bf16", False): (6, 12, 12, 12), (ALIBI_CHAIN, "bf16", True): (7, 13, 12, 12),
    (ALIBI_CHAIN, "fp32", False): (4, 12, 12, 12), (ALIBI_CHAIN, "fp32", True): (9, 17, 13, 17),
    (ALIBI_CHAIN, "amp", False): (6, 12, 12, 12), (ALIBI_CHAIN, "amp", True): (7, 15, 12, 12),
    (SINKS_CHAIN, "bf16", False): (2, 6, 6, 6), (SINKS_CHAIN, "bf16", True): (5, 9, 7, 9),
    (SINKS_CHAIN, "fp32", False): (4, 12, 12, 12), (SINKS_CHAIN, "fp32", True): (9, 17, 13, 17),
    (SINKS_CHAIN, "amp", False): (6, 12, 12, 12), (SINKS_CHAIN, "amp", True): (7, 17, 13, 17),
}
# The aten ops of one decoder layer that read or write a score-sized tensor, as (forward kernels, forward views,
# backward kernels, backward views), keyed as EAGER_SCORE_MEMORY; counted by the same script (two layers less one).
EAGER_SCORE_OPS: dict[tuple[str, str, bool], tuple[int, int, int, int]] = {
    (LLAMA_CHAIN, "bf16", False): (8, 3, 8, 4), (LLAMA_CHAIN, "bf16", True): (9, 3, 9, 4),
    (LLAMA_CHAIN, "fp32", False): (6, 3, 6, 4), (LLAMA_CHAIN, "fp32", True): (7, 3, 7, 4),
    (LLAMA_CHAIN, "amp", False): (7, 3, 8, 4), (LLAMA_CHAIN, "amp", True): (8, 3, 9, 4),
    (SOFTCAP_CHAIN, "bf16", False): (11, 4, 11, 5), (SOFTCAP_CHAIN, "bf16", True): (12, 4, 12, 5),
    (SOFTCAP_CHAIN, "fp32", False): (9, 4, 9, 5), (SOFTCAP_CHAIN, "fp32", True): (10, 4, 10, 5),
    (SOFTCAP_CHAIN, "amp", False): (10, 4, 11, 5), (SOFTCAP_CHAIN, "amp", True): (11, 4, 12, 5),
    (PLAIN_CHAIN, "bf16", False): (6, 3, 6, 4), (PLAIN_CHAIN, "bf16", True): (7, 3, 7, 4),
    (PLAIN_CHAIN, "fp32", False): (6, 3, 6, 4), (PLAIN_CHAIN, "fp32", True): (7, 3, 7, 4),
    (PLAIN_CHAIN, "amp", False): (7, 3, 8, 4), (PLAIN_CHAIN, "amp", True): (8, 3, 9, 4),
    (FP32_QK_CHAIN, "bf16", False): (7, 3, 7, 4), (FP32_QK_CHAIN, "bf16", True): (8, 3, 8, 4),
    (FP32_QK_CHAIN, "fp32", False): (6, 3, 6, 4), (FP32_QK_CHAIN, "fp32", True): (7, 3, 7, 4),
    (FP32_QK_CHAIN, "amp", False): (7, 3, 8, 4), (FP32_QK_CHAIN, "amp", True): (8, 3, 9, 4),
    (ALIBI_CHAIN, "bf16", False): (6, 3, 7, 4), (ALIBI_CHAIN, "bf16", True): (7, 3, 8, 4),
    (ALIBI_CHAIN, "fp32", False): (4, 3, 5, 4), (ALIBI_CHAIN, "fp32", True): (5, 3, 6, 4),
    (ALIBI_CHAIN, "amp", False): (5, 3, 7, 4), (ALIBI_CHAIN, "amp", True): (6, 3, 8, 4),
    (SINKS_CHAIN, "bf16", False): (9, 4, 12, 6), (SINKS_CHAIN, "bf16", True): (10, 4, 13, 6),
    (SINKS_CHAIN, "fp32", False): (9, 4, 12, 6), (SINKS_CHAIN, "fp32", True): (10, 4, 13, 6),
    (SINKS_CHAIN, "amp", False): (10, 4, 14, 6), (SINKS_CHAIN, "amp", True): (11, 4, 15, 6),
}


def score_kind(w: Workload, strategy: str) -> str:
    """The precision kind the tables are keyed by: fp32 (4-byte compute), amp (16-bit compute over an fp32
    residual stream, whose mask is fp32: fp32 master weights, or QLoRA's fp32 stream, under autocast), bf16."""
    if compute_bytes(w) == 4:
        return "fp32"
    return "amp" if residual_bytes(w, strategy) == 4 else "bf16"


def _memory(shape: ModelShape, w: Workload, strategy: str) -> tuple[float, float, float, float]:
    return EAGER_SCORE_MEMORY[(score_chain(shape), score_kind(w, strategy), shape.attn_dropout > 0)]


def softmax_blocks(shape: ModelShape) -> int:
    """The blocks that attend with softmax over the sequence: all but Gated DeltaNet blocks and blocks whose Mamba
    mixer is their only token mixer; a `single_part` model's attention parts (Nemotron-H's) and uses of its shared
    transformer block (Zamba's)."""
    if shape.single_part:
        return shape.attention_layers + shape.shared_uses
    return shape.layers - shape.linear_layers - (0 if shape.mamba_parallel else shape.mamba_mixers)


def attends(shape: ModelShape) -> bool:
    """Whether some block attends with softmax (`softmax_blocks`), so that the block alive at a time can be one
    that holds scores."""
    return softmax_blocks(shape) > 0


def eager_saved_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """The score-sized tensors one block's eager attention saves for backward, per token: every head's row of
    `row_len` scores at the chain's saved bytes; gpt-oss's sink column besides, in the softmax's dtype (the residual
    stream's, which its additive mask sets)."""
    saved = shape.heads * w.row_len * _memory(shape, w, strategy)[0]
    if shape.attention_sinks:
        saved += shape.heads * residual_bytes(w, strategy)
    return saved


def eager_peak_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What the one block alive at a time holds of its scores above its saved ones, per token: the larger of the
    forward's and the backward's peak (the backward's scores' gradients, their fp32 upcasts and the softmax's
    gradient beside the saved tensors) less the saved bytes; 0 but under eager attention, and under torch.compile
    (inductor fuses the chain into one kernel each way, whose buffers these counts are not), and for a model
    without softmax-attention blocks (`attends`). gpt-oss's sink column (1/L of it) is left out."""
    if w.attention != "eager" or w.compile or not attends(shape):
        return 0.0
    saved, forward, backward, _ = _memory(shape, w, strategy)
    return shape.heads * w.row_len * (max(forward, backward) - saved)


def eager_no_grad_bytes_per_token(shape: ModelShape, w: Workload, strategy: str) -> float:
    """What a forward without gradients (a reference model's) holds of its scores at its peak, above the saved
    bytes the block's activation count gives it, per token; 0 where `eager_peak_bytes_per_token` is."""
    if w.attention != "eager" or w.compile or not attends(shape):
        return 0.0
    saved, _, _, no_grad = _memory(shape, w, strategy)
    return shape.heads * w.row_len * (no_grad - saved)


def eager_score_ops(shape: ModelShape, w: Workload, strategy: str) -> tuple[int, int, int, int]:
    """(forward kernels, forward views, backward kernels, backward views) of one block's ops on its scores."""
    return EAGER_SCORE_OPS[(score_chain(shape), score_kind(w, strategy), shape.attn_dropout > 0)]
