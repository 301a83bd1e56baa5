"""`strategy: auto` with `pipeline_parallel: auto` (resolve/decide.py `_auto_pipeline_parallel`): the pipeline the
plan recommends over every strategy (resolve/pipeline_choice.py, the one decision `plan` shows) is what the job
runs, as if its keys had been set; where the plan recommends none, or train would refuse one, no pipeline."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.check.pipeline_rules import pipeline_plan_rules
from shardfit.cli.main import main
from shardfit.config import Config, load_config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.hardware import parse_gpus
from shardfit.resolve import DeviceFacts, Resolved, pipeline_choice, resolve_job
from shardfit.resolve.decide import LONE_WHY, PIPE_WHY, settled

GPU = DeviceFacts("cuda", True)
SEED_002 = "Qwen/Qwen2-VL-72B-Instruct"
RTX = parse_gpus("8x24GB", 1, None)
# Seed 002's flags: `plan --method lora --seq 2048 --batch 1 --grad-ckpt full --grad-accum 16`.
PLAN_FLAGS = ["--gpus", "8x24GB", "--method", "lora", "--seq", "2048", "--batch", "1", "--grad-ckpt", "full",
              "--grad-accum", "16", "--json"]


def _seed_002(**over) -> Config:
    keys = dict(model=SEED_002, grad_accum=16, method="lora", max_seq_len=2048, micro_batch=1, grad_ckpt="full")
    return dataclasses.replace(Config(), **{**keys, **over})


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_002_runs_the_pipeline_the_plan_recommends(capsys: pytest.CaptureFixture[str]) -> None:
    """8 x 24 GB, strategy and pipeline_parallel left at auto: the job is the plan's recommended layout (8 stages,
    1F1B over grad_accum's 16 micro-batches, the plan's cut), the same job as with pipeline_parallel: 8 set, and it
    says why in the plan's numbers."""
    d = _plan_json(capsys, "--model", SEED_002, *PLAN_FLAGS)
    pipe = d["pipeline"]
    assert pipe["recommended"] and pipe["layout"] == "pipeline_parallel=8"
    for nproc in (8, None):  # the processes given, or left to auto on the node's 8 GPUs
        job, plan = resolve_job(_seed_002(), RTX, GPU, nproc=nproc)
        assert (job.pipeline_parallel, job.pipeline_schedule, job.world) == (8, "1f1b", 8)
        assert list(job.stage_layers) == pipe["cut"]
        assert job.why[0].startswith(f"{PIPE_WHY} -> 8: the plan recommends pipeline_parallel=8")
        assert f"{pipe['tokens_per_s']:,.0f} tokens/s" in job.why[0] and "zero3_offload's" in job.why[0]
    for over in ({}, {"packing": False}):  # unpacked rows would compile without a pipeline: planned uncompiled
        auto, auto_plan = resolve_job(_seed_002(**over), RTX, GPU, nproc=8)
        by_hand, hand_plan = resolve_job(_seed_002(pipeline_parallel=8, **over), RTX, GPU, nproc=8)
        assert dataclasses.replace(auto, why=()) == dataclasses.replace(by_hand, why=()) and not auto.compile
        assert auto_plan.to_json() == hand_plan.to_json()
    # check's verdict is the stages' (they fit), and every rank reads the same job and settled config
    assert pipeline_plan_rules(settled(_seed_002(), job), plan, job.strategy) == []
    assert Resolved.from_env(job.to_env()) == job


def test_a_pipeline_where_no_strategy_fits() -> None:
    """With 64 GiB of host RAM zero3_offload does not fit either: only the pipeline does, and auto runs it where it
    would otherwise stop (exit 3), as an explicit pipeline_parallel: 1 still does."""
    node = parse_gpus("8x24GB", 1, 64)
    job, _ = resolve_job(_seed_002(), node, GPU, nproc=8)
    assert job.pipeline_parallel == 8 and job.why[0].startswith(PIPE_WHY)
    with pytest.raises(DoesNotFitError):
        resolve_job(_seed_002(pipeline_parallel=1), node, GPU, nproc=8)


