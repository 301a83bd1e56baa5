"""The plan of stages x data parallelism (plan/pipeline.py with `dp` > 1): each stage's memory under the strategy
over its data-parallel GPUs, the bubble of each replica's micro-batches, the stage's gradient reduction, and what
`plan`, `check` and `strategy: auto` make of them. Torch-free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardfit import strategy as strategies
from shardfit.check.pipeline_rules import pipeline_plan_rules
from shardfit.config import Config
from shardfit.errors import PlannerBug
from shardfit.plan import pipeline
from shardfit.plan.comms import stage_sync_s
from shardfit.plan.estimate import Breakdown
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.pipeline import bubble, held_by_pipeline, plan_pipeline, stage_breakdown, stage_gib
from shardfit.plan.precision import compute_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload, workload_of
from shardfit.resolve import DeviceFacts, resolve_job
from tests.helpers import run_here

MODEL = "meta-llama/Llama-3.1-8B"


def _w(**over):
    keys = dict(precision="bf16", seq_len=2048, micro_batch=1, grad_ckpt="full", grad_accum=16)
    return dataclasses.replace(workload_of(Config()), **{**keys, **over})


def test_zero3_shards_a_stages_optimizer_and_masters_over_its_ranks() -> None:
    """A full fine-tune's middle stage (8 blocks) on 2 and 4 data-parallel GPUs: the strategy's rules over those
    GPUs decide, zero3's optimizer states are ddp's / dp exactly, its fp32 masters too (plus the 16-bit copy the
    pipeline keeps gathered), its gradients are accumulated unsharded as under ddp; so the stage's peak falls from
    ddp to zero3 and again from 2 to 4 ranks."""
    shape, w = resolve_shape(MODEL), _w(method="full")
    hw8, hw16 = parse_gpus("8x80GB", 1, None), parse_gpus("8x80GB", 2, None)
    ddp = stage_breakdown(shape, w, hw8, 4, 1, 8, 2, "ddp")
    z2, z4 = stage_breakdown(shape, w, hw8, 4, 1, 8, 2, "zero3"), stage_breakdown(shape, w, hw16, 4, 1, 8, 4, "zero3")
    assert z2.optimizer == pytest.approx(ddp.optimizer / 2) and z4.optimizer == pytest.approx(ddp.optimizer / 4)
    low = compute_bytes(w) / 4  # the gathered 16-bit copy of each fp32 master
    assert z2.weights == pytest.approx(ddp.weights * (1 / 2 + low), rel=1e-6)
    assert z4.weights == pytest.approx(ddp.weights * (1 / 4 + low), rel=1e-6)
    assert z2.grads == pytest.approx(ddp.grads, rel=1e-6) == z4.grads
    peaks = [stage_gib(shape, w, hw8, 4, 1, 8, 2, "ddp"), stage_gib(shape, w, hw8, 4, 1, 8, 2, "zero3"),
             stage_gib(shape, w, hw16, 4, 1, 8, 4, "zero3")]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] - peaks[2] > 0.7 * ddp.optimizer


def test_the_pipeline_keeps_fsdp2_gathered_and_unreduced_until_the_step_ends() -> None:
    """torch's PipelineStage turns FSDP2's gradient sync and resharding after backward off until the last
    backward: zero2 and zero3 hold the unsharded gradients, zero3 the gathered 16-bit weights beside its shards;
    DDP and one rank per stage are untouched."""
    w = _w(method="lora")
    for name, weights, grads in (("ddp", 10.0, 1.0), ("zero2", 10.0, 4.0), ("zero3", 10.0 + 40.0, 4.0)):
        b = Breakdown(weights=10.0, grads=1.0)
        held_by_pipeline(b, w, strategies.get(name), 4)
        assert (b.weights, b.grads) == (pytest.approx(weights), pytest.approx(grads)), name
    one = Breakdown(weights=10.0, grads=1.0)
    held_by_pipeline(one, w, strategies.get("zero3"), 1)
    assert (one.weights, one.grads) == (10.0, 1.0)


def test_each_replica_runs_grad_accum_micro_batches_and_reduces_its_stage() -> None:
    """4 stages x 2 ddp replicas on 8 one-GPU nodes against 4 stages on 4 of them: each replica runs the step's 16
    micro-batches (the bubble 3/19, as train runs it: the global batch is 2 x 16 micro-batches), so the step is one
    pipeline's plus what the last backward does not hide of the stages' gradient all-reduce over the network, and
    the job trains twice the tokens in it."""
    shape, w = resolve_shape(MODEL), _w(method="full")
    one = plan_pipeline(shape, w, parse_gpus("1x80GB", 4, None), 4)
    two = plan_pipeline(shape, w, parse_gpus("1x80GB", 8, None), 4, dp=2, strategy="ddp")
    assert two.bubble == pytest.approx(bubble(4, 16)) == pytest.approx(3 / 19) and two.micro_batches == 16
    assert two.cut == one.cut == (8, 8, 8, 8) and two.p2p_s == pytest.approx(one.p2p_s)
    assert two.sync_s > 0 and two.step_s == pytest.approx(one.step_s + two.sync_s)
    assert two.tokens_per_s == pytest.approx(w.tokens * 16 * 2 / two.step_s)
    assert two.layout == "pipeline_parallel=4 x ddp 2" and one.layout == "pipeline_parallel=4"
    fewer = plan_pipeline(shape, dataclasses.replace(w, grad_accum=4), parse_gpus("1x80GB", 8, None), 4, dp=2,
                          strategy="ddp")
    assert fewer.bubble == pytest.approx(3 / 7)  # fewer micro-batches per replica: a larger bubble


def test_the_reduction_runs_over_the_link_between_a_stages_ranks() -> None:
    """The same stage's gradients reduced over 2 GPUs of one node, and over 16 GPUs of two nodes (the network):
    zero2 and zero3 reduce-scatter once a step, zero3 gathers once per micro-batch, zero2 once a step."""
    shape, w = dataclasses.replace(resolve_shape(MODEL), layers=8), _w(method="full")
    node, two_nodes = parse_gpus("2xH100", 1, None), parse_gpus("8xH100", 2, None)
    _, _, near = stage_sync_s(shape, w, node, "zero2")
    _, _, far = stage_sync_s(shape, w, two_nodes, "zero2")
    assert 0 < near < far
    assert stage_sync_s(shape, w, node, "zero3")[0] > 0 == stage_sync_s(shape, w, node, "zero2")[0]
    assert stage_sync_s(shape, w, node, "zero2")[1] > 0 == stage_sync_s(shape, w, node, "zero3")[1]
    assert stage_sync_s(shape, w, parse_gpus("1xH100", 1, None), "zero3") == (0.0, 0.0, 0.0)


def test_plan_cli_shows_the_layout_row_of_8_gpus(capsys: pytest.CaptureFixture) -> None:
    """`plan --gpus 8x80GB --pipeline-parallel 4 --strategy zero3`: a row named pipeline_parallel=4 x zero3 2 with
    the numbers plan_pipeline gives, and the same in --json; a count that does not divide the GPUs is exit 2."""
    args = ("plan", "--model", MODEL, "--gpus", "8x80GB", "--method", "full", "--seq", "2048", "--batch", "1",
            "--grad-ckpt", "full", "--grad-accum", "16", "--pipeline-parallel", "4", "--strategy", "zero3")
    code, out, err = run_here(capsys, *args)
    assert code in (0, 3), err
    want = plan_pipeline(resolve_shape(MODEL), _w(method="full"), parse_gpus("8x80GB", 1, None), 4, dp=2,
                         strategy="zero3")
    assert want.row() in out and "pipeline_parallel=4 x zero3 2: 4 stages x 16 micro-batches per replica" in out
    d = json.loads(run_here(capsys, *args, "--json")[1])["pipeline"]
    assert d["layout"] == "pipeline_parallel=4 x zero3 2" and d["dp"] == 2 and d["strategy"] == "zero3"
    assert d["stage_gib"] == pytest.approx(want.stage_gib, abs=1e-3) and [x["layout"] for x in d["layouts"]] == \
        ["pipeline_parallel=4 x zero3 2"]
    code, _, err = run_here(capsys, "plan", "--model", MODEL, "--gpus", "8x80GB", "--grad-accum", "16",
                            "--pipeline-parallel", "3")
    assert code == 2 and "pipeline_parallel: 3 does not divide the job's 8 ranks" in err
    assert "1, 2, 4, 8" in err and "Traceback" not in err


def _job(**over) -> Config:
    keys = dict(model=MODEL, pipeline_parallel=4, grad_accum=16, method="full", max_seq_len=2048, micro_batch=1,
                grad_ckpt="full", precision="bf16")
    return dataclasses.replace(Config(), **{**keys, **over})


def test_check_and_auto_judge_the_stages_on_their_data_parallel_ranks() -> None:
    """A full fine-tune of 8B in 4 stages on 8 x 38 GB: ddp's replicated states do not fit a stage, zero3's shards
    do. `strategy: auto` picks a strategy whose stages fit and cuts for it; check's verdict names the layout."""
    node = parse_gpus("8x38GB", 1, None)
    job, plan = resolve_job(_job(strategy="auto"), node, DeviceFacts("cuda", True), nproc=8)
    assert job.strategy in ("zero2", "zero3") and "over each stage's 2 ranks" in job.why[0]
    assert sum(job.stage_layers) == 32
    [f] = pipeline_plan_rules(_job(strategy="ddp"), plan, "ddp")
    assert f.severity == "error" and "pipeline_parallel=4 x ddp 2" in f.message
    assert pipeline_plan_rules(_job(strategy="zero3"), plan, "zero3") == []


