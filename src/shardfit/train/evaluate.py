"""Held-out loss (and the generation metrics of `eval_metrics`) during and after training, with its own cadence;
the same loss for `shardfit eval`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardfit.data.dataset import Conversation, DataStats, encode_all
from shardfit.data.loader import collate
from shardfit.data.packing import PackedRow, no_pack
from shardfit.data.preference import Pair, pair_former
from shardfit.evals.generation import Scored, score_answers
from shardfit.evals.scorers import Scorer
from shardfit.infer.generate import Sampling, generate_sharded
from shardfit.infer.prompts import Request
from shardfit.models.anatomy import input_device
from shardfit.models.attention_by_width import AttentionByWidth
from shardfit.parallel.env import DistEnv
from shardfit.parallel.layout import Layout
from shardfit.parallel.sequence import shard_batch
from shardfit.parallel.ulysses import whole_row_attention
from shardfit.resolve.job import RowShape
from shardfit.train.loss import CausalLMLoss
from shardfit.train.metrics import STATS, MetricsLog, preference_record, progress
from shardfit.train.preference import PreferenceLoss, PreferenceSettings


def evaluate(module: nn.Module, rows: list[PackedRow], micro_batch: int, pad_id: int, env: DistEnv,
             amp: Any, device: torch.device | None = None, shape: RowShape | None = None,
             attention: AttentionByWidth | None = None) -> float | None:
    """Mean token loss over `rows`, `micro_batch` rows at a time shaped as `shape` says (as wide as training's,
    without empty rows added); every rank runs the same number of forwards (FSDP needs that)."""
    batches = [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]
    return evaluate_batches(module, batches, pad_id, env, amp, device, shape, attention)[0]


@torch.no_grad()
def evaluate_batches(module: nn.Module, batches: list[list[PackedRow]], pad_id: int, env: DistEnv, amp: Any,
                     device: torch.device | None = None, shape: RowShape | None = None,
                     attention: AttentionByWidth | None = None,
                     stats_of: PreferenceLoss | None = None,
                     layout: Layout | None = None) -> tuple[float | None, dict[str, float]]:
    """The mean loss over `batches` (micro-batches of rows) and, with `stats_of` (the unwrapped preference loss
    module `module` runs), the preference figures over them (eval_rewards_chosen, eval_reward_accuracy, ...).
    `layout`: the ranks of a sequence-parallel group take the same micro-batch, each its slice of the rows."""
    if not batches:
        return None, {}
    shape = dataclasses.replace(shape, height=None) if shape is not None else None
    module.eval()
    layout = layout or Layout(dp=env.world, dp_rank=env.rank)
    per_rank = math.ceil(len(batches) / layout.dp)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    stats: torch.Tensor | None = None
    for k in range(per_rank):
        idx = k * layout.dp + layout.dp_rank
        real = idx < len(batches)
        batch = shard_batch(collate(batches[idx if real else 0], pad_id, shape), layout).to(device or env.device)
        if attention is not None:
            attention.before(batch.input_ids.shape[-1])
        with amp:
            extra = {k: v for k, v in batch.host_facts.items() if k not in ("n_targets", "restarts")}
            loss_sum, n = module(batch.input_ids, batch.position_ids, batch.targets, **batch.media, **extra)
        if real:
            total += torch.tensor([float(loss_sum), n], dtype=torch.float64, device=env.device)
            if stats_of is not None and stats_of.last_stats is not None:
                stats = stats_of.last_stats if stats is None else stats + stats_of.last_stats
    if stats_of is not None:
        stats = stats if stats is not None else torch.zeros(len(STATS), 2, dtype=torch.float64, device=env.device)
        total = torch.cat([total, stats.to(env.device).flatten()])
    if env.distributed:
        dist.all_reduce(total)
    module.train()
    figures = preference_record(total[2:].view(-1, 2), "eval_") if stats_of is not None else {}
    return float(total[0] / max(total[1], 1)), figures


class GenerationEval:
    """`eval_metrics` during training: greedy answers to the first `eval_samples` held-out prompts, scored.

    `model` is the inner model (what `generate` runs on); `root` is the module the strategy wrapped. Under FSDP2 the
    root's own parameters (head, final norm, tied embedding) are gathered around generation, and every rank steps
    until all are done, because each forward of a sharded model is a collective."""

    def __init__(self, model: nn.Module, root: nn.Module, tokenizer: Any, requests: list[Request],
                 scorers: list[Scorer], sampling: Sampling, env: DistEnv, amp: Any):
        self.model, self.root, self.tokenizer, self.requests = model, root, tokenizer, requests
        self.scorers, self.sampling, self.env, self.amp = scorers, sampling, env, amp
        self.scored: Scored | None = None

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """Each metric's mean as `eval_<name>` (identical on every rank)."""
        self.model.eval()
        sharded = hasattr(self.root, "unshard") and hasattr(self.root, "reshard")
        if sharded:
            self.root.unshard()
        try:
            with self.amp, whole_row_attention(self.model):
                answers = generate_sharded(self.model, self.tokenizer, [r.messages for r in self.requests],
                                           self.sampling, rank=self.env.rank, world=self.env.world)
        finally:
            if sharded:
                self.root.reshard()
            self.model.train()
        self.scored = score_answers(self.requests, answers, self.scorers)
        return {f"eval_{k}": v for k, v in self.scored.means.items()}

    def samples(self, step: int) -> list[dict[str, Any]]:
        """The last run's answers as eval_samples.jsonl lines."""
        scored = self.scored
        if scored is None:
            return []
        return [{"step": step, "where": r.where, "prompt": r.messages[-1]["content"], "expected": r.expected,
                 "answer": a, "scores": sc} for r, a, sc in zip(self.requests, scored.answers, scored.scores,
                                                                  strict=True)]