def test_one_rank_per_stage_runs_as_ddp_under_autocast() -> None:
    """A pipeline with as many stages as ranks (set or auto) runs no strategy over a stage: ddp, under autocast as
    the plan plans it, not a sharded strategy picked for the whole model (zero3_offload here)."""
    job, _ = resolve_job(_seed_002(pipeline_parallel=8), RTX, GPU, nproc=8)
    assert job.strategy == "ddp" and job.autocast == "bf16"
    assert any(w.startswith(f"{LONE_WHY}: strategy auto -> ddp") for w in job.why)


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_a_named_sharded_strategy_over_one_rank_per_stage_runs_as_ddp(strategy: str) -> None:
    """A sharded strategy the config names over a pipeline of one rank per stage shards nothing and, left on the
    stage, would drop autocast (FSDP2's mixed precision never wraps a lone stage): the resolver runs each stage as
    ddp under autocast, says so, and the job, its plan and check's stage verdict are those of strategy: ddp."""
    job, plan = resolve_job(_seed_002(strategy=strategy, pipeline_parallel=8), RTX, GPU, nproc=8)
    assert (job.strategy, job.autocast, job.dims.stage_ranks) == ("ddp", "bf16", 1)
    assert job.why[0].startswith(f"{LONE_WHY}: strategy {strategy} -> ddp: a stage of one rank has nothing to "
                                 "shard or replicate, so each stage runs as ddp")
    assert ("not offloaded to host memory" in job.why[0]) == (strategy == "zero3_offload")
    ddp, ddp_plan = resolve_job(_seed_002(strategy="ddp", pipeline_parallel=8), RTX, GPU, nproc=8)
    assert dataclasses.replace(job, why=()) == dataclasses.replace(ddp, why=())
    assert plan.to_json() == ddp_plan.to_json()
    assert pipeline_plan_rules(settled(_seed_002(strategy=strategy, pipeline_parallel=8), job), plan,
                               job.strategy) == []


def _offload_over_lone_stages(**over) -> Config:
    """zero3_offload over 8 stages on 8 ranks without checkpointing: each stage, held on its 24 GB GPU, is
    predicted not to fit."""
    return _seed_002(**{"strategy": "zero3_offload", "pipeline_parallel": 8, "grad_ckpt": "none", **over})


def test_an_offload_strategy_whose_lone_stages_do_not_fit_is_refused() -> None:
    """zero3_offload over one rank per stage keeps each stage on its GPU (no host offload through the schedule):
    the resolver runs it as ddp and notes the plan's verdict; the stages' check refuses it with exit 3, as any stage
    predicted out of memory, saying offload cannot run per stage and naming real fixes; with force: true it runs
    (a warning); the layout's own input errors come first (exit 2)."""
    from shardfit.check.pipeline_rules import refuse_stage_oom

    cfg = _offload_over_lone_stages()
    job, plan = resolve_job(cfg, RTX, GPU, nproc=8)
    assert job.strategy == "ddp" and job.autocast == "bf16"
    assert "not offloaded to host memory" in job.why[0] and "predicted NOT to fit)" in job.why[0]
    [f] = pipeline_plan_rules(settled(cfg, job), plan, job.strategy)
    assert f.severity == "error"
    with pytest.raises(DoesNotFitError) as e:
        refuse_stage_oom([f])
    msg = str(e.value)
    assert e.value.exit_code == 3 and msg.startswith("pipeline_parallel: 8; strategy: zero3_offload over one rank")
    assert "does not offload a pipeline stage to host memory" in msg
    assert "strategy: zero3 with fewer stages than ranks" in msg and "pipeline_parallel: 4 on 8 ranks" in msg
    assert "grad_ckpt: full" in msg and "force: true" in msg and "method: lora" not in msg  # lora already
    checkpointed = _offload_over_lone_stages(max_seq_len=16384, grad_ckpt="full")
    job, plan = resolve_job(checkpointed, RTX, GPU, nproc=8)
    [f] = pipeline_plan_rules(settled(checkpointed, job), plan, job.strategy)
    assert "grad_ckpt" not in f.fix  # already on: not a fix
    forced = dataclasses.replace(cfg, force=True)
    job, plan = resolve_job(forced, RTX, GPU, nproc=8)
    assert job.strategy == "ddp" and "predicted NOT to fit, started anyway (force: true)" in job.why[0]
    refuse_stage_oom(pipeline_plan_rules(settled(forced, job), plan, job.strategy))  # a warning: it starts
    with pytest.raises(UserError, match="eval_metrics") as e:
        resolve_job(_offload_over_lone_stages(eval_metrics=["rouge"]), RTX, GPU, nproc=8)
    assert e.value.exit_code == 2


