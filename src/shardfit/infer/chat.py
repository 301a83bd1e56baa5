"""The interactive terminal chat: streamed replies, the conversation kept between turns, and slash commands."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch

from shardfit.infer.generate import Messages, Sampling, stream_reply

HELP = "commands: /reset (new conversation), /system TEXT (set the system prompt and reset), /exit (or Ctrl-D)"


def chat_loop(model: torch.nn.Module, tokenizer: Any, sampling: Sampling, *, system: str | None = None,
              read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> int:
    """Read a user line, stream the reply, repeat; returns the number of replies. Ends on /exit or end of input."""
    history: Messages = []
    replies = 0
    print(HELP, file=out, flush=True)
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            print(file=out)
            return replies
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return replies
        if line == "/reset":
            history = []
            print("(conversation cleared)", file=out, flush=True)
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            history = []
            print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)", file=out, flush=True)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=out, flush=True)
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        print("model> ", end="", file=out, flush=True)
        pieces = []
        for piece in stream_reply(model, tokenizer, messages, sampling):
            pieces.append(piece)
            print(piece, end="", file=out, flush=True)
        print(file=out, flush=True)
        history.append({"role": "assistant", "content": "".join(pieces).strip()})
        replies += 1