class Evaluator:
    """Evaluates every `every` steps before the last, and once at the end (`run`); writes eval_loss lines (with
    the generation metrics when `generation` is given)."""

    def __init__(self, module: nn.Module, rows: list[PackedRow], metrics: MetricsLog, env: DistEnv, *,
                 shape: RowShape, pad_id: int, amp: Any, device: torch.device, every: int, total_steps: int,
                 generation: GenerationEval | None = None, show: bool = False,
                 attention: AttentionByWidth | None = None, batches: list[list[PackedRow]] | None = None,
                 stats_of: PreferenceLoss | None = None, layout: Layout | None = None):
        """`batches`: the held-out micro-batches as formed (preference pairs), instead of `rows` cut
        `shape.micro_batch` at a time; `stats_of`: the preference loss module whose figures join eval_loss;
        `layout`: the ranks' data and sequence split (None: data split over every rank)."""
        self.module, self.metrics, self.env, self.layout = module, metrics, env, layout
        self.rows = batches if batches is not None else \
            [rows[i:i + shape.micro_batch] for i in range(0, len(rows), shape.micro_batch)]
        self.stats_of = stats_of
        self.attention = attention
        self.shape, self.pad_id, self.amp, self.device = shape, pad_id, amp, device
        self.every, self.total, self.generation, self.show = every, total_steps, generation, show
        self.last: float | None = None
        self.last_generation: dict[str, float] = {}
        self.last_preference: dict[str, float] = {}

    def maybe_run(self, step: int) -> None:
        if self.due(step):
            self.run(step)

    def due(self, step: int) -> bool:
        """Whether `maybe_run` evaluates after step `step` (the last step's evaluation is `finish`'s)."""
        return bool(self.rows) and step % self.every == 0 and step != self.total

    def run(self, step: int) -> float | None:
        if not self.rows:
            return None
        bar = progress(2 if self.generation else 1, 0, self.show, desc="eval", unit="pass")
        self.last, figures = evaluate_batches(self.module, self.rows, self.pad_id, self.env, self.amp, self.device,
                                              self.shape, self.attention, self.stats_of, self.layout)
        self.last_preference = figures
        bar.update()
        record: dict[str, Any] = {"step": step, "eval_loss": self.last, **figures}
        if self.generation is not None:
            bar.set_postfix_str(f"generating {len(self.generation.requests)} answers")
            self.last_generation = self.generation.run()
            record.update(self.last_generation)
            self.metrics.write_samples(self.generation.samples(step))
            bar.update()
        bar.close()
        self.metrics.write(record)
        return self.last


@dataclass
class HeldoutLoss:
    """Mean loss per assistant token, its perplexity, and how many tokens it averages."""

    loss: float | None
    perplexity: float | None
    tokens: int


def heldout_loss(model: nn.Module, tokenizer: Any, conversations: list[list[dict[str, str]]], *, max_seq_len: int,
                 micro_batch: int, device: torch.device) -> HeldoutLoss:
    """The loss training reports as eval_loss (same tokenisation, labels on assistant tokens only, same chunked
    loss), for a model already on `device` in its compute dtype, in one process."""
    stats = DataStats()
    rows = no_pack(encode_all(tokenizer, [Conversation(m, f"row {i + 1}") for i, m in enumerate(conversations)],
                              max_seq_len, stats))
    if not rows:
        return HeldoutLoss(None, None, 0)
    env = DistEnv(0, 1, 0, device, None)
    loss = evaluate(CausalLMLoss(model), rows, micro_batch, tokenizer.pad_token_id, env, contextlib.nullcontext(),
                    input_device(model))
    model.eval()
    tokens = sum(r.n_targets for r in rows)
    return HeldoutLoss(loss, math.exp(min(loss, 50.0)) if loss is not None else None, tokens)


@torch.no_grad()
def pair_logps(model: nn.Module, pad_id: int, pairs: list[Pair], *, micro_batch: int,
               device: torch.device) -> torch.Tensor:
    """Each pair's summed log-probability of its chosen and of its rejected answer under `model`, as a (pairs, 2)
    fp64 tensor on the CPU (`shardfit eval` on preference rows)."""
    scorer = PreferenceLoss(model, PreferenceSettings("dpo", 0.1), reference=None).eval()
    form = pair_former(max_len=1 << 30, packing=False)
    out = []
    for i in range(0, len(pairs), micro_batch):
        batch = collate(form(pairs[i:i + micro_batch]), pad_id).to(device)
        logps, _ = scorer(batch.input_ids, batch.position_ids, batch.targets, **batch.media, **batch.host_facts,
                          reference_only=True)
        out.append(logps.double().cpu().view(-1, 2))
    return torch.cat(out)