def test_plan_config_shows_the_table_of_an_offload_whose_lone_stages_do_not_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan CONFIG` of that job prints the plan's table and the job train would run (ddp per stage), with the
    note of the stages' verdict, rather than stopping with exit 2 and no table."""
    (tmp_path / "d.jsonl").write_text('{"instruction": "hi", "output": "there"}\n')
    path = tmp_path / "offload.yaml"
    path.write_text(f"model: {SEED_002}\ndata: {tmp_path / 'd.jsonl'}\nmethod: lora\nmax_seq_len: 2048\n"
                    "micro_batch: 1\ngrad_accum: 16\ngrad_ckpt: none\nstrategy: zero3_offload\n"
                    "pipeline_parallel: 8\n")
    main(["plan", str(path), "--gpus", "8x24GB"])
    out = capsys.readouterr().out
    assert "zero3_offload" in out.split("job:")[0]  # the strategies' table
    assert "job: strategy ddp, method lora, 8 processes (8 stages, data over 1)" in out
    assert f"\n  {LONE_WHY}: strategy zero3_offload -> ddp" in out and "predicted NOT to fit)" in out


def test_plan_shows_the_lone_stages_run_as_ddp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan CONFIG` of strategy: zero3 over 8 stages on 8 GPUs shows the job train runs (ddp under autocast)
    and why."""
    (tmp_path / "d.jsonl").write_text('{"instruction": "hi", "output": "there"}\n')
    path = tmp_path / "zero3.yaml"
    path.write_text(f"model: {SEED_002}\ndata: {tmp_path / 'd.jsonl'}\nmethod: lora\nmax_seq_len: 2048\n"
                    "micro_batch: 1\ngrad_accum: 16\ngrad_ckpt: full\nstrategy: zero3\npipeline_parallel: 8\n")
    assert main(["plan", str(path), "--gpus", "8x24GB"]) == 0
    out = capsys.readouterr().out
    assert "job: strategy ddp, method lora, 8 processes (8 stages, data over 1) on cuda, bf16 (autocast)" in out
    assert f"\n  {LONE_WHY}: strategy zero3 -> ddp: a stage of one rank has nothing to shard" in out


def test_plan_config_notes_the_lone_stages_under_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan CONFIG` of strategy: auto over 8 stages on 8 GPUs prints the same note under the job's line."""
    (tmp_path / "d.jsonl").write_text('{"instruction": "hi", "output": "there"}\n')
    path = tmp_path / "auto.yaml"
    path.write_text(f"model: {SEED_002}\ndata: {tmp_path / 'd.jsonl'}\nmethod: lora\nmax_seq_len: 2048\n"
                    "micro_batch: 1\ngrad_accum: 16\ngrad_ckpt: full\npipeline_parallel: 8\n")
    assert main(["plan", str(path), "--gpus", "8x24GB"]) == 0
    assert f"\n  {LONE_WHY}: strategy auto -> ddp: a stage of one rank" in capsys.readouterr().out


@pytest.mark.parametrize("cfg,nproc", [
    (_seed_002(pipeline_parallel=1), 8),  # no pipeline asked for
    (_seed_002(strategy="zero3_offload"), 8),  # a strategy named: the user's layout
    (_seed_002(), 1),  # one rank
    (_seed_002(grad_accum=4), 8),  # 2 or 4 stages: none fits a 24 GB card
])
def test_no_pipeline_where_auto_has_nothing_to_decide(cfg: Config, nproc: int) -> None:
    """Each differs from seed 002 on 8 ranks with both keys at auto, which runs 8 stages, in one thing."""
    assert resolve_job(_seed_002(), RTX, GPU, nproc=8)[0].pipeline_parallel == 8
    job, _ = resolve_job(cfg, RTX, GPU, nproc=nproc)
    assert job.pipeline_parallel == 1 and not any(w.startswith(PIPE_WHY) for w in job.why)


