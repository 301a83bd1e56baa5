"""docs/long-context.md's tables of a 131,072-token row split over N ranks are what `plan` prints today: each row's
activations, total, step and tokens/s for N = 1, 2, 4, 8."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardfit.cli.main import main

PAGE = Path(__file__).resolve().parent.parent / "docs" / "long-context.md"
MODELS = {"Qwen/Qwen3-8B": ["--method", "lora"], "Qwen/Qwen3-30B-A3B": []}


def _tables() -> list[list[tuple[str, ...]]]:
    blocks = re.findall(r"\| N \| activations GiB per GPU \| total GiB \| step \| job tokens/s \|\n\|[-|]+\|\n"
                        r"((?:\|[^\n]*\|\n)+)", PAGE.read_text())
    return [[tuple(c.strip() for c in line.strip("|").split("|")) for line in b.splitlines()] for b in blocks]


@pytest.mark.parametrize(("model", "table"), zip(MODELS, _tables(), strict=True), ids=list(MODELS))
def test_split_tables_are_what_plan_prints(model: str, table: list[tuple[str, ...]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert [row[0] for row in table] == ["1", "2", "4", "8"]
    for n, activ, total, step, tokens in table:
        split = ["--sequence-parallel", n] if n != "1" else []
        main(["plan", "--model", model, *MODELS[model], "--gpus", "8xH100", "--seq", "131072", "--batch", "1",
              "--attention", "flash", "--grad-ckpt", "full", "--strategy", "zero3", *split, "--json"])
        c = json.loads(capsys.readouterr().out)["candidates"][0]
        assert f"{c['per_gpu_gib']['activations']:.1f}" == activ, (model, n)
        assert f"{c['per_gpu_gib']['total']:.1f}" == total, (model, n)
        assert step == f"{c['step_s']:.1f} s" and tokens == f"{c['tokens_per_s']:,.0f}", (model, n)


def test_the_million_token_row_is_what_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The page's 1,048,576-token row of Qwen3-8B split over 8 ranks: LoRA's total and tokens/s, full's total."""
    said = " ".join(PAGE.read_text().split())
    for method in ("lora", "full"):
        main(["plan", "--model", "Qwen/Qwen3-8B", "--method", method, "--gpus", "8xH100", "--seq", "1048576",
              "--batch", "1", "--attention", "flash", "--grad-ckpt", "full", "--strategy", "zero3",
              "--sequence-parallel", "8", "--json"])
        c = json.loads(capsys.readouterr().out)["candidates"][0]
        total = f"{c['per_gpu_gib']['total']:.1f} GiB"
        assert (f"LoRA at {total} per GPU and {c['tokens_per_s']:,.0f} tokens/s" if method == "lora"
                else f"a full fine-tune at {total}") in said, method
