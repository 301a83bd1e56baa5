"""Chat-template tokenisation with labels on assistant tokens only.

The conversation is rendered once by the tokenizer's own chat template. Each assistant turn's character span is
found by rendering the prefix up to it, so the span covers exactly what the template emits for that turn (content
and end-of-turn marker). Tokens whose text starts inside a span are trained; everything else is masked to -100.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

IGNORE = -100

# Used only when a tokenizer ships no template (tiny test tokenizers, some base models): ChatML, as Qwen and SmolLM use.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SeqInfo:
    """A preference side's place in its micro-batch (`tag`: pair i's chosen is 2i, its rejected 2i+1; KTO row i is
    i), the reference model's log-probability of its answer once computed, and a KTO row's desirability."""

    tag: int
    ref_logp: float | None = None
    desirable: bool | None = None


@dataclass
class Encoded:
    """One tokenised example. `targets[t]` is the label for the prediction made at position t (already shifted)."""

    input_ids: list[int]
    targets: list[int]
    truncated: bool = False  # cut at max_len
    # Vision-language examples (data/vision.py): 3-D M-RoPE positions (3 lists of len(input_ids)), the example's
    # images (an ImagePixels, decoded per batch) and their (t, h, w) grids, its audio clips (an AudioClips, decoded
    # per batch), its videos (a VideoPixels) and their grids. None for text.
    mrope: list[list[int]] | None = None
    pixel_values: Any = None
    image_grid_thw: Any = None
    audio: Any = None
    video: Any = None
    video_grid_thw: Any = None
    seq: SeqInfo | None = None  # preference sides only (data/preference.py)

    @functools.cached_property
    def n_targets(self) -> int:
        """Labelled positions, counted once: every optimizer step sums them over its global batch (`targets` is
        never changed after encoding)."""
        return sum(1 for t in self.targets if t != IGNORE)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def units(self) -> int:
        """Terms of the loss this example adds: the SFT loss is a mean over labelled tokens."""
        return self.n_targets


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a template-less tokenizer ChatML, so every model can format turns the same way."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]],
                    label_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of every assistant turn from message `label_from` on
    (a preference answer: the assistant turns of the prompt's history are context, not trained)."""
    text = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i < label_from:
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if text.startswith(before) and text.startswith(through):
            start, end = len(before), len(through)
        else:
            # Templates that rewrite earlier turns (e.g. strip reasoning) are not prefix-stable: find the content.
            start = text.find(msg["content"], search_from)
            if start < 0:
                continue
            end = start + len(msg["content"])
        spans.append((start, end))
        search_from = end
    return text, spans


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], max_len: int, label_from: int = 0) -> Encoded:
    """Tokenise a conversation, label assistant tokens (of the turns from `label_from` on), shift labels, and
    truncate to `max_len`."""
    text, spans = assistant_spans(tokenizer, messages, label_from)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    for k, (a, _b) in enumerate(enc["offset_mapping"]):
        for s, e in spans:
            if s <= a < e:
                labels[k] = ids[k]
                break
    truncated = len(ids) > max_len
    ids, labels = ids[:max_len], labels[:max_len]
    targets = labels[1:] + [IGNORE]
    return Encoded(ids, targets, truncated)
