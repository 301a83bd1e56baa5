"""The attention kernel a GPU picks where the simulation's CPU would pick another that saves more.

The simulated step runs torch's CPU dispatch on fake tensors. For attention whose values are narrower than its
queries and keys (DeepSeek's latent attention: 192-wide q/k heads, 128-wide v heads) the CPU has no fused kernel
(its flash kernel needs one head width) and falls back to the math path, which upcasts q, k and v to fp32 and keeps
the fp32 scores and probabilities: seq_len x heads x 4 bytes per token more. CUDA runs such attention in its
memory-efficient kernel (it takes a v head width of its own; torch's `check_head_dim_size_mem_efficient`), which
saves q, k, v, the additive mask, the output and a log-sum-exp per head, as the flash kernel does for equal widths.
Within `sdpa_as_on_a_gpu` that kernel runs in the simulation too: its fake-tensor rule and autograd formula are
torch's own, so the step saves what the GPU's kernel saves.

Dropout likewise: ATen's `dropout` runs the fused `native_dropout` on CUDA (0 < p < 1, not in place; its
`is_fused_kernel_acceptable`), which keeps a 1-byte bool mask for backward, where the CPU multiplies by a noise
tensor in the input's dtype and keeps that (2 or 4 bytes an element). Within `dropout_as_on_a_gpu` the simulation
runs the fused op, so eager attention's dropout over the L x L scores keeps what a GPU keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def sdpa_as_on_a_gpu() -> Iterator[None]:
    """Within this scope, scaled-dot-product attention with a v head width of its own runs CUDA's memory-efficient
    kernel; equal widths keep torch's own dispatch."""
    functional = torch.nn.functional
    plain = functional.scaled_dot_product_attention

    def dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor:
        if query.shape[-1] == value.shape[-1] or enable_gqa:
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        return memory_efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)

    functional.scaled_dot_product_attention = dispatch
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = plain


def memory_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                               dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """torch's CUDA path into the memory-efficient kernel: autocast's casts of q, k and v; a boolean mask becomes
    an additive bias in the queries' dtype (torch's `convert_boolean_attn_mask`), broadcast to every head as a view;
    the kernel keeps the bias, its inputs, its output and the log-sum-exp for backward."""
    device = query.device.type
    if torch.is_autocast_enabled(device):  # autocast casts at scaled_dot_product_attention, before the dispatch
        low = torch.get_autocast_dtype(device)
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
            bias.logical_not(), float("-inf"))
    if bias is not None:
        bias = bias.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p,
                                                                is_causal, scale=scale)
    return out[0]


@contextlib.contextmanager
def dropout_as_on_a_gpu() -> Iterator[None]:
    """Within this scope, `torch.nn.functional.dropout` in training with 0 < p < 1, not in place, runs ATen's fused
    native_dropout (a bool mask), as CUDA's dispatch does; any other call keeps torch's own path."""
    functional = torch.nn.functional
    plain = functional.dropout

    def dispatch(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return plain(input, p, training, inplace)

    functional.dropout = dispatch
    try:
        yield
    finally:
        functional.dropout = plain
