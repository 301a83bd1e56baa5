"""Chunked cross-entropy that never materialises full-vocabulary fp32 logits for the batch.

Only positions that carry a label go through the output head (prompt tokens are skipped entirely), in chunks of
`chunk` rows. The gradient of each chunk is computed in the forward pass and the chunk's logits are freed at once,
so peak logits memory is `chunk x vocab` floats instead of `batch x seq x vocab`, with no recomputation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardfit.data.tokenize import IGNORE
from shardfit.models.anatomy import decoder_and_head, soft_token_body, vision_body
from shardfit.models.experts import AuxLoss, expert_load, load_of_counts, router_logits_of, router_sums, switch_loss
from shardfit.models.masks import mask_argument
from shardfit.parallel.group_sum import group_sum
from shardfit.parallel.ulysses import SHARD_KWARG, SequenceShard
from shardfit.train.media_forward import vision_language_forward
from shardfit.train.soft_token_forward import soft_token_forward


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in at least fp32 (bf16 logits lose the small probabilities), never lower than the input."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_loss(hc: torch.Tensor, w: torch.Tensor, yc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy, and its fp32 logits turned in place into exp(logit - row max) with the
    rows' sums (the softmax is their quotient). In place because the chunk's logits are the loss's largest buffer:
    torch.logsumexp would allocate a second one of the same size for its exp."""
    logits = _upcast(hc @ w.t())
    picked = logits.gather(1, yc[:, None]).squeeze(1)
    row_max = logits.amax(dim=-1, keepdim=True)
    exp = logits.sub_(row_max).exp_()
    sums = exp.sum(dim=-1, keepdim=True)
    loss = ((row_max + sums.log()).squeeze(1) - picked).sum()
    return loss, exp, sums


def _cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, chunk: int,
                       compute_dtype: torch.dtype) -> torch.Tensor:
    """The summed loss alone, chunk by chunk, for a forward without autograd (evaluation): none of the gradient
    work `_LinearCrossEntropy` does in its forward pass."""
    w = weight.to(compute_dtype)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    for s in range(0, h.shape[0], chunk):
        total += _chunk_loss(h[s:s + chunk].to(compute_dtype), w, y[s:s + chunk])[0]
    return total


@functools.cache
def widening_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies 16-bit operands into an fp32 result accumulated in place (`torch.addmm` with
    `out_dtype`, aten::addmm.dtype_out: CUDA builds that have it). Tried once per device on a tiny product, checked
    against the fp32 one; a CPU has no such kernel."""
    if device.type != "cuda":
        return False
    a = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    b = torch.randn(16, 8, device=device, dtype=torch.bfloat16)
    acc = torch.ones(8, 8, device=device)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):  # how torch says this build or GPU lacks the kernel
        return False  # a capability answer: the head's gradient then takes the fp32 matmul
    return bool(torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-2))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(h @ W^T, y), with grads for h and (if it trains) W computed chunk by chunk.

    `widen`: the trained head's gradient from the 16-bit operands the chunk already has into the fp32 gradient
    (`widening_matmul`), instead of widening both to fp32 for an fp32 matmul (several times slower on a GPU, and
    the largest matmul of a full fine-tune's loss)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype, widen: bool = False) -> torch.Tensor:
        want_w = weight.requires_grad
        w = weight.to(compute_dtype)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        acc = torch.promote_types(weight.dtype, torch.float32)  # fp32 accumulation for bf16/fp16 heads
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for s in range(0, h.shape[0], chunk):
            hc = h[s:s + chunk].to(compute_dtype)
            yc = y[s:s + chunk]
            loss, exp, sums = _chunk_loss(hc, w, yc)
            total += loss
            # d(CE)/d(logits) = softmax - onehot, computed in place over the chunk's logits.
            logits = exp.div_(sums)
            logits[torch.arange(yc.shape[0], device=yc.device), yc] -= 1.0
            g = logits.to(compute_dtype)
            grad_h[s:s + chunk] = (g @ w).to(h.dtype)
            if grad_w is not None and widen:
                torch.addmm(grad_w, g.t(), hc, out_dtype=acc, out=grad_w)
            elif grad_w is not None:
                # The fp32 gradient itself, not a widened copy of `g`: exact, and no third chunk-sized buffer.
                grad_w.addmm_(logits.t().to(acc), hc.to(acc))
            del logits, exp, g
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.want_w = want_w
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w = ctx.saved_tensors
        # In place: a second vocabulary-sized buffer here would coexist with every activation of the step. The
        # saved tensor is spent; a second backward through this graph fails on its version counter.
        gw = grad_w.mul_(grad_out).to(ctx.w_dtype) if ctx.want_w else None
        return grad_h * grad_out.to(grad_h.dtype), gw, None, None, None, None


def labelled(hidden: torch.Tensor, targets: torch.Tensor, n_targets: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states and targets of the labelled positions, in order.

    Selected by index, not by boolean mask: a mask's selection (forward, and its backward again) sizes its output by
    the data, which on a GPU makes the host wait for the device. With the count known on the host (`n_targets`, the
    batch counts it before the copy), `nonzero_static` gives the indices without that wait; the rows, and so the
    loss and its gradients, are the same. Without a count the mask is counted on the device (one wait)."""
    keep = (targets != IGNORE).flatten()
    n = int(keep.sum()) if n_targets is None else n_targets
    idx = torch.nonzero_static(keep, size=n).squeeze(1)
    return hidden.flatten(0, 1).index_select(0, idx), targets.flatten().index_select(0, idx)