def test_a_model_that_fits_under_ddp_gets_no_pipeline() -> None:
    """Llama-3.1-8B LoRA on 8 H100s: the plan plans pipelines beside the strategies and recommends none (ddp with
    no bubble is faster), so auto runs ddp on 8 ranks."""
    cfg = _seed_002(model="meta-llama/Llama-3.1-8B")
    job, plan = resolve_job(cfg, parse_gpus("8xH100", 1, None), GPU, nproc=8)
    assert (job.strategy, job.pipeline_parallel) == ("ddp", 1)
    from shardfit.plan.shapes import resolve_shape

    choice = pipeline_choice.choose_pipeline(plan, resolve_shape(cfg.model), plan.workload, plan.hardware,
                                             cfg.model, cfg)
    assert choice is not None and choice.pick.fits and choice.note == "" and not choice.recommended


@pytest.mark.parametrize("cfg,refused", [
    (_seed_002(compile=True), "does not run compiled blocks"),
    (_seed_002(eval_metrics=["rouge_l"]), "with eval_metrics"),
    (_seed_002(model="mistralai/Mixtral-8x7B-v0.1"), "is a mixture of experts"),
])
def test_a_job_the_pipeline_refuses_never_gets_one(cfg: Config, refused: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled blocks, generation metrics, a mixture of experts (resolve/pipeline.py refuses each): no
    pipeline. Were the rules not asked, the plan would recommend one and auto would turn it on (the job then
    refused, or cut where the ranks refuse it)."""
    job, _ = resolve_job(cfg, RTX, GPU, nproc=8)
    assert job.pipeline_parallel == 1
    assert refused in pipeline_choice.refusal(8, *_shape_of(cfg), cfg, 8)
    monkeypatch.setattr(pipeline_choice, "refusal", lambda *_, **__: "")
    try:
        job, _ = resolve_job(cfg, RTX, GPU, nproc=8)
    except UserError as e:
        assert refused in str(e)
        return
    assert job.pipeline_parallel > 1


def _shape_of(cfg: Config) -> tuple:
    from shardfit.plan.shapes import resolve_shape

    return resolve_shape(cfg.model), cfg.model


def test_plan_notes_what_train_refuses_and_shows_the_job_auto_runs(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`plan` applies train's pipeline rules to the job planned (QLoRA does not run in stages: planned only, never
    recommended), and `plan CONFIG` shows the job auto resolves: seed 002's pipeline, with why."""
    qlora = _plan_json(capsys, "--model", SEED_002, *PLAN_FLAGS[:2], "--method", "qlora", *PLAN_FLAGS[4:])
    assert "trains method lora or full" in qlora["pipeline"]["note"] and not qlora["pipeline"]["recommended"]
    (tmp_path / "d.jsonl").write_text('{"instruction": "hi", "output": "there"}\n')
    path = tmp_path / "seed002.yaml"
    path.write_text(f"model: {SEED_002}\ndata: {tmp_path / 'd.jsonl'}\nmethod: lora\nmax_seq_len: 2048\n"
                    "micro_batch: 1\ngrad_accum: 16\ngrad_ckpt: full\n")
    assert load_config(str(path), check_files=False).pipeline_parallel == "auto"
    d = _plan_json(capsys, str(path), "--gpus", "8x24GB", "--json")
    assert d["pipeline"]["recommended"] and d["resolved"]["pipeline_parallel"] == d["pipeline"]["stages"] == 8
    assert main(["plan", str(path), "--gpus", "8x24GB"]) == 0
    out = capsys.readouterr().out
    assert "job: strategy ddp, method lora, 8 processes (8 stages, data over 1)" in out
    assert f"\n  {PIPE_WHY} -> 8: " in out
    path.write_text(path.read_text() + "pipeline_parallel: 1\n")
    d = _plan_json(capsys, str(path), "--gpus", "8x24GB", "--json")
    assert d["resolved"]["pipeline_parallel"] == 1 and d["resolved"]["strategy"] == "zero3_offload"


def test_auto_runs_1f1b_whatever_schedule_the_config_names() -> None:
    """Seed 002 with pipeline_schedule: interleaved_1f1b and pipeline_parallel left at auto: auto turns on the
    pipeline the plan planned, as 1F1B, and records that schedule."""
    cfg = _seed_002(pipeline_schedule="interleaved_1f1b")
    job, _ = resolve_job(cfg, RTX, GPU, nproc=8)
    assert (job.pipeline_parallel, job.pipeline_schedule) == (8, "1f1b")
    ran = settled(cfg, job)
    assert (ran.pipeline_parallel, ran.pipeline_schedule) == (8, "1f1b")


def test_an_unresolved_auto_reads_as_no_pipeline() -> None:
    """`pipeline_parallel: auto` (the default) read before resolve_job settles it: no pipeline, never a
    comparison of "auto" with a number (resolve/pipeline.py `stages_of`)."""
    from shardfit.resolve.decide import resolve
    from shardfit.resolve.defaults import compiled_for
    from shardfit.resolve.pipeline import check_layout, stages_of

    cfg = _seed_002()
    assert cfg.pipeline_parallel == "auto" and stages_of(cfg) == 1
    assert stages_of(_seed_002(pipeline_parallel=4)) == 4
    job = resolve(cfg, RTX, GPU, None, nproc=8)
    assert job.pipeline_parallel == 1 and job.strategy == "zero3"
    assert compiled_for(dataclasses.replace(cfg, packing=False), "cuda") is True
    check_layout(cfg, 8)
    _, plan = resolve_job(_seed_002(pipeline_parallel=1), RTX, GPU, nproc=8)
    assert pipeline_plan_rules(cfg, plan, "zero3") == []


SEED_LONG = "meta-llama/Llama-3.1-8B"


def _long_rows(**over) -> Config:
    keys = dict(model=SEED_LONG, method="lora", max_seq_len=36864, grad_accum=8, micro_batch=1,
                grad_ckpt="full")
    return dataclasses.replace(Config(), **{**keys, **over})


def test_a_pipeline_is_weighed_against_what_auto_would_run() -> None:
    """Llama-3.1-8B LoRA, 36k-token rows, 8 x 24 GB, --nproc 8: no strategy fits a whole row, model_parallel
    (which fits) cannot run on 8 ranks, and splitting the rows over 2 ranks under zero3 trains faster than any
    pipeline. Auto splits the rows; weighed against model_parallel it turned on a slower pipeline."""
    from shardfit.plan.pipeline import fastest, layouts, versus
    from shardfit.plan.shapes import resolve_shape
    from shardfit.resolve.decide import _fitting
    from shardfit.resolve.pipeline import PP_DP_STRATEGIES

    job, plan = resolve_job(_long_rows(), RTX, GPU, nproc=8)
    assert (job.strategy, job.pipeline_parallel, job.sequence_parallel) == ("zero3", 1, 2)
    assert not any(w.startswith(PIPE_WHY) for w in job.why)
    split = plan.candidate("zero3")
    staged, staged_plan = resolve_job(_long_rows(pipeline_parallel=4), RTX, GPU, nproc=8)
    pipes = layouts(resolve_shape(SEED_LONG), staged_plan.workload, RTX, 4, PP_DP_STRATEGIES)
    pick = fastest(pipes)
    assert pick is not None and pick.tokens_per_s < split.tokens_per_s  # the pipeline the old rule ran: slower
    ok, why = versus(plan, pick, "", _fitting(plan, "lora", 8, 1, 8, split=True), split=2)
    assert not ok and "no faster than zero3 with sequence_parallel 2's" in why
    ok, why = versus(plan, pick, "", [])  # nothing else fits: the pipeline
    assert ok and "and no strategy fits" in why


def test_a_resumed_run_keeps_the_pipeline_it_started_with(tmp_path: Path) -> None:
    """A run directory whose config.yaml recorded pipeline_parallel (1 here: a run from before auto), relaunched
    with the key left at auto, resolves as it started, saying so; a new output_dir, an explicit value or
    resume: never resolve anew."""
    import yaml

    from shardfit.resolve.resume import RUN_FILE, recorded_pipeline

    cfg = _seed_002(output_dir=str(tmp_path))
    assert recorded_pipeline(cfg) == (cfg, None)  # nothing to resume
    (tmp_path / RUN_FILE).write_text('{"fingerprint": {}}')
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "pipeline_parallel": 1}))
    kept, line = recorded_pipeline(cfg)
    assert kept.pipeline_parallel == 1 and line.startswith(f"{PIPE_WHY} -> 1: kept from ")
    assert resolve_job(kept, RTX, GPU, nproc=8)[0].pipeline_parallel == 1
    assert recorded_pipeline(_seed_002(output_dir=str(tmp_path), pipeline_parallel=8))[1] is None
    assert recorded_pipeline(_seed_002(output_dir=str(tmp_path), resume="never"))[1] is None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "pipeline_parallel": 8,
                                                          "pipeline_schedule": "1f1b"}))
    kept, _ = recorded_pipeline(_seed_002(output_dir=str(tmp_path), pipeline_schedule="interleaved_1f1b"))
    assert (kept.pipeline_parallel, kept.pipeline_schedule) == (8, "1f1b")


