"""The plan of sequence_parallel: a rank's activations and logits divided by N, the all-to-alls in the step."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.plan.activations import all_to_all_bytes
from shardfit.plan.cards import card_of
from shardfit.plan.comms import ulysses_s
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

LONG = Workload(method="lora", seq_len=131072, micro_batch=1, grad_ckpt="full", attention="flash")


@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B"])
def test_a_ranks_activations_shrink_by_n_and_the_step_pays_the_all_to_alls(model: str) -> None:
    """A dense model and a mixture of experts (whose routers and experts act per token: their saved tensors are
    a rank's tokens' too)."""
    shape, hw = resolve_shape(model), parse_gpus("8xH100", 1, None)
    one = estimate(shape, LONG, hw, "zero3").per_gpu_gib
    for n in (2, 4, 8):
        w = dataclasses.replace(LONG, sequence_parallel=n)
        split = estimate(shape, w, hw, "zero3").per_gpu_gib
        short = estimate(shape, dataclasses.replace(LONG, seq_len=LONG.seq_len // n), hw, "zero3").per_gpu_gib
        # A rank's activations are those of seq_len / n tokens (rows of one example: no whole-row mask), the
        # all-to-all buffers at most on top of them; a dense body's divide by n.
        a2a = all_to_all_bytes(shape, w) / 2**30
        assert short.activations <= split.activations <= short.activations + a2a
        assert split.temporaries == short.temporaries
        if not shape.experts:  # a mixture's LoRA on the experts merges their weights: bytes that no n divides
            assert one.activations / n <= split.activations <= one.activations / n + a2a
        assert all_to_all_bytes(shape, w) > 0 and ulysses_s(shape, w, card_of(hw), hw) > 0
        # The same tokens per rank as a rank without the split would forward at seq_len / n, plus the all-to-alls.
        t, short = step_time(shape, w, hw, "zero3"), step_time(shape, dataclasses.replace(
            LONG, seq_len=LONG.seq_len // n), hw, "zero3")
        assert t.step_s > short.step_s
    assert ulysses_s(shape, LONG, card_of(hw), hw) == 0.0 and all_to_all_bytes(shape, LONG) == 0.0


def test_plan_flag_refuses_heads_that_do_not_share_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "8xH100", "--sequence-parallel", "3"]) == 2
    assert "has 32 attention heads" in capsys.readouterr().err


def test_plan_flag_splits_a_mixture_and_refuses_what_the_kernel_cannot_do(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-MoE plans with its rows split (4 key/value heads: repeated to the query heads for 8 ranks, so the
    all-to-alls carry every head); gpt-oss (sliding windows and attention sinks) and DeepSeek-V3 (latent
    attention) are refused with the reason."""
    args = ["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "8xH100", "--seq", "131072", "--batch", "1",
            "--attention", "flash", "--grad-ckpt", "full", "--strategy", "zero3"]
    assert main([*args, "--sequence-parallel", "8"]) == 0
    shape = resolve_shape("Qwen/Qwen3-30B-A3B")
    w = dataclasses.replace(LONG, sequence_parallel=8)
    assert shape.kv_heads % 8 != 0 and all_to_all_bytes(shape, w) == 2 * w.tokens * 2 * 3 * shape.heads * shape.hd
    capsys.readouterr()
    for model, why in (("openai/gpt-oss-20b", "sliding-window"), ("deepseek-ai/DeepSeek-V3", "latent attention")):
        assert main(["plan", "--model", model, "--gpus", "8xH100", "--sequence-parallel", "2"]) == 2
        err = capsys.readouterr().err
        assert why in err and "sequence_parallel: 1" in err and "Traceback" not in err


def test_plan_flag_refuses_a_split_over_more_gpus_than_planned(capsys: pytest.CaptureFixture[str]) -> None:
    """A row split over 16 GPUs cannot run on 8, as train refuses it: the plan said nothing and planned the rows
    whole."""
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8xH100", "--sequence-parallel", "16"]) == 2
    assert "sequence_parallel: 16 does not divide the job's 8 ranks" in capsys.readouterr().err
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8xH100", "--sequence-parallel", "8"]) == 0


@pytest.mark.parametrize("flags", [["--model", "meta-llama/Llama-3.1-8B", "--sequence-parallel", "2"],
                                   ["--model", "Qwen/Qwen3-30B-A3B", "--expert-parallel", "8"]])
def test_plan_flag_refuses_a_split_under_a_preference_objective(flags: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Train refuses a sequence or expert split under DPO (the rule `check_layout` and the experts' rules apply);
    the plan gives the same refusal instead of planning the split."""
    assert main(["plan", *flags, "--gpus", "8xH100", "--objective", "dpo"]) == 2
    assert "trains objective sft only in this version" in capsys.readouterr().err
    assert main(["plan", *flags, "--gpus", "8xH100"]) == 0


def test_a_split_row_rules_out_the_one_process_strategies() -> None:
    """check_layout refuses sequence_parallel under single and model_parallel, so the plan marks them n/a (never
    "fits", never recommended) and names why; the multi-rank strategies keep their rows."""
    shape, hw = resolve_shape("meta-llama/Llama-3.1-8B"), parse_gpus("8x24GB", 1, None)
    w = dataclasses.replace(LONG, seq_len=65536, sequence_parallel=4)
    for name in ("single", "model_parallel"):
        c = estimate(shape, w, hw, name)
        assert not c.applies and "sequence_parallel 4" in c.notes
    assert all(estimate(shape, w, hw, name).applies for name in ("ddp", "zero2", "zero3", "zero3_offload"))
    # without the split, model_parallel is a row like any other
    assert estimate(shape, dataclasses.replace(w, sequence_parallel=1), hw, "model_parallel").applies
