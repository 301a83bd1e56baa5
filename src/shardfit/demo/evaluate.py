"""Exact-match accuracy of greedy answers on held-out prompts, and the before/after table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardfit.data.formats import to_messages
from shardfit.infer.generate import Sampling, generate_batch


@dataclass
class Answered:
    prompt: str
    expected: str
    answer: str

    @property
    def correct(self) -> bool:
        return self.answer.strip() == self.expected.strip()


@torch.no_grad()
def generate_answers(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], fmt: str = "alpaca",
                     max_new_tokens: int = 40, batch_size: int = 16, *, show: bool = False,
                     desc: str = "answers") -> list[Answered]:
    """Greedy answers for the user turns of `rows`, compared with each row's last assistant turn; `show`: a
    progress bar (generation takes a while on a CPU, and a silent minute looks like a hang)."""
    model.eval()
    device = next(model.parameters()).device
    # CPUs without bf16 matrix units run bf16 matmuls several times slower than fp32 (3x for greedy decoding here),
    # so on the CPU the model generates in fp32 and gets its own dtypes back afterwards (a lossless round trip).
    dtypes = {name: p.dtype for name, p in model.named_parameters()} if device.type == "cpu" else {}
    if dtypes:
        model.float()
    convs = [to_messages(r, fmt) for r in rows]
    try:
        replies = generate_batch(model, tokenizer, [c[:-1] for c in convs], Sampling(max_new_tokens),
                                 batch_size=batch_size, show=show, desc=desc)
    finally:
        for name, p in model.named_parameters():
            if name in dtypes:
                p.data = p.data.to(dtypes[name])
    return [Answered(c[-2]["content"], c[-1]["content"], text) for c, text in zip(convs, replies, strict=True)]


def accuracy(answers: list[Answered]) -> float:
    return sum(a.correct for a in answers) / max(1, len(answers))


def report(before: list[Answered], after: list[Answered], samples: int = 3) -> str:
    """A printable before/after table with a few sample answers."""
    lines = ["", "Held-out exact-match accuracy (names and cities never seen in training)",
             f"  {'model':<34}{'correct':>10}{'accuracy':>11}",
             f"  {'SmolLM2-135M-Instruct (base)':<34}{sum(a.correct for a in before):>6}/{len(before):<3}"
             f"{accuracy(before):>11.1%}",
             f"  {'+ shardfit LoRA fine-tune':<34}{sum(a.correct for a in after):>6}/{len(after):<3}"
             f"{accuracy(after):>11.1%}", ""]
    for b, a in list(zip(before, after, strict=True))[:samples]:
        note = b.prompt.splitlines()[-1]
        lines += [f"  note:     {note}", f"  expected: {a.expected}",
                  f"  base:     {_short(b.answer)}", f"  tuned:    {a.answer}  {'OK' if a.correct else 'WRONG'}", ""]
    return "\n".join(lines)


def _short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