def test_a_stage_predicted_not_to_fit_exits_3() -> None:
    """Two stages of seed 002 on 8 x 24 GB: every stage layout is predicted out of memory; train stops with exit 3
    (DoesNotFitError) as for a strategy predicted not to fit, not exit 2 (bad input)."""
    from shardfit.check.pipeline_rules import refuse_stage_oom

    cfg = _seed_002(pipeline_parallel=2)
    job, plan = resolve_job(cfg, RTX, GPU, nproc=8)
    findings = pipeline_plan_rules(settled(cfg, job), plan, job.strategy)
    assert findings and findings[0].severity == "error"
    with pytest.raises(DoesNotFitError) as e:
        refuse_stage_oom(findings)
    assert e.value.exit_code == 3 and "pipeline_parallel: 2" in str(e.value)
    refuse_stage_oom(pipeline_plan_rules(settled(_seed_002(pipeline_parallel=2, force=True), job), plan,
                                         job.strategy))  # forced: a warning, the run starts


@pytest.mark.parametrize("model,family", [("mistralai/Mistral-7B-v0.1", "MistralConfig"),
                                          ("google/gemma-2-2b", "Gemma2Config"), ("google/gemma-2-9b", "Gemma2Config"),
                                          ("google/gemma-2-27b", "Gemma2Config")])
