"""Preference objectives on the shared loss module: DPO (sigmoid, IPO, hinge, robust), ORPO, SimPO and KTO.

Each sequence's answer log-probability is summed from per-token log-probabilities computed chunk by chunk through
the output head (never the batch's full logits), so the same memory bound as the SFT loss holds. The reference
model is either the policy with its adapters switched off, run without gradients inside the same forward (LoRA and
QLoRA: no second copy of the weights), or the log-probabilities computed once before the first step, when the
policy still is the reference (every method; `dpo.precompute_reference`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardfit.data.tokenize import IGNORE
from shardfit.models.experts import router_logits_of
from shardfit.train.loss import CausalLMLoss, _upcast, unlabelled_loss


@dataclass(frozen=True)
class PreferenceSettings:
    """What the loss needs of the config: the objective and the `dpo` section."""

    objective: str
    beta: float
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def sequence_logps(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, seq_ids: torch.Tensor,
                   n_seqs: int, chunk: int, n_targets: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its labelled tokens, and its labelled-token count (both fp32,
    `n_seqs` long). The labelled positions go through the head `chunk` at a time, each chunk's logits recomputed
    in backward instead of kept."""
    targets = targets.to(hidden.device)
    keep = (targets != IGNORE).flatten()
    n = int(keep.sum()) if n_targets is None else n_targets
    idx = torch.nonzero_static(keep, size=n).squeeze(1)
    h = hidden.flatten(0, 1).index_select(0, idx)
    y = targets.flatten().index_select(0, idx)
    owner = seq_ids.to(hidden.device).flatten().index_select(0, idx)
    at = next(head.parameters()).device  # model_parallel: the head may sit on another GPU than the last block
    h, y, owner = h.to(at), y.to(at), owner.to(at)

    def piece(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return -F.cross_entropy(_upcast(head(hc)), yc, reduction="none")

    parts = [checkpoint(piece, h[s:s + chunk], y[s:s + chunk], use_reentrant=False) if torch.is_grad_enabled()
             else piece(h[s:s + chunk], y[s:s + chunk]) for s in range(0, h.shape[0], chunk)]
    token_logps = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    sums = token_logps.new_zeros(n_seqs).index_add(0, owner, token_logps.float())
    counts = token_logps.new_zeros(n_seqs).index_add(0, owner, torch.ones_like(token_logps, dtype=torch.float32))
    if n == 0:
        sums = sums + unlabelled_loss(hidden, head).to(sums.device)  # every parameter reached on every rank
    return sums, counts


def dpo_losses(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor,
               s: PreferenceSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the chosen and rejected rewards, from the policy's (p) and reference's (r)
    log-probabilities of the chosen (c) and rejected (r) answers (IPO's are per-token means, the others' sums)."""
    logits = (pc - pr) - (rc - rr)
    b, eps = s.beta, s.label_smoothing
    if s.loss == "sigmoid":
        losses = -F.logsigmoid(b * logits) * (1 - eps) - F.logsigmoid(-b * logits) * eps
    elif s.loss == "robust":
        losses = (-F.logsigmoid(b * logits) * (1 - eps) + F.logsigmoid(-b * logits) * eps) / (1 - 2 * eps)
    elif s.loss == "hinge":
        losses = torch.relu(1 - b * logits)
    elif s.loss == "ipo":
        losses = (logits - 1 / (2 * b)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {s.loss}")
    return losses, b * (pc - rc).detach(), b * (pr - rr).detach()


def orpo_losses(avg_c: torch.Tensor, avg_r: torch.Tensor,
                s: PreferenceSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO: the chosen answer's mean token NLL minus beta x log sigmoid of the log odds ratio (no reference)."""
    log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c).clamp(max=1 - 1e-6))
                                  - torch.log1p(-torch.exp(avg_r).clamp(max=1 - 1e-6)))
    losses = -avg_c - s.beta * F.logsigmoid(log_odds)
    return losses, s.beta * avg_c.detach(), s.beta * avg_r.detach()


