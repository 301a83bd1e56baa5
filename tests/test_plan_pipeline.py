"""The plan of a pipeline (plan/pipeline.py, `plan --pipeline-parallel N`): the bubble, the first stage's memory
and the step time against the one-GPU figures they come from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardfit.config import Config
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.pipeline import bubble, in_flight, plan_pipeline
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import workload_of
from tests.helpers import run_here

MODEL = "meta-llama/Llama-3.1-8B"


def _w(**over):
    return dataclasses.replace(workload_of(Config()), precision="bf16", seq_len=2048, micro_batch=1,
                               grad_ckpt="full", **over)


def test_bubble_is_the_schedules_idle_share() -> None:
    assert bubble(8, 16) == pytest.approx(7 / 23)
    assert bubble(2, 2) == pytest.approx(1 / 3) and bubble(1, 4) == 0


def test_interleaving_shrinks_the_bubble_for_more_activations_in_flight() -> None:
    """V stages per GPU: the bubble (stages-1)/(V x micro-batches + stages-1); the first GPU keeps torch's warm-up
    chunks in flight, each 1/V of its blocks (8 GPUs x 2, 16 micro-batches: 8 + 14 + 1 chunks = 11.5 micro-batches'
    worth against 1F1B's 8); the step is shorter and the first GPU fuller; more hidden states cross the links."""
    assert bubble(8, 16, 2) == pytest.approx(7 / 39) and bubble(4, 8, 1) == bubble(4, 8)
    assert in_flight(8, 16) == 8 and in_flight(8, 16, 2) == pytest.approx(23 / 2)
    assert in_flight(2, 2, 2) == pytest.approx(4 / 2)  # capped at every chunk of the step
    shape, hw = resolve_shape(MODEL), parse_gpus("4x24GB", 1, None)
    w = _w(grad_accum=16)
    flat, looped = plan_pipeline(shape, w, hw, 4), plan_pipeline(shape, w, hw, 4, per_rank=2)
    assert looped.bubble == pytest.approx(3 / 35) and looped.per_rank == 2 and looped.blocks_per_stage == 8
    assert looped.step_s < flat.step_s and looped.stage_gib > flat.stage_gib and looped.p2p_s > flat.p2p_s
    assert "interleaved 1F1B, 2 stages per GPU" in looped.describe()



def test_zero_bubble_fills_the_bubble_with_weight_gradients(capsys: pytest.CaptureFixture) -> None:
    """Zero bubble over the same looped stages: the idle time is one forward per hop, (stages-1)/(3 x V x
    micro-batches + stages-1); one forward per hop ahead in the warm-up (8 + 7 + 1 chunks = 8 micro-batches'
    worth on 8 GPUs x 2, 16 micro-batches); the step is shorter than interleaved 1F1B's with the same sends, and
    the plan's command line names the schedule."""
    assert bubble(8, 16, 2, split_backward=True) == pytest.approx(7 / 103)
    assert in_flight(8, 16, 2, split_backward=True) == pytest.approx(16 / 2)
    shape, hw = resolve_shape(MODEL), parse_gpus("4x24GB", 1, None)
    w = _w(grad_accum=16)
    looped = plan_pipeline(shape, w, hw, 4, per_rank=2)
    zb = plan_pipeline(shape, w, hw, 4, per_rank=2, schedule="zero_bubble")
    assert zb.bubble == pytest.approx(3 / 99) and zb.schedule == "zero_bubble" and zb.p2p_s == looped.p2p_s
    assert zb.step_s < looped.step_s and zb.stage_gib < looped.stage_gib
    assert "zero bubble, 2 stages per GPU" in zb.describe()
    _, out, _ = run_here(capsys, "plan", "--model", MODEL, "--gpus", "4x24GB", "--grad-accum", "16",
                         "--pipeline-parallel", "4", "--pipeline-schedule", "zero_bubble", "--json")
    pipe = json.loads(out)["pipeline"]
    assert pipe["schedule"] == "zero_bubble" and pipe["per_rank"] == 2
    assert pipe["bubble"] == pytest.approx(3 / 99, abs=1e-4)

def test_more_stages_hold_less_and_run_faster_than_one_gpu_at_a_time() -> None:
    """Stages split the blocks (less memory each, though the first holds more micro-batches in flight); with 16
    micro-batches, 4 stages beat model_parallel (the same split, one GPU busy at a time) by about 4 x 16/19."""
    shape, hw = resolve_shape(MODEL), parse_gpus("4x24GB", 1, None)
    w = _w(grad_accum=16)
    two, four = plan_pipeline(shape, w, hw, 2), plan_pipeline(shape, w, hw, 4)
    assert four.stage_gib < two.stage_gib and four.blocks_per_stage == 8
    assert four.bubble == pytest.approx(3 / 19) and four.p2p_s > 0
    mp = next(c for c in make_plan(shape, w, hw).candidates if c.strategy == "model_parallel")
    assert four.step_s == pytest.approx(mp.step_s * 19 / 16 / 4, rel=0.1)


def test_plan_cli_shows_the_pipeline_and_refuses_more_stages_than_blocks(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_here(capsys, "plan", "--model", MODEL, "--gpus", "4x24GB", "--grad-accum", "8",
                              "--pipeline-parallel", "4", "--json")
    assert code in (0, 3), err
    pipe = json.loads(out)["pipeline"]
    assert pipe["stages"] == 4 and pipe["micro_batches"] == 8 and pipe["note"] == ""
    _, out, _ = run_here(capsys, "plan", "--model", MODEL, "--gpus", "4x24GB", "--grad-accum", "8",
                         "--pipeline-parallel", "4", "--pipeline-stages-per-rank", "2", "--json")
    pipe = json.loads(out)["pipeline"]
    assert pipe["per_rank"] == 2 and pipe["bubble"] == pytest.approx(3 / 19, abs=1e-4)
    code, _, err = run_here(capsys, "plan", "--model", MODEL, "--gpus", "4x24GB", "--pipeline-parallel", "4",
                            "--pipeline-stages-per-rank", "16")
    assert code == 2 and "4 x 16 stages" in err and "Traceback" not in err
    code, _, err = run_here(capsys, "plan", "--model", MODEL, "--gpus", "4x24GB", "--pipeline-parallel", "64")
    assert code == 2 and "32 decoder blocks" in err and "Traceback" not in err


@pytest.mark.parametrize("model", ["zai-org/GLM-4.5", "deepseek-ai/DeepSeek-V3"])
@pytest.mark.parametrize(("stages", "per_rank"), [(4, 1), (8, 1), (8, 2)])
def test_a_mixtures_dense_first_blocks_belong_to_the_stages_that_hold_them(model: str, stages: int,
                                                                            per_rank: int) -> None:
    """GLM-4.5's and DeepSeek-V3's first three blocks are dense. A stage of fewer blocks than that was planned as
    three dense blocks and a negative number of expert blocks (an internal error out of `plan
    --pipeline-parallel`); now each stage holds the dense blocks its range of blocks holds, three in all."""
    from shardfit.plan.pipeline import blocks_shape, stage_blocks

    shape = resolve_shape(model)
    w = dataclasses.replace(workload_of(Config(model=model, data="d.jsonl", method="lora", max_seq_len=2048)),
                            grad_ckpt="none")
    pipe = plan_pipeline(shape, w, parse_gpus(f"{stages}x80GB"), stages // per_rank if per_rank > 1 else stages,
                         per_rank=per_rank)
    assert all(g > 0 for g in pipe.stage_gibs)
    if per_rank == 1:
        starts = [sum(pipe.cut[:s]) for s in range(stages)]
        held = [stage_blocks(shape, s, b, f) for s, (b, f) in enumerate(zip(pipe.cut, starts, strict=True))]
        assert sum(h.dense_layers for h in held) == shape.dense_layers == 3
        assert all(h.moe_layers >= 0 for h in held)
    assert blocks_shape(shape, [range(0, 2)]).dense_layers == 2 and blocks_shape(shape, [range(2, 9)]).dense_layers == 1


def test_a_stage_whose_peak_holds_no_gradients_keeps_none_of_the_heads() -> None:
    """A full fine-tune's stage peaks at the whole model's loss of its one micro-batch, before any gradient exists;
    the first stage's share then subtracted the untied head's gradients from none (an internal error out of
    `plan --pipeline-parallel 2` on Llama-3-70B over 8 GPUs). It holds none of them, and no part is negative."""
    from shardfit.plan.pipeline import stage_breakdown, stage_cut

    shape = resolve_shape("meta-llama/Meta-Llama-3-70B")
    w = workload_of(Config(model="meta-llama/Meta-Llama-3-70B", data="d.jsonl", method="full", max_seq_len=1024))
    hw = parse_gpus("8xH100")
    for blocks in (1, 2, *stage_cut(shape, w, hw, 2, 4, "zero2")):
        b = stage_breakdown(shape, w, hw, 2, 0, blocks, 4, "zero2")
        assert min(b.weights, b.grads, b.optimizer, b.activations, b.temporaries) >= 0 and b.grads == 0


@pytest.mark.parametrize("model", ["Qwen/Qwen3.5-9B", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                                   "meta-llama/Llama-4-Maverick-17B-128E-Instruct", "google/gemma-3-12b-it"])
def test_a_share_of_an_interleaved_model_holds_its_kinds_in_proportion(model: str) -> None:
    """A hybrid's linear-attention or windowed blocks and Llama 4's interleaved dense blocks sit all through the
    model: a stage was planned with the whole model's counts of them (Qwen3.5-9B's one-block stage: 24 linear
    blocks, -3,747 GiB of activations, an internal error out of `plan`). A share holds each kind in proportion,
    never more of one, or of any two, than its blocks."""
    from shardfit.plan.pipeline import INTERLEAVED, blocks_shape

    shape = resolve_shape(model)
    for blocks in (1, 2, 5, shape.layers // 2, shape.layers):
        part = blocks_shape(shape, [range(0, blocks)])
        kinds = [getattr(part, k) for k in INTERLEAVED] + [g.blocks for g in part.attention_groups]
        assert part.layers == blocks and all(0 <= k <= blocks for k in kinds) and 0 <= part.dense_layers <= blocks
        assert part.mamba_layers + part.attention_layers <= blocks
    assert blocks_shape(shape, [range(0, shape.layers)]) == shape
    w = dataclasses.replace(workload_of(Config(model=model, data="d.jsonl", method="lora", max_seq_len=2048)),
                            grad_ckpt="none")
    assert all(g > 0 for g in plan_pipeline(shape, w, parse_gpus("8x80GB"), 8).stage_gibs)


@pytest.mark.parametrize(("model", "gpus", "stages", "grad_ckpt"), [
    ("meta-llama/Meta-Llama-3-8B", "8xH100", 2, "full"), ("google/gemma-2b", "3xH100", 3, "none")])
def test_a_stage_read_within_the_backward_keeps_what_it_reached(model: str, gpus: str, stages: int,
                                                                 grad_ckpt: str) -> None:
    """Within the backward the estimate's moment may hold none of the head's gradients yet (the blocks' moments
    before the end) or not the tied matrix's: nothing held by other stages is taken off there, so no stage reads a
    negative gradient (both were internal errors out of `plan --pipeline-parallel`)."""
    from shardfit.plan.pipeline import stage_breakdown

    shape = resolve_shape(model)
    w = dataclasses.replace(workload_of(Config(model=model, data="d.jsonl", method="full", max_seq_len=2048)),
                            grad_ckpt=grad_ckpt, seq_len=8192 if grad_ckpt == "full" else 2048)
    hw = parse_gpus(gpus)
    pipe = plan_pipeline(shape, w, hw, stages)
    for s, b in enumerate(pipe.cut):
        assert stage_breakdown(shape, w, hw, stages, s, b, 1, "single", sum(pipe.cut[:s])).grads >= 0


def test_a_dense_first_mixtures_first_stage_is_cut_by_its_expert_blocks() -> None:
    """Read at one and two blocks, GLM-4.5's first stage cost a dense block per block, and the cut piled 62 of 92
    blocks on it (1,119 GiB) when nothing fit; read past its three dense blocks, the cut is even."""
    shape = resolve_shape("zai-org/GLM-4.5")
    w = workload_of(Config(model="zai-org/GLM-4.5", data="d.jsonl", method="lora", max_seq_len=1024))
    pipe = plan_pipeline(shape, w, parse_gpus("4x141GB"), 4)
    assert max(pipe.cut) - min(pipe.cut) <= 4