def test_a_stage_s_optimizer_peak_has_no_head_gather_to_remove() -> None:
    """Qwen1.5-7B full fine-tune in 4 stages of zero3 over 2 ranks: where a non-last stage peaks in the optimizer
    step (no gathered head among its temporaries) nothing is taken from its temporaries; in forward or backward the
    head's gathered copy is."""
    shape, hw = resolve_shape("Qwen/Qwen1.5-7B"), parse_gpus("8xH100", 1, None)
    w = Workload(method="full", precision="bf16", grad_accum=4)
    for stage in range(4):
        b = stage_breakdown(shape, w, hw, 4, stage, shape.layers // 4, 2, "zero3")
        assert b.temporaries >= 0
        stage_gib(shape, w, hw, 4, stage, shape.layers // 4, 2, "zero3")


def test_a_negative_stage_part_is_a_planner_bug_not_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage breakdown below zero in any part raises PlannerBug, as a strategy's does (estimate.py
    `check_not_negative`), instead of reading as zero."""
    monkeypatch.setattr(pipeline, "stage_breakdown", lambda *a, **k: Breakdown(1.0, 0.0, 0.0, 1.0, 0.0, -0.5))
    with pytest.raises(PlannerBug, match="temporaries"):
        stage_gib(resolve_shape("Qwen/Qwen1.5-7B"), Workload(), parse_gpus("2xH100", 1, None), 2, 0, 16)
