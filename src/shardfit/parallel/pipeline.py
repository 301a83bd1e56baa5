"""Pipeline stages of a decoder (`pipeline_parallel: N`, resolve/pipeline.py says what runs): the model cut at
decoder-block boundaries into N pieces, each run by torch.distributed.pipelining's `PipelineStage` under its 1F1B
schedule.

Each rank builds the model, then keeps its stage's share: the first stage the input embedding and a vision-language
model's vision tower (it writes the images' features into their tokens), the last the final norm and the output
head, every stage its contiguous run of blocks, as many as the plan's cut gives it (plan/pipeline.py `stage_cut`:
the first stage, which also holds the most micro-batches in flight, gets fewer). The blocks stay under their own
names (`layers` becomes a ModuleDict keyed by the block's index, as torchtitan keeps its layers), so a stage's
parameter names are the whole model's: its checkpoint, adapter and gradients need no renaming. Every stage computes
the rotary position embeddings and the attention mask itself from the position ids, which every rank has (the
stages of a pipeline read the same rows), so only hidden states travel between ranks. A vision-language model's
positions are (rows, 4, width) inside the schedule, rows first so that its micro-batch split cuts rows: the text
positions that bound packed examples, then the three M-RoPE axes the data computed on the whole row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardfit.models.anatomy import decoder_and_head, text_model, vision_body
from shardfit.models.masks import block_causal_mask
from shardfit.plan.pipeline import even_cut


def stage_blocks(layers: int, stages: int, counts: Sequence[int] = ()) -> list[range]:
    """The decoder blocks of each stage, contiguous: `counts` blocks each (the plan's cut), or, without a cut that
    adds up to `layers` (a shape the planner could not read), as even as `layers` allows, the first stages one
    more."""
    if len(counts) != stages or sum(counts) != layers or min(counts, default=0) < 1:
        counts = even_cut(layers, stages)
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def split_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(text positions, rotary positions) of a micro-batch: a text model's (rows, width) serve as both; a
    vision-language model's (rows, 4, width) are its text row and its three M-RoPE rows (3, rows, width)."""
    if position_ids.ndim == 2:
        return position_ids, position_ids
    return position_ids[:, 0], position_ids[:, 1:].transpose(0, 1)


class DecoderStage(nn.Module):
    """One stage of the decoder: `forward(x, position_ids)` takes input ids (first stage) or the previous stage's
    hidden states and returns hidden states (after the final norm on the last stage). `model` is the rank's pruned
    model, under the name the loss module gives it, so that state dicts read as the whole model's."""

    def __init__(self, model: nn.Module, decoder: nn.Module, head: nn.Module | None, stage: int, stages: int,
                 blocks: range, vision: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.stage, self.stages, self.blocks = stage, stages, blocks
        # The dtype autocast computes in (the job's `autocast`), or None: a schedule runs the forward itself, so
        # the stage enters autocast around its own forward.
        self.autocast: torch.dtype | None = None
        # The first stage of a vision-language model: each of the step's micro-batches' images (pixel_values,
        # image_grid_thw), by the micro-batch's index, which the schedule hands over as `micro`.
        self.media: list[dict[str, torch.Tensor]] = []
        # What writes the images' features into their tokens: train/media_forward.py `embed_images`, which the
        # training side (train/pipeline.py) hands over, as the one-process forward runs it.
        self.embed_images: Callable[..., torch.Tensor] | None = None
        # Held outside the module tree (a plain list): they are reached through `model`, which owns them. `vision`:
        # the vision-language body whose tower the first stage runs (None: a text model, or a later stage).
        self._parts: list[Any] = [decoder, head, vision]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def head(self) -> nn.Module | None:
        """The output head (the last stage's, None elsewhere; the loss applies it chunk by chunk)."""
        return self._parts[1]

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP2 shards on its own under zero2/zero3 over the stage's data-parallel ranks: each kept block, in
        order, then the first stage's input embedding when the head does not share it (as parallelize.py's
        `fsdp_units` does for the whole model); the rest (final norm, head) is the stage's root unit."""
        decoder, head = self._parts[0], self._parts[1]
        units = [decoder.layers[str(i)] for i in self.blocks]
        emb = decoder.embed_tokens
        if emb is not None and (head is None or getattr(head, "weight", None) is not emb.weight):
            units.append(emb)
        return units

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, restarts: torch.Tensor | None = None,
                micro: torch.Tensor | None = None) -> torch.Tensor:
        """`restarts`: whether each row restarts its positions (packed examples), a host tensor so that the mask's
        choice never waits for the device; None: read from `position_ids`. `micro`: each row's micro-batch index
        (a host tensor), which picks the first stage's images from `media`."""
        if self.autocast is None:
            return self._forward(x, position_ids, restarts, micro)
        with torch.autocast(position_ids.device.type, dtype=self.autocast):
            return self._forward(x, position_ids, restarts, micro)

    def _forward(self, x: torch.Tensor, position_ids: torch.Tensor, restarts: torch.Tensor | None,
                 micro: torch.Tensor | None) -> torch.Tensor:
        decoder, vision = self._parts[0], self._parts[2]
        text_pos, rope_pos = split_positions(position_ids)
        h = decoder.embed_tokens(x) if self.is_first else x
        if vision is not None:  # the images' features in their tokens
            media = self.media[int(micro[0])] if micro is not None and self.media else {}
            h = self.embed_images(vision, x, h, media.get("pixel_values"), media.get("image_grid_thw"))
        position_embeddings = decoder.rotary_emb(h, rope_pos)
        packed = bool((restarts if restarts is not None else row_restarts(text_pos)).any())
        mask = _mask(decoder.config, text_pos, h.dtype, packed)
        for i in self.blocks:  # this stage's (a rank holds several under an interleaved schedule)
            h = decoder.layers[str(i)](h, attention_mask=mask, position_embeddings=position_embeddings,
                                       position_ids=text_pos, use_cache=False)
        return decoder.norm(h) if self.is_last else h