def test_the_catalogs_sliding_windows_are_the_built_models(model: str, family: str) -> None:
    """The catalog's window and sliding blocks are what transformers builds the family with (its defaults are the
    published configs': Mistral-7B-v0.1's 4096 on every block, Gemma 2's 4096 on every other), so the planner's
    rules read what the rank reads on the built model, and refuse the same layouts."""
    import transformers

    from shardfit.plan.shapes import resolve_shape
    from shardfit.resolve import pipeline as pipelines
    from shardfit.resolve import sequence

    shape = resolve_shape(model)
    built = getattr(transformers, family)(num_hidden_layers=shape.layers)
    types = getattr(built, "layer_types", None) or ["sliding_attention"] * shape.layers
    assert (shape.sliding_window, shape.sliding_layers) == (built.sliding_window, types.count("sliding_attention"))
    assert pipelines.facts_of_shape(shape).partial_attention and pipelines.facts_of_config(built).partial_attention
    assert sequence.facts_of_shape(shape).partial_attention and sequence.facts_of_config(built).partial_attention


# Gemma 2 is no case here since its class lost SDPA (transformers 5.21, plan/sdpa_classes.py): eager scores outgrow
# these cards however its rows are split; Gemma 3's blocks alternate windows and full attention as Gemma 2's do.
@pytest.mark.parametrize("model,seq,gpus", [("mistralai/Mistral-7B-v0.1", 65536, "8x24GB"),
                                            ("microsoft/Phi-3-mini-4k-instruct", 65536, "8x24GB"),
                                            ("google/gemma-3-1b-it", 98304, "8x24GB"),
                                            ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 8192, "8x32GB")])
