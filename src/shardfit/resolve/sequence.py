"""`sequence_parallel: N`: what this increment runs, decided once before the launch (and again on the built model,
whose config is the ground truth where the planner did not know the shape). Torch-free.

What runs: decoders attending over the whole row in every layer (Llama, Qwen2, Qwen3, ...), their mixtures of
experts too (Qwen3-MoE, GLM-4.5: experts act per token, and the routers' load-balancing loss and load are the
whole row's, train/loss.py), and the Qwen2-VL-style vision-language models of SPLIT_VISION_TYPES on image rows,
with a multi-rank strategy over the world's ranks (DDP or FSDP2), the SFT objective, and attention through SDPA
inside the Ulysses kernel (parallel/ulysses.py). Everything else is refused with exit 2 and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardfit import objective as objectives
from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan import attention_layout as attention
from shardfit.plan.loaded_config import distinct_block_heads
from shardfit.plan.media import has_tower
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.sdpa_classes import runs_eager
from shardfit.plan.single_part import SINGLE_PART_TYPES

# Attention settings the Ulysses kernel stands in for: it runs SDPA over the whole row itself.
SP_ATTENTION = ("auto", "sdpa")
# Vision-language models whose image rows split (train/media_forward.py cuts the whole rows' embeddings, M-RoPE
# positions and Qwen3-VL's deepstack features); other towers are refused.
SPLIT_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SPLIT_VISION_NAMES = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL"
TOWERS = f"a vision or audio tower other than {SPLIT_VISION_NAMES}'s"


@dataclass(frozen=True)
class DecoderFacts:
    """What the rules need to know of the model: its attention heads and key/value heads, and whether it is a
    mixture of experts, multimodal (vision or audio tower), or has layers that do not attend over the whole row
    (sliding windows, chunks) or attention of another form (multi-head latent attention). Where a per-layer config's
    blocks have different head counts (`block_heads`, largest first), `heads` is the largest count all of theirs
    divide by."""

    heads: int
    kv_heads: int
    experts: bool = False
    multimodal: bool = False
    partial_attention: bool = False
    latent_attention: bool = False
    # What the partial-attention blocks are (plan/attention_layout.py KINDS), which the refusal names.
    attention_kinds: tuple[str, ...] = ()
    # A vision tower whose rows this version splits (Qwen2-VL-style: the images' features go into the embeddings
    # of the whole row, M-RoPE positions; `multimodal` stays True for a model it does not).
    split_vision: bool = False
    block_heads: tuple[int, ...] = ()
    # The language model's class has no SDPA (plan/sdpa_classes.py `runs_eager`): its attention is its own code,
    # which the Ulysses kernel cannot stand in for.
    eager_only: bool = False


def _prefix(n: int) -> str:
    return f"sequence_parallel: {n}"


def check_objective(n: int, objective: str) -> None:
    """The objective against sequence_parallel `n` (UserError when refused): what `plan` checks too."""
    if n > 1 and objectives.get(objective).preference:
        raise UserError(f"{_prefix(n)} trains objective sft only in this version (a preference objective sums "
                        f"each sequence's log-probabilities, which a split row would need gathered): use objective: "
                        f"sft, or set sequence_parallel: 1.")


def check_layout(cfg: Config, strategy: str, world: int) -> None:
    """The config's sequence_parallel against the job's ranks, strategy and settings (UserError when refused)."""
    n = cfg.sequence_parallel
    if n == 1:
        return
    fix = "or set sequence_parallel: 1"
    if world % n != 0 or world < n:
        raise UserError(f"{_prefix(n)} splits every row over {n} ranks, which must divide the job's {world} "
                        f"rank{'s' if world != 1 else ''}: launch a multiple of {n} (--nproc {n}), {fix}.")
    if not strategies.get(strategy).multi_rank:
        raise UserError(f"{_prefix(n)} runs under a multi-rank strategy (ddp, zero2, zero3), not {strategy}: "
                        f"use --set strategy=zero3, {fix}.")
    check_objective(n, cfg.objective)
    if cfg.attn_implementation not in SP_ATTENTION:
        raise UserError(f"{_prefix(n)} runs its own attention (an all-to-all around SDPA), so attn_implementation: "
                        f"{cfg.attn_implementation} cannot apply: set attn_implementation: auto, {fix}.")
    if cfg.compile is True:
        raise UserError(f"{_prefix(n)} does not run compiled blocks in this version (the all-to-all of its "
                        f"attention breaks the compiled graph): set compile: false (or auto), {fix}.")


def check_model(n: int, facts: DecoderFacts, model: str) -> None:
    """The model against sequence_parallel `n` (UserError when refused). Any method splits: LoRA, QLoRA and full
    fine-tunes, of mixtures too (a rank whose slice holds no target still reaches the trained head, train/loss.py
    `unlabelled_loss`, so every rank's gradients are the same set)."""
    if n == 1:
        return
    fix = "or set sequence_parallel: 1"
    towers = facts.multimodal and not facts.split_vision
    why = (f"has {TOWERS}" if towers
           else "is a vision-language mixture of experts (each half splits; together they are untested)"
           if facts.multimodal and facts.experts
           else attention.refusal(facts.attention_kinds) if facts.partial_attention
           else "uses multi-head latent attention" if facts.latent_attention
           else "has no SDPA attention in its transformers class (its eager attention would see only each rank's "
                "slice of the row)" if facts.eager_only else None)
    if why is not None:
        raise UserError(f"{_prefix(n)}: {model} {why}; this version splits the rows of decoders with full "
                        f"attention only (Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5, and {SPLIT_VISION_NAMES} on "
                        f"images): train it without sequence parallelism, {fix}.")
    if facts.heads % n != 0:
        divisors = [d for d in range(2, facts.heads + 1) if facts.heads % d == 0]
        has = f" has {facts.heads} attention heads, which" if len(facts.block_heads) < 2 else \
            f"'s blocks' attention heads ({_and(facts.block_heads)}) share only {facts.heads}, which"
        raise UserError(f"{_prefix(n)}: {model}{has} {n} ranks cannot share out evenly (each rank attends with "
                        f"heads/{n} of each block's): use a sequence_parallel that divides {facts.heads} "
                        f"({', '.join(map(str, divisors[:6])) or 'none above 1'}), {fix}.")


def _and(counts: tuple[int, ...]) -> str:
    """(16, 8, 4) -> '16, 8 and 4'."""
    return ", ".join(map(str, counts[:-1])) + f" and {counts[-1]}"


def facts_of_shape(shape: ModelShape) -> DecoderFacts:
    """The planner's shape of the model as the rules read it."""
    split = shape.multimodal and shape.audio is None and shape.vision is not None and \
        shape.vision.kind in SPLIT_VISION_TYPES
    heads = math.gcd(*shape.block_heads) if shape.block_heads else shape.heads
    return DecoderFacts(heads=heads, kv_heads=shape.kv_heads, experts=shape.experts > 1,
                        multimodal=shape.multimodal, split_vision=split, block_heads=shape.block_heads,
                        partial_attention=shape.sliding_layers > 0 and shape.sliding_window > 0,
                        attention_kinds=shape.attention_kinds, latent_attention=shape.mla is not None,
                        eager_only=shape.eager_only)


def facts_of_config(config: Any) -> DecoderFacts:
    """A built model's (transformers) config as the rules read it. A heterogeneous config's per-layer counts are
    read block by block: the heads any split must divide are the count every block's heads divide by."""
    text = attention.text_of(config)
    layout = attention.layout_of(config)
    heads = attention.common_count(text, "num_attention_heads")
    experts = max((n for k in ("num_experts", "num_local_experts", "n_routed_experts")
                   for n in attention.block_counts(text, k)), default=0)
    if getattr(text, "model_type", None) in SINGLE_PART_TYPES and "moe" not in (getattr(text, "layer_types", None)
                                                                                  or ()):
        experts = 0  # Nemotron-H's class names 8 experts by default, built only in its "moe" blocks
    return DecoderFacts(heads=heads, kv_heads=attention.common_count(text, "num_key_value_heads") or heads,
                        experts=experts > 1,
                        multimodal=has_tower(config), partial_attention=layout.partial, attention_kinds=layout.kinds,
                        latent_attention=bool(attention.block_counts(text, "kv_lora_rank")),
                        split_vision=getattr(config, "model_type", None) in SPLIT_VISION_TYPES,
                        block_heads=distinct_block_heads(config),
                        eager_only=runs_eager(getattr(config, "model_type", None), "sdpa",
                                              text_type=getattr(text, "model_type", None) if text is not config
                                              else None))


def check_balancing(n: int, whole_row: bool, model: str) -> None:
    """A mixture's load-balancing loss under sequence_parallel `n`: it is summed from the routers' per-expert
    statistics of the whole row (gathered over the SP group), which holds for the Switch-Transformer form of
    transformers' families; `whole_row` says the model's own loss is that form (models/experts.py
    `switch_form`). UserError when it is not."""
    if n > 1 and not whole_row:
        raise UserError(f"{_prefix(n)}: {model}'s load-balancing loss is not the Switch-Transformer form this version "
                        f"gathers over the split row: train it without sequence parallelism "
                        f"(set sequence_parallel: 1).")