def row_restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """Per row, whether its positions restart (a packed row of several examples); of the text positions where
    they are a vision-language model's (rows, 4, width)."""
    text, _ = split_positions(position_ids)
    return (torch.diff(text, dim=-1) != 1).any(dim=-1)


def _mask(config: Any, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> torch.Tensor | None:
    """What the one-process forward uses for these rows (models/masks.py): no mask for a micro-batch whose
    positions never restart under SDPA (its causal kernel), else the block-causal mask of the packed examples."""
    if not packed and config._attn_implementation == "sdpa":
        return None
    return block_causal_mask(config, position_ids, dtype)


def cut(model: nn.Module, stage: int, stages: int, counts: Sequence[int] = ()) -> DecoderStage:
    """Prune `model` (a built causal LM, Qwen2-VL or Qwen2.5-VL, peft-wrapped or not) in place to stage `stage`
    of `stages`, with `counts` blocks in each stage (the plan's cut; empty: even), and return the stage module. The
    parts of other stages are dropped, so their memory goes back once nothing else holds them."""
    decoder, head = decoder_and_head(model)
    body = vision_body(model)
    layers = list(decoder.layers)
    blocks = stage_blocks(len(layers), stages, counts)[stage]
    decoder.layers = nn.ModuleDict({str(i): layers[i] for i in blocks})
    if stage != 0:
        decoder.embed_tokens = None
        if body is not None:
            body.visual = None
    if stage != stages - 1:
        decoder.norm = None
        _drop_head(model)
    return DecoderStage(model, decoder, head if stage == stages - 1 else None, stage, stages, blocks,
                        vision=body if stage == 0 else None)


def _drop_head(model: nn.Module) -> None:
    """Remove the output head from the model that holds it (the text model under a peft wrapper)."""
    base = text_model(model)
    for name, module in base.named_children():
        if module is base.get_output_embeddings():
            setattr(base, name, None)
            return


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
