"""Pipeline stages of a dense text decoder (`pipeline_parallel: N`, resolve/pipeline.py says what runs): the model
cut at decoder-block boundaries into N pieces, each run by torch.distributed.pipelining's `PipelineStage` under its
1F1B schedule.

Each rank builds the model, then keeps its stage's share: the first stage the input embedding, the last the final
norm and the output head, every stage its contiguous run of blocks (split evenly, the earlier stages taking the
remainder's extra blocks, as the first stage also holds the most micro-batches in flight). The blocks stay under
their own names (`layers` becomes a ModuleDict keyed by the block's index, as torchtitan keeps its layers), so a
stage's parameter names are the whole model's: its checkpoint, adapter and gradients need no renaming. Every stage
computes the rotary position embeddings and the attention mask itself from the position ids, which every rank has
(the stages of a pipeline read the same rows), so only hidden states travel between ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfit.models.anatomy import decoder_and_head, text_model
from shardfit.models.masks import block_causal_mask


def stage_blocks(layers: int, stages: int) -> list[range]:
    """The decoder blocks of each stage: contiguous, as even as `layers` allows, the first stages one more."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class DecoderStage(nn.Module):
    """One stage of the decoder: `forward(x, position_ids)` takes input ids (first stage) or the previous stage's
    hidden states and returns hidden states (after the final norm on the last stage). `model` is the rank's pruned
    model, under the name the loss module gives it, so that state dicts read as the whole model's."""

    def __init__(self, model: nn.Module, decoder: nn.Module, head: nn.Module | None, stage: int, stages: int,
                 blocks: range):
        super().__init__()
        self.model = model
        self.stage, self.stages, self.blocks = stage, stages, blocks
        # The dtype autocast computes in (the job's `autocast`), or None: a schedule runs the forward itself, so
        # the stage enters autocast around its own forward.
        self.autocast: torch.dtype | None = None
        # Held outside the module tree (a plain list): they are reached through `model`, which owns them.
        self._parts: list[Any] = [decoder, head]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP2 shards on its own under zero2/zero3 over the stage's data-parallel ranks: each kept block, in
        order, then the first stage's input embedding when the head does not share it (as parallelize.py's
        `fsdp_units` does for the whole model); the rest (final norm, head) is the stage's root unit."""
        decoder, head = self._parts
        units = [decoder.layers[str(i)] for i in self.blocks]
        emb = decoder.embed_tokens
        if emb is not None and (head is None or getattr(head, "weight", None) is not emb.weight):
            units.append(emb)
        return units

    @property
    def head(self) -> nn.Module | None:
        """The output head (the last stage's, None elsewhere; the loss applies it chunk by chunk)."""
        return self._parts[1]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, restarts: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`restarts`: whether each row restarts its positions (packed examples), a host tensor so that the mask's
        choice never waits for the device; None: read from `position_ids`."""
        if self.autocast is None:
            return self._forward(x, position_ids, restarts)
        with torch.autocast(position_ids.device.type, dtype=self.autocast):
            return self._forward(x, position_ids, restarts)

    def _forward(self, x: torch.Tensor, position_ids: torch.Tensor, restarts: torch.Tensor | None) -> torch.Tensor:
        decoder = self._parts[0]
        h = decoder.embed_tokens(x) if self.is_first else x
        position_embeddings = decoder.rotary_emb(h, position_ids)
        packed = bool((restarts if restarts is not None else row_restarts(position_ids)).any())
        mask = _mask(decoder.config, position_ids, h.dtype, packed)
        for i in self.blocks:  # this stage's (a rank holds several under an interleaved schedule)
            h = decoder.layers[str(i)](h, attention_mask=mask, position_embeddings=position_embeddings,
                                       position_ids=position_ids, use_cache=False)
        return decoder.norm(h) if self.is_last else h


def row_restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """Per row, whether its positions restart (a packed row of several examples)."""
    return (torch.diff(position_ids, dim=-1) != 1).any(dim=-1)


def _mask(config: Any, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> torch.Tensor | None:
    """What the one-process forward uses for these rows (models/masks.py): no mask for a micro-batch whose
    positions never restart under SDPA (its causal kernel), else the block-causal mask of the packed examples."""
    if not packed and config._attn_implementation == "sdpa":
        return None
    return block_causal_mask(config, position_ids, dtype)


def cut(model: nn.Module, stage: int, stages: int) -> DecoderStage:
    """Prune `model` (a built causal LM, peft-wrapped or not) in place to stage `stage` of `stages` and return the
    stage module. The parts of other stages are dropped, so their memory goes back once nothing else holds them."""
    decoder, head = decoder_and_head(model)
    layers = list(decoder.layers)
    blocks = stage_blocks(len(layers), stages)[stage]
    decoder.layers = nn.ModuleDict({str(i): layers[i] for i in blocks})
    if stage != 0:
        decoder.embed_tokens = None
    if stage != stages - 1:
        decoder.norm = None
        _drop_head(model)
    return DecoderStage(model, decoder, head if stage == stages - 1 else None, stage, stages, blocks)


def looped_stages(rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stages rank `rank` of `ranks` holds when each holds `per_rank` (the looped placement torch's interleaved
    schedules expect: rank r holds r, r + ranks, r + 2 ranks, ...)."""
    return [rank + v * ranks for v in range(per_rank)]


def cut_looped(model: nn.Module, rank: int, ranks: int, per_rank: int) -> list[DecoderStage]:
    """Prune `model` in place to the `per_rank` stages rank `rank` holds of `ranks * per_rank` (an interleaved
    schedule's virtual stages, placed by `looped_stages`) and return them in order. They share the pruned model,
    so the first one's parameters and state dict are the rank's whole share."""
    stages = ranks * per_rank
    mine = looped_stages(rank, ranks, per_rank)
    decoder, head = decoder_and_head(model)
    layers = list(decoder.layers)
    split = stage_blocks(len(layers), stages)
    decoder.layers = nn.ModuleDict({str(i): layers[i] for s in mine for i in split[s]})
    if 0 not in mine:
        decoder.embed_tokens = None
    if stages - 1 not in mine:
        decoder.norm = None
        _drop_head(model)
    return [DecoderStage(model, decoder, head if s == stages - 1 else None, s, stages, split[s]) for s in mine]


def _drop_head(model: nn.Module) -> None:
    """Remove the output head from the model that holds it (the text model under a peft wrapper)."""
    base = text_model(model)
    for name, module in base.named_children():
        if module is base.get_output_embeddings():
            setattr(base, name, None)
            return