def test_auto_never_splits_the_rows_of_a_sliding_window_model(model: str, seq: int, gpus: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of `seq` tokens fits no strategy on these cards; split over ranks it would (the same job read as
    full attention splits its rows), but the rank refuses to split (or cut) a model with sliding windows or
    chunks: auto stops with exit 3, not with a split the rank then refuses. (Llama 4 Scout's LoRA on its fused
    experts holds each merged stack's gradient in backward, 2.5 GiB a block: its split fits 32 GB cards, not 24.)"""
    from shardfit.resolve import decide, pipeline_choice, sequence
    from shardfit.resolve import pipeline as pipelines

    cards = parse_gpus(gpus, 1, None)
    cfg = dataclasses.replace(Config(), model=model, max_seq_len=seq, method="lora", micro_batch=1, grad_accum=16,
                              grad_ckpt="full")
    with pytest.raises(DoesNotFitError):
        resolve_job(cfg, cards, GPU, nproc=8)
    seq_facts, stage_facts = sequence.facts_of_shape, pipelines.facts_of_shape
    monkeypatch.setattr(decide, "facts_of_shape",
                        lambda s: dataclasses.replace(seq_facts(s), partial_attention=False))
    monkeypatch.setattr(pipeline_choice, "facts_of_shape",
                        lambda s: dataclasses.replace(stage_facts(s), partial_attention=False))
    job, _ = resolve_job(cfg, cards, GPU, nproc=8)
    assert job.sequence_parallel > 1 or job.pipeline_parallel > 1


@pytest.mark.parametrize("schedule,gib", [("interleaved_1f1b", 27.1), ("zero_bubble", 24.9)])
def test_looped_stages_are_checked_under_their_own_schedule(schedule: str, gib: float) -> None:
    """Llama-2-70b LoRA, 4,096-token rows, on 8 x 24 GB as 8 ranks x 2 looped stages: the first rank keeps more
    micro-batches in flight than under 1F1B, whose stages fit (23.2 GiB) where the looped schedule's do not (27.1
    under interleaved 1F1B, 24.9 under zero bubble): the stages' check plans the schedule the job runs."""
    cfg = dataclasses.replace(Config(), model="meta-llama/Llama-2-70b-hf", method="lora", max_seq_len=4096,
                              micro_batch=1, grad_accum=16, grad_ckpt="full", pipeline_parallel=8, strategy="ddp")
    plain, plan = resolve_job(cfg, RTX, GPU, nproc=8)
    assert pipeline_plan_rules(settled(cfg, plain), plan, plain.strategy) == []
    looped = dataclasses.replace(cfg, pipeline_schedule=schedule, pipeline_stages_per_rank=2)
    job, plan = resolve_job(looped, RTX, GPU, nproc=8)
    [f] = pipeline_plan_rules(settled(looped, job), plan, job.strategy)
    assert f.severity == "error" and f.message.startswith(f"pipeline_parallel=8 (2 stages per rank, {schedule}): "
                                                          f"predicted {gib} GiB on the first rank")


def test_processes_left_to_auto_run_what_eight_ranks_would(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """The 36k-token rows on 8 x 24 GB: only model_parallel (one process, 601 tokens/s) fits a whole row, and
    splitting the rows over 2 of the 8 ranks under zero3 trains faster than it and than any pipeline. `train`
    with the processes left to auto runs the same job as `--nproc 8` (it turned a slower pipeline on, weighed
    against model_parallel), and `plan CONFIG --gpus 8x24GB` recommends that job: its recommended line, its
    pipeline verdict and its JSON `recommended` all name what `resolved` runs."""
    auto, _ = resolve_job(_long_rows(), RTX, GPU, nproc=None)
    eight, _ = resolve_job(_long_rows(), RTX, GPU, nproc=8)
    assert dataclasses.replace(auto, why=()) == dataclasses.replace(eight, why=())
    assert (auto.strategy, auto.sequence_parallel, auto.pipeline_parallel) == ("zero3", 2, 1)
    assert "fits a GPU only under model_parallel in one process" in auto.why[0]
    cfg = tmp_path / "long.yaml"
    cfg.write_text("\n".join(f"{k}: {v}" for k, v in dict(
        model=SEED_LONG, method="lora", max_seq_len=36864, grad_accum=8, micro_batch=1, grad_ckpt="full").items()))
    d = _plan_json(capsys, str(cfg), "--gpus", "8x24GB", "--json")
    assert d["resolved"]["strategy"] == d["recommended"] == "zero3" and d["resolved"]["sequence_parallel"] == 2
    assert d["best_strategy"] == "model_parallel"
    assert not d["pipeline"]["recommended"] and "zero3 with sequence_parallel 2's" in d["pipeline"]["versus"]
    assert main(["plan", str(cfg), "--gpus", "8x24GB"]) == 0
    text = capsys.readouterr().out
    assert "\nbest strategy: model_parallel" in text and "\nrecommended: model_parallel" not in text
    line = next(x for x in text.splitlines() if x.startswith("recommended: "))
    assert line.startswith("recommended: zero3 with each row split over 2 GPUs") and "the job below" in line
    assert line.endswith("model_parallel with whole rows, in one process, trains 601 tokens/s")