def simpo_losses(avg_c: torch.Tensor, avg_r: torch.Tensor,
                 s: PreferenceSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO: a margin `simpo_gamma` on beta x the difference of mean token log-probabilities (no reference)."""
    logits = s.beta * (avg_c - avg_r) - s.simpo_gamma
    eps = s.label_smoothing
    losses = -F.logsigmoid(logits) * (1 - eps) - F.logsigmoid(-logits) * eps
    return losses, s.beta * avg_c.detach(), s.beta * avg_r.detach()


def kto_losses(p: torch.Tensor, r: torch.Tensor, desirable: torch.Tensor,
               s: PreferenceSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO per row, and its reward. The reference point is the micro-batch's mean policy/reference log-ratio,
    clamped at 0 and without gradient: an estimate of the KL term from the rows at hand (the paper pairs prompts
    with other rows' answers for it; this takes no second forward)."""
    ratio = p - r
    kl = ratio.detach().mean().clamp(min=0)
    good = s.desirable_weight * (1 - torch.sigmoid(s.beta * (ratio - kl)))
    bad = s.undesirable_weight * (1 - torch.sigmoid(s.beta * (kl - ratio)))
    return torch.where(desirable, good, bad), s.beta * ratio.detach()


class PreferenceLoss(CausalLMLoss):
    """The loss module of a preference objective: forward(batch) -> (summed loss over the micro-batch's pairs, its
    pair count). The step's figures (rewards, accuracy, log-probabilities) are kept in `last_stats` as device
    tensors, read only when a metrics line is written."""

    def __init__(self, model: nn.Module, settings: PreferenceSettings, *, reference: str | None, chunk: int = 1024,
                 moe_top_k: int = 0, aux: Any = None):
        super().__init__(model, chunk, moe_top_k=moe_top_k, aux=aux)
        self.settings = settings
        self.reference = reference  # "adapters_off" | "precomputed" | None (ORPO, SimPO)
        self.last_stats: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, targets: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                input_features: torch.Tensor | None = None, audio_feature_lens: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                n_targets: int | None = None, restarts: bool | None = None, *, seq_ids: torch.Tensor,
                n_seqs: int, ref_logps: torch.Tensor | None = None, desirable: torch.Tensor | None = None,
                reference_only: bool = False) -> tuple[torch.Tensor, int]:
        """`reference_only`: return each sequence's answer log-probability under the reference (no loss)."""
        media = (pixel_values, image_grid_thw, input_features, audio_feature_lens, pixel_values_videos,
                 video_grid_thw)
        if reference_only:
            with torch.no_grad(), self._adapters_off():
                _, hidden, head = self.body_forward(input_ids, position_ids, restarts, *media)
                return sequence_logps(hidden, head, targets, seq_ids, n_seqs, self.chunk, n_targets)[0], n_seqs
        if ref_logps is None and self.reference == "precomputed":
            raise RuntimeError("a preference batch without its precomputed reference log-probabilities")
        if ref_logps is None and self.reference is not None:
            with torch.no_grad(), self._adapters_off():
                _, hidden, head = self.body_forward(input_ids, position_ids, restarts, *media)
                ref_logps = sequence_logps(hidden, head, targets, seq_ids, n_seqs, self.chunk, n_targets)[0]
        out, hidden, head = self.body_forward(input_ids, position_ids, restarts, *media)
        logps, counts = sequence_logps(hidden, head, targets, seq_ids, n_seqs, self.chunk, n_targets)
        losses = self._losses(logps, counts, ref_logps, desirable)
        loss_sum = losses.sum()
        units = n_seqs if self.settings.objective == "kto" else n_seqs // 2
        if self.moe_top_k:
            loss_sum = loss_sum + self._routing(router_logits_of(out), units, loss_sum)
        return loss_sum, units

    def _adapters_off(self) -> contextlib.AbstractContextManager:
        """The reference: the policy with its LoRA adapters switched off (a no-op for precomputed references of a
        full fine-tune, whose reference pass runs before the first update)."""
        if self.reference != "adapters_off":
            return contextlib.nullcontext()
        off = getattr(self.model, "disable_adapter", None)
        if off is None:  # the reference would be the policy itself: no anchor at all
            raise RuntimeError("reference adapters_off on a model without peft adapters")
        return off()

    def _losses(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
                desirable: torch.Tensor | None) -> torch.Tensor:
        s = self.settings
        ref = ref.to(logps.device, logps.dtype) if ref is not None else None
        if s.objective == "kto":
            losses, rewards = kto_losses(logps, ref, desirable.to(logps.device), s)
            good = desirable.to(logps.device)
            self._record(losses, torch.where(good, rewards, 0), torch.where(good, 0, rewards), None,
                         torch.where(good, logps, 0), torch.where(good, 0, logps), good)
            return losses
        pc, pr, n_c, n_r = logps[0::2], logps[1::2], counts[0::2].clamp(min=1), counts[1::2].clamp(min=1)
        if s.objective == "dpo":
            mean = s.loss == "ipo"  # IPO's log-ratios are per-token means (as its paper and TRL take them)
            rc, rr = ref[0::2], ref[1::2]
            if mean:
                pc, pr, rc, rr = pc / n_c, pr / n_r, rc / n_c, rr / n_r
            losses, r_c, r_r = dpo_losses(pc, pr, rc, rr, s)
        elif s.objective == "orpo":
            losses, r_c, r_r = orpo_losses(pc / n_c, pr / n_r, s)
        else:
            losses, r_c, r_r = simpo_losses(pc / n_c, pr / n_r, s)
        # A tie (every pair at step 0, where the policy is the reference) counts half: a coin flip, not a miss.
        accuracy = (r_c > r_r).double() + 0.5 * (r_c == r_r).double()
        self._record(losses, r_c, r_r, accuracy, logps[0::2], logps[1::2], None)
        return losses

    def _record(self, losses: torch.Tensor, r_c: torch.Tensor, r_r: torch.Tensor, acc: torch.Tensor | None,
                lp_c: torch.Tensor, lp_r: torch.Tensor, good: torch.Tensor | None) -> None:
        """`last_stats`: (len(STATS), 2) sums and counts of this micro-batch's figures (KTO: chosen figures over
        its desirable rows, rejected over its undesirable ones, no accuracy)."""
        n = float(losses.numel())
        n_good = good.sum().double() if good is not None else n  # pairs: every figure counts every pair
        n_bad = n - n_good if good is not None else n
        zero = losses.new_zeros(())
        rows = [(losses.detach().sum(), n), (r_c.sum(), n_good), (r_r.sum(), n_bad),
                (acc.sum() if acc is not None else zero, n if acc is not None else 0.0),
                (lp_c.detach().sum(), n_good), (lp_r.detach().sum(), n_bad)]
        self.last_stats = torch.stack([torch.stack([torch.as_tensor(a, dtype=torch.float64, device=losses.device),
                                                    torch.as_tensor(b, dtype=torch.float64, device=losses.device)])
                                       for a, b in rows])
