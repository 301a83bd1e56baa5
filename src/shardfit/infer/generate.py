"""Generation with the model's own chat template: batches of prompts (left-padded) and one streamed reply."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import TextIteratorStreamer

from shardfit.models.anatomy import input_device

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Sampling:
    """How replies are drawn: greedy at temperature 0 (reproducible), else sampled with top-p."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0

    def kwargs(self, tokenizer: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "pad_token_id": tokenizer.pad_token_id,
                               "use_cache": True}
        if self.temperature > 0:
            out.update(do_sample=True, temperature=self.temperature, top_p=self.top_p)
        else:
            out.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return out


def render(tokenizer: Any, messages: Messages) -> str:
    """The prompt text: the conversation through the chat template, ending where the assistant's reply starts."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _generate(model: torch.nn.Module, tokenizer: Any, prompts: list[Messages], sampling: Sampling,
              synced: bool) -> list[str]:
    enc = tokenizer([render(tokenizer, m) for m in prompts], return_tensors="pt", padding=True,
                    add_special_tokens=False).to(input_device(model))
    extra = {"synced_gpus": True} if synced else {}
    out = model.generate(**enc, **sampling.kwargs(tokenizer), **extra)
    return [tokenizer.decode(seq, skip_special_tokens=True).strip() for seq in out[:, enc["input_ids"].shape[1]:]]


@torch.no_grad()
def generate_batch(model: torch.nn.Module, tokenizer: Any, prompts: list[Messages], sampling: Sampling, *,
                   batch_size: int = 8, show: bool = False, desc: str = "generate") -> list[str]:
    """One reply per conversation of `prompts` (each ending with a user turn), in order."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the right edge of every prompt
    replies: list[str] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, disable=not show, leave=False)
    try:
        for i in range(0, len(prompts), batch_size):
            replies += _generate(model, tokenizer, prompts[i:i + batch_size], sampling, synced=False)
            bar.update(len(prompts[i:i + batch_size]))
    finally:
        tokenizer.padding_side = side
        bar.close()
    return replies


@torch.no_grad()
def generate_sharded(model: torch.nn.Module, tokenizer: Any, prompts: list[Messages], sampling: Sampling, *,
                     rank: int, world: int, batch_size: int = 8) -> list[str]:
    """`generate_batch` with the prompts split over the ranks of a process group; every rank returns all replies.

    Every rank runs the same number of `generate` calls, and each call keeps stepping until every rank's batch is
    finished (transformers' `synced_gpus`), because a sharded model's forward is a collective."""
    mine = prompts[rank::world]
    per_rank = -(-len(prompts) // world)
    calls = -(-per_rank // batch_size)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    replies: list[str] = []
    try:
        for c in range(calls):
            chunk = mine[c * batch_size:(c + 1) * batch_size]
            got = _generate(model, tokenizer, chunk or prompts[:1], sampling, synced=world > 1)
            replies += got if chunk else []
    finally:
        tokenizer.padding_side = side
    if world == 1:
        return replies
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, replies)
    out: list[str] = [""] * len(prompts)
    for r, theirs in enumerate(gathered):
        for k, text in enumerate(theirs or []):
            out[r + k * world] = text
    return out


def stream_reply(model: torch.nn.Module, tokenizer: Any, messages: Messages, sampling: Sampling) -> Iterator[str]:
    """The reply to `messages`, yielded piece by piece as it is generated (generate runs in a thread)."""
    enc = tokenizer(render(tokenizer, messages), return_tensors="pt", add_special_tokens=False).to(
        input_device(model))
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                model.generate(**enc, **sampling.kwargs(tokenizer), streamer=streamer)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failure.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if failure:
        raise failure[0]