def unlabelled_loss(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """A zero loss for hidden states without one labelled position that still reaches every parameter the loss
    would: the body's through `hidden`, and the head's through its call on one position. A rank whose micro-batch
    leaves a trained head out would produce no gradient for it: DDP's bucket holding it would never be reduced
    there (its other ranks' all-reduce then meets this rank's next collective), and FSDP2 would reduce-scatter
    fewer tensors than the other ranks. Sequence parallelism makes such micro-batches common: a rank's slice of
    short rows may hold only prompt tokens. The head's gradient is zero, the other ranks' average unchanged."""
    weight = getattr(head, "weight", None)
    one = hidden.flatten(0, -2)[:1]
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters()):
        touched = head(one if weight is None else one.to(weight.device)).sum().to(hidden.device)
        return (hidden.sum() + touched) * 0.0
    return hidden.sum() * 0.0


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int = 1024,
                          compute_dtype: torch.dtype | None = None, all_labelled: bool = False,
                          n_targets: int | None = None, widen: bool | None = None) -> tuple[torch.Tensor, int]:
    """Summed CE of `head(hidden)` against `targets` (already shifted; IGNORE skipped), and the target count.

    `targets` is moved to the hidden states' device first, so a model split across devices never mixes them.
    `all_labelled` skips the selection of labelled positions (its output size depends on the data, which a
    fake-tensor simulation cannot know): every position then goes through the head, the worst case.
    `n_targets`, the count of labelled positions when the caller knows it on the host, spares the GPU a wait.
    `widen`: a trained head's gradient from 16-bit operands into fp32 (`_LinearCrossEntropy`); None: wherever the
    compute dtype is 16-bit and the device has the kernel (`widening_matmul`).
    """
    targets = targets.to(hidden.device)
    if all_labelled:
        h, y = hidden.flatten(0, 1), targets.flatten()
    else:
        h, y = labelled(hidden, targets, n_targets)
    n = int(y.numel())
    if n == 0:
        return unlabelled_loss(hidden, head), 0
    if compute_dtype is None:
        compute_dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) \
            else h.dtype
    weight = getattr(head, "weight", None)
    plain = type(head) is nn.Linear and head.bias is None and weight is not None
    if plain:
        h, y = h.to(weight.device), y.to(weight.device)  # model_parallel: the head may sit on another GPU
        with torch.autocast(h.device.type, enabled=False):
            if not torch.is_grad_enabled():
                return _cross_entropy_sum(h, weight, y, chunk, compute_dtype), n
            if widen is None:
                widen = compute_dtype in (torch.bfloat16, torch.float16) and weight.requires_grad \
                    and widening_matmul(weight.device)
            return _LinearCrossEntropy.apply(h, weight, y, chunk, compute_dtype, widen), n
    # A wrapped head (LoRA on lm_head, a bias): recompute each chunk's logits in backward instead.
    def piece(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_upcast(head(hc)), yc, reduction="sum")

    total = sum(checkpoint(piece, h[s:s + chunk], y[s:s + chunk], use_reentrant=False)
                for s in range(0, h.shape[0], chunk))
    return total, n  # type: ignore[return-value]


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Reference: summed CE over full logits (used by tests and evaluation of tiny models)."""
    targets = targets.to(logits.device)
    n = int((targets != IGNORE).sum())
    return F.cross_entropy(_upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                           reduction="sum"), n


class CausalLMLoss(nn.Module):
    """The module that parallel wrappers wrap: forward(batch) -> (summed loss, target count).

    Running the body and the chunked loss inside one forward keeps FSDP's root all-gather covering the head.
    """

    def __init__(self, model: nn.Module, chunk: int = 1024, all_labelled: bool = False, moe_top_k: int = 0,
                 aux: AuxLoss | None = None):
        super().__init__()
        self.model = model
        self.chunk = chunk
        self.all_labelled = all_labelled
        # A mixture of experts (top-k above 0): the routers' logits are recorded for the expert load, and the
        # model's load-balancing loss (`aux`) joins the loss with its config's coefficient.
        self.moe_top_k, self.aux = moe_top_k, aux
        self.last_moe: MoeStep | None = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, targets: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                input_features: torch.Tensor | None = None, audio_feature_lens: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, n_targets: int | None = None,
                restarts: bool | None = None, sequence_shard: SequenceShard | None = None) -> tuple[torch.Tensor, int]:
        """`n_targets` (labelled positions) and `restarts` (whether a row restarts its positions) are what the
        batch knows on the host (data/loader.py `Batch`): with them the step never waits for the device.
        `sequence_shard`: the rows are this rank's slices of a sequence-parallel group's (parallel/sequence.py);
        the loss is then the sum over this slice's targets."""
        out, hidden, head = self.body_forward(input_ids, position_ids, restarts, pixel_values, image_grid_thw,
                                              input_features, audio_feature_lens, pixel_values_videos,
                                              video_grid_thw, shard=sequence_shard)
        loss_sum, n = chunked_cross_entropy(hidden, head, targets, self.chunk, all_labelled=self.all_labelled,
                                            n_targets=n_targets)
        if self.moe_top_k:
            split = sequence_shard is not None and sequence_shard.size > 1
            loss_sum = loss_sum + self._routing(router_logits_of(out), n, loss_sum,
                                                sequence_shard if split else None, input_ids.shape[0])
        return loss_sum, n

    def body_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, restarts: bool | None,
                     *media: torch.Tensor | None,
                     shard: SequenceShard | None = None) -> tuple[Any, torch.Tensor, nn.Module]:
        """The decoder's (or the vision-language body's) forward: its output, the last hidden states and the output
        head that turns them into logits. `media`: pixel_values, image_grid_thw, input_features,
        audio_feature_lens, pixel_values_videos, video_grid_thw, as `forward` takes them. `shard`: handed to
        every layer's attention (the Ulysses kernel's group and the whole rows' positions)."""
        decoder, head = decoder_and_head(self.model)
        # 3-D (M-RoPE) positions mark a vision-language batch; rows of one example may come without positions.
        body = vision_body(self.model) if position_ids is not None and position_ids.dim() == 3 else None
        soft = soft_token_body(self.model)  # Gemma 3 on images: 1-D positions, its own image mask
        extra = {"output_router_logits": True} if self.moe_top_k else {}
        if shard is not None:
            extra[SHARD_KWARG] = shard
        if soft is not None:
            out = soft_token_forward(soft, input_ids, position_ids, media[0], extra)
        elif body is None:
            out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          **mask_argument(decoder, position_ids, restarts), **extra)
        else:
            out = vision_language_forward(body, input_ids, position_ids, *media, extra)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return out, hidden, head

    def _routing(self, logits: tuple[torch.Tensor, ...], n: int, like: torch.Tensor,
                 shard: SequenceShard | None = None, rows: int = 1) -> torch.Tensor:
        """The load-balancing loss as a sum over this micro-batch's `n` targets (the LM loss is a sum too, so
        after the step's normalisation it weighs `coef` x the mean aux loss), recording it and the expert load.
        `shard`: the sequence-parallel group whose ranks hold the other slices of these `rows`. The loss is not
        linear in the tokens' statistics, so a slice's own would not be the rows': the routers' per-expert sums
        (less the split's padding) are added over the group first (autograd-aware, so the gradients are the whole
        rows' too), and each rank weighs the whole rows' loss by its own slice's targets; the load is the whole
        rows' as well."""
        aux_sum = like.new_zeros(())
        if shard is None or not logits:
            load = expert_load(logits, self.moe_top_k)
            if self.aux is not None and logits:
                aux = self.aux.fn(logits, self.aux.experts, self.aux.top_k, None)
                aux_sum = self.aux.coef * aux.to(like.dtype) * n
        else:
            probs, counts = router_sums(logits, self.moe_top_k, self.aux is not None, shard.own_tokens(rows))
            counts = group_sum(counts, shard.group)
            load = load_of_counts(counts)
            if self.aux is not None and probs is not None:
                aux = switch_loss(group_sum(probs, shard.group), counts, self.aux.top_k)
                aux_sum = self.aux.coef * aux.to(like.dtype) * n
        self.last_moe = MoeStep(aux_sum.detach(), n, load)
        return aux_sum


@dataclass(frozen=True)
class MoeStep:
    """What one micro-batch's routing did: its load-balancing loss as added to the loss sum (over `targets`), and
    the lowest and highest expert load (models/experts.py `expert_load`), both on the device."""

    aux_sum: torch.Tensor
    targets: int
    load: torch.Tensor  # [lowest, highest]
