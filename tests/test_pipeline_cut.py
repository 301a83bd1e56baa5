"""Where a pipeline's stages are cut (plan/pipeline.py `stage_cut`): blocks placed so the stages' memory peaks are
as even as they can be, the plan reporting each stage, and the runtime cutting where the plan says."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from shardfit.check.pipeline_rules import pipeline_plan_rules
from shardfit.config import Config
from shardfit.errors import DoesNotFitError
from shardfit.parallel.pipeline import cut, stage_blocks
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.pipeline import balance, even_cut, plan_pipeline, stage_cut, stage_gib, versus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import workload_of
from shardfit.resolve import DeviceFacts, resolve_job
from tests.helpers import run_here

SEED_002 = "Qwen/Qwen2-VL-72B-Instruct"


def _w(**over):
    return dataclasses.replace(workload_of(Config()), precision="bf16", seq_len=2048, micro_batch=1,
                               grad_ckpt="full", grad_accum=16, **over)


def test_equal_stages_are_cut_evenly_the_first_taking_the_rest() -> None:
    assert balance(8, [1.0] * 4, [2.0] * 4) == [2, 2, 2, 2]
    assert balance(10, [1.0] * 4, [2.0] * 4) == even_cut(10, 4) == [3, 3, 2, 2]
    assert stage_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_a_heavier_first_stage_gets_fewer_blocks() -> None:
    assert balance(12, [5.0, 0.0, 0.0], [1.0] * 3) == [1, 6, 5]
    assert balance(12, [0.0] * 3, [3.0, 1.0, 1.0]) == [2, 5, 5]


def test_balance_is_the_smallest_largest_stage_of_all_cuts() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n, layers = rng.randint(2, 4), rng.randint(4, 9)
        fixed = [rng.uniform(0, 5) for _ in range(n)]
        per = [rng.uniform(0.1, 2) for _ in range(n)]
        cuts = [c for c in itertools.product(range(1, layers + 1), repeat=n) if sum(c) == layers]
        best = min(_largest(c, fixed, per) for c in cuts)
        got = balance(layers, fixed, per)
        assert sum(got) == layers and min(got) >= 1 and _largest(got, fixed, per) == pytest.approx(best)


def _largest(cut: tuple[int, ...] | list[int], fixed: list[float], per: list[float]) -> float:
    return max(f + b * p for f, b, p in zip(fixed, cut, per, strict=True))


def test_seed_002_moves_blocks_off_the_first_stage_and_evens_the_peaks() -> None:
    """72B Qwen2-VL LoRA over 8 stages of 24 GB: the even cut's first stage (embedding, vision tower, 8
    micro-batches in flight) does not fit; the cut gives it fewer than 80/8 blocks, every stage fits, and the
    spread of the stages' peaks is smaller than the even cut's. On 80 GB cards the even cut fits and is the
    fastest (the fewest blocks on the fullest stage), so it stays."""
    shape, hw = resolve_shape(SEED_002), parse_gpus("8x24GB", 1, None)
    w = _w(method="lora")
    c = stage_cut(shape, w, hw, 8)
    assert sum(c) == 80 and c[0] < 10
    peaks = [stage_gib(shape, w, hw, 8, s, b) for s, b in enumerate(c)]
    even = [stage_gib(shape, w, hw, 8, s, b) for s, b in enumerate(even_cut(80, 8))]
    assert max(even) > hw.gpu_mem_gib >= max(peaks)
    assert max(peaks) - min(peaks) < max(even) - min(even)
    assert stage_cut(shape, w, parse_gpus("8x80GB", 1, None), 8) == even_cut(80, 8)
    p = plan_pipeline(shape, w, hw, 8)
    assert p.cut == tuple(c) and p.stage_gibs == pytest.approx(peaks) and p.stage_gib == max(peaks)
    assert p.blocks_per_stage == max(c)


def test_plan_reports_every_stage(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_here(capsys, "plan", "--model", SEED_002, "--gpus", "8x24GB", "--method", "lora", "--seq",
                              "2048", "--batch", "1", "--grad-accum", "16", "--pipeline-parallel", "8", "--json")
    assert code in (0, 3), err
    pipe = json.loads(out)["pipeline"]
    assert len(pipe["cut"]) == len(pipe["stage_gibs"]) == 8 and sum(pipe["cut"]) == 80
    assert pipe["stage_gib"] == pytest.approx(max(pipe["stage_gibs"]), abs=1e-3)


def test_the_runtime_cuts_where_the_plan_says(tmp_path: Path) -> None:
    """The job resolved for a pipeline carries the plan's cut, and the stages the runtime builds from it hold
    exactly those blocks."""
    config = Qwen2Config(vocab_size=50000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=9,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    # A full fine-tune on 12 GB cards: the first stage's 3 micro-batches in flight do not fit with 3 blocks.
    cfg = dataclasses.replace(Config(), model=str(folder), pipeline_parallel=3, grad_accum=8, max_seq_len=4096,
                              micro_batch=4, precision="bf16", method="full", strategy="ddp")
    job, _ = resolve_job(cfg, parse_gpus("3x12GB", 1, None), DeviceFacts("cuda", True), nproc=3)
    planned = dataclasses.replace(cfg, compile=job.compile, attn_implementation=job.attention)
    want = plan_pipeline(resolve_shape(str(folder)), workload_of(planned), job.hardware, 3).cut
    assert job.stage_layers == want and sum(want) == 9 and want != tuple(even_cut(9, 3))
    assert type(job).from_env(job.to_env()).stage_layers == want  # as every rank reads it
    torch.manual_seed(0)
    config.vocab_size, config.hidden_size = 128, 32  # the same blocks, built small
    starts = [sum(want[:s]) for s in range(3)]
    for s in range(3):
        stage = cut(AutoModelForCausalLM.from_config(config), s, 3, job.stage_layers)
        assert list(stage.model.model.layers) == [str(i) for i in range(starts[s], starts[s] + want[s])]


def test_seed_002_plan_recommends_the_pipeline_over_zero3_offload(capsys: pytest.CaptureFixture) -> None:
    """8 GPUs and 16 micro-batches: the plan puts an 8-stage pipeline beside the strategies without being asked,
    and recommends it (it fits, train runs it, and it trains more tokens/s than zero3_offload)."""
    code, out, err = run_here(capsys, "plan", "--model", SEED_002, "--gpus", "8x24GB", "--method", "lora", "--seq",
                              "2048", "--batch", "1", "--grad-ckpt", "full", "--grad-accum", "16", "--json")
    assert code == 0, err
    d = json.loads(out)
    pipe, offload = d["pipeline"], next(c for c in d["candidates"] if c["strategy"] == "zero3_offload")
    assert d["recommended"] == "zero3_offload" and offload["fits"]
    assert pipe["stages"] == 8 and pipe["fits"] and pipe["note"] == "" and pipe["recommended"]
    assert pipe["tokens_per_s"] > offload["tokens_per_s"] and "pipeline_parallel=8" in pipe["versus"]


def test_the_pipeline_is_not_recommended_unless_it_fits_runs_and_is_faster() -> None:
    shape, hw = resolve_shape(SEED_002), parse_gpus("8x24GB", 1, None)
    w = _w(method="lora")
    plan, pipe = make_plan(shape, w, hw), plan_pipeline(shape, w, hw, 8)
    assert versus(plan, pipe, "")[0]
    assert not versus(plan, dataclasses.replace(pipe, fits=False, stage_gib=30.0), "")[0]
    assert not versus(plan, pipe, "train refuses it")[0]
    slow = dataclasses.replace(pipe, tokens_per_s=plan.candidate("zero3_offload").tokens_per_s * 1.01)
    chosen, why = versus(plan, slow, "")
    assert not chosen and "no faster than zero3_offload" in why


def _seed_002(**over) -> Config:
    keys = dict(model=SEED_002, pipeline_parallel=8, grad_accum=16, method="lora", max_seq_len=2048, micro_batch=1,
                grad_ckpt="full")
    return dataclasses.replace(Config(), **{**keys, **over})


def test_a_pipeline_is_judged_by_its_stages_memory_not_a_strategys() -> None:
    """Seed 002 with only 64 GiB of host RAM: no strategy fits the whole model on 8 ranks (zero3_offload needs
    more host RAM), so `strategy: auto` alone would stop; with 8 stages it resolves, carries the cut, and the
    preflight's verdict is the stages' (none: they fit). 4096-token rows do not fit a stage: an error naming the
    key, a warning under force."""
    node = parse_gpus("8x24GB", 1, 64)
    job, plan = resolve_job(_seed_002(), node, DeviceFacts("cuda", True), nproc=8)
    assert not any(c.fits and c.applies for c in plan.candidates if c.strategy != "model_parallel")
    assert job.pipeline_parallel == 8 and sum(job.stage_layers) == 80
    assert pipeline_plan_rules(_seed_002(), plan) == []
    with pytest.raises(DoesNotFitError):  # the same job without the pipeline
        resolve_job(_seed_002(pipeline_parallel=1), node, DeviceFacts("cuda", True), nproc=8)
    _, long_plan = resolve_job(_seed_002(max_seq_len=4096), node, DeviceFacts("cuda", True), nproc=8)
    [f] = pipeline_plan_rules(_seed_002(max_seq_len=4096), long_plan)
    assert f.severity == "error" and f.where == "pipeline_parallel: 8" and "GiB on stage" in f.message
    assert pipeline_plan_rules(_seed_002(max_seq_len=4096, force=True), long_plan)[0].severity == "warning"
