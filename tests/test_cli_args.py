"""The command line's argument types: lengths in the shorthand users write, and what they refuse."""

from __future__ import annotations

import argparse

import pytest

from shardfit.cli.args import token_count
from shardfit.cli.main import build_parser, main


@pytest.mark.parametrize(("text", "tokens"), [("2048", 2048), ("8k", 8192), ("32K", 32768), (" 128k ", 131072)])
def test_a_length_reads_plain_or_in_k_of_1024(text: str, tokens: int) -> None:
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["8.5k", "k", "8kk", "-1k", "8 k", "eight", "1e4", "²k", "8²"])
def test_a_length_that_is_not_a_whole_count_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="a length like 8k"):
        token_count(text)


def test_plan_reads_the_shorthand_as_the_same_job(capsys: pytest.CaptureFixture) -> None:
    """`--seq 8k` plans exactly what `--seq 8192` plans."""
    outputs = []
    for seq in ("8k", "8192"):
        assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "2x3090", "--seq", seq, "--json"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and '"seq_len": 8192' in outputs[0]


@pytest.mark.parametrize(("text", "tokens"), [("4k", 4096), ("3000", 3000)])
def test_eval_reads_its_max_seq_len_as_plan_reads_seq(text: str, tokens: int) -> None:
    """`eval --max-seq-len` is the same kind of length as `plan --seq`: a user who plans at 8k evaluates at 8k."""
    argv = ["eval", "runs/demo", "--data", "heldout.jsonl", "--max-seq-len", text]
    assert build_parser(argv).parse_args(argv).max_seq_len == tokens
