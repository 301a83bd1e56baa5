"""`strategy: auto` with the processes left to it, where only model_parallel's one process fits a whole row
(resolve/decide.py `_one_process_best`): the rows split over every GPU's ranks when that trains faster, as with
`--nproc 8`; a run recorded under another choice resumes as it started (resolve/resume.py `resumed_job`), where it
still fits, whether train, a rank torchrun started, check or plan resolves it; and `plan` follows the resolved job
only for a table of the config's own workload over every strategy."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from shardfit.cli.main import main
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.hardware import Hardware, parse_gpus
from shardfit.resolve import DeviceFacts, Resolved, resolve_job
from shardfit.resolve.decide import settled
from shardfit.resolve.resume import global_batch
from shardfit.train.rundir import claim, fingerprint

GPU = DeviceFacts("cuda", True)
RTX = parse_gpus("8x24GB", 1, None)
LONG = dict(model="meta-llama/Llama-3.1-8B", method="lora", max_seq_len=36864, grad_accum=8, micro_batch=1,
            grad_ckpt="full")


def _long_rows(**over) -> Config:
    """Llama-3.1-8B LoRA, 36,864-token rows: on 8 x 24 GB a whole row fits only model_parallel (601 tokens/s)."""
    return dataclasses.replace(Config(), **{**LONG, **over})


def _args(nproc: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(nproc=nproc, nnodes=1, node_rank=0, master_addr=None, master_port=None,
                              rdzv_endpoint=None)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, Hardware]:
    """`train` deciding its launch on a faked host, eight 24 GB GPUs unless the test sets `host["gpus"]`."""
    from shardfit.parallel import job as rank_job

    gpus = {"gpus": RTX}
    monkeypatch.setattr(rank_job, "node_hardware", lambda threads=None: gpus["gpus"])
    monkeypatch.setattr(rank_job, "cuda_available", lambda: True)
    monkeypatch.setattr(rank_job, "device_facts", lambda device, precision="auto": GPU)
    return gpus


@pytest.fixture
def eight_24gb(host: dict[str, Hardware]) -> None:
    """`train` deciding its launch on a faked host of eight 24 GB GPUs."""


def _config_file(tmp_path: Path, **over) -> str:
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({**LONG, **over}))
    return str(path)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    main(["plan", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_train_without_nproc_runs_what_eight_processes_would(eight_24gb: None) -> None:
    """`train` deciding its launch with the processes left to auto runs zero3 with the rows split over 2 of the 8
    ranks (4,550 tokens/s), as `--nproc 8` does, not the 4-stage pipeline (3,105) it weighed against
    model_parallel."""
    from shardfit.cli.train_cmd import decide_launch

    auto, nproc = decide_launch(_args(), _long_rows())
    eight, _ = decide_launch(_args(8), _long_rows())
    assert nproc == 8 and auto is not None and eight is not None
    assert (auto.strategy, auto.sequence_parallel, auto.pipeline_parallel) == ("zero3", 2, 1)
    assert dataclasses.replace(auto, why=()) == dataclasses.replace(eight, why=())
    assert "4,550 tokens/s" in auto.why[0] and "model_parallel in one process (601 tokens/s)" in auto.why[0]


def _run(out: Path, **over) -> Config:
    """The long rows trained into `out` from a data file beside it (the run's fingerprint digests it)."""
    data = out.parent / "train.jsonl"
    data.write_text('{"text": "a row"}\n')
    return _long_rows(output_dir=str(out), data=str(data), **over)


def _record(run_dir: Path, cfg: Config, job: Resolved) -> None:
    """What a run writes as it starts (train/recipe.py): run.json's fingerprint, config.yaml, preflight.json."""
    ran = settled(cfg, job)
    run_dir.mkdir(exist_ok=True)
    claim(run_dir, ran, fingerprint(ran, global_batch(ran, job)))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(ran.to_dict(), sort_keys=False))
    (run_dir / "preflight.json").write_text(json.dumps({"strategy": job.strategy, "ok": True, "findings": []}))


def test_a_run_recorded_as_model_parallel_resumes_as_it_started(eight_24gb: None, tmp_path: Path) -> None:
    """A run that auto started as model_parallel (one process, rows whole, a global batch of 8) resumes with that
    strategy and split, saying so, and its resume is accepted; resolved anew it would split the rows (a global
    batch of 32), which the resume refuses with exit 2. A new output_dir or resume: never resolve anew."""
    from shardfit.cli.train_cmd import decide_launch

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(tmp_path, cfg, old)
    job, nproc = decide_launch(_args(), cfg)
    assert job is not None and (job.strategy, job.sequence_parallel, job.pipeline_parallel, nproc) == (
        "model_parallel", 1, 1, 1)
    # Said in the job's reasons (the launcher's log and summary.json), with why the recorded job is kept.
    assert any(w.startswith("strategy auto -> model_parallel, sequence_parallel 1: kept from ") for w in job.why)
    why = next(w for w in job.why if w.startswith("resumed as recorded"))
    assert "trains a global batch of 8 examples (run.json)" in why and "global batch of 32" in why
    # Kept, as a field of the job (not recognised by its reason's words), which the ranks read as train hands it.
    assert job.kept_as_recorded and Resolved.from_env(job.to_env()).kept_as_recorded
    ran = settled(cfg, job)
    claim(tmp_path, ran, fingerprint(ran, global_batch(ran, job)))  # the same run: resumed
    fresh, _ = decide_launch(_args(), _run(tmp_path / "new"))
    assert fresh is not None and (fresh.strategy, fresh.sequence_parallel) == ("zero3", 2)
    assert not fresh.kept_as_recorded
    anew = settled(cfg, fresh)
    with pytest.raises(UserError) as e:
        claim(tmp_path, anew, fingerprint(anew, global_batch(anew, fresh)))
    assert e.value.exit_code == 2 and "global_batch_examples: 8 -> 32" in str(e.value)
    never, _ = decide_launch(_args(), _run(tmp_path, resume="never"))
    assert never is not None and never.sequence_parallel == 2


def test_a_resume_keeps_a_recorded_split_and_pipeline(eight_24gb: None, tmp_path: Path) -> None:
    """Runs recorded under the 4-stage pipeline (what auto ran before it split the rows) and under the split
    itself resume as recorded; a strategy the config names is not replaced."""
    from shardfit.cli.train_cmd import decide_launch
    from shardfit.resolve.resume import recorded_job

    piped = tmp_path / "piped"
    cfg = _run(piped)
    old, _ = resolve_job(_long_rows(pipeline_parallel=4), RTX, GPU)
    _record(piped, cfg, old)
    assert (old.pipeline_parallel, old.sequence_parallel) == (4, 1)
    job, _ = decide_launch(_args(), cfg)
    assert job is not None and (job.strategy, job.pipeline_parallel, job.sequence_parallel) == (old.strategy, 4, 1)
    split = tmp_path / "split"
    cfg = _run(split)
    old, _ = resolve_job(cfg, RTX, GPU)
    _record(split, cfg, old)
    kept, lines = recorded_job(cfg)
    assert (kept.strategy, kept.sequence_parallel) == ("zero3", 2)
    assert lines[-1].startswith("strategy auto -> zero3, sequence_parallel 2: kept from ")
    named = _run(split, strategy="zero3_offload")
    assert recorded_job(named)[0].strategy == "zero3_offload"


def test_plan_recommends_the_job_it_resolves(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`plan CONFIG --gpus 8x24GB` of the config's own workload recommends the job train runs (its JSON and its
    `recommended:` line), also where a flag repeats the config's value."""
    cfg = _config_file(tmp_path)
    for extra in ((), ("--seq", "36864")):
        d = _plan(capsys, cfg, "--gpus", "8x24GB", *extra)
        assert d["recommended"] == d["resolved"]["strategy"] == "zero3" and d["resolved"]["sequence_parallel"] == 2
        assert d["best_strategy"] == "model_parallel" and not d["pipeline"]["recommended"]


@pytest.mark.parametrize("flags", [("--seq", "4096"), ("--batch", "2", "--seq", "8192")])
def test_plan_of_another_workload_recommends_its_own_table(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           flags: tuple[str, ...]) -> None:
    """A table for another workload than the config's (`--seq`, `--batch`): its recommendation is the table's,
    and its pipeline is weighed against the table's strategies, not against the config's job (rows of 36,864
    tokens split over 2 ranks), which the job line still shows."""
    cfg = _config_file(tmp_path)
    d = _plan(capsys, cfg, "--gpus", "8x24GB", *flags)
    assert d["recommended"] == d["best_strategy"] and d["recommended"] is not None
    assert d["resolved"]["sequence_parallel"] == 2  # the config's job
    assert "sequence_parallel" not in d["pipeline"]["versus"]
    assert main(["plan", cfg, "--gpus", "8x24GB", *flags]) == 0
    text = capsys.readouterr().out
    assert f"\nrecommended: {d['recommended']} (" in text and "each row split over" not in text


@pytest.mark.parametrize("named", ["ddp", "model_parallel", "zero3_offload"])
def test_plan_with_a_strategy_named_recommends_only_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       named: str) -> None:
    """`--strategy X` plans X alone: the recommendation is X (or nothing fits), a pipeline is recommended only
    where its stages run X, and never the job auto resolves under another strategy (zero3, rows split)."""
    cfg = _config_file(tmp_path)
    d = _plan(capsys, cfg, "--gpus", "8x24GB", "--strategy", named)
    assert d["recommended"] in (named, None) and d["resolved"]["strategy"] == "zero3"
    pipe = d["pipeline"]
    assert not pipe["recommended"] or pipe["strategy"] == named
    main(["plan", cfg, "--gpus", "8x24GB", "--strategy", named])
    text = capsys.readouterr().out
    assert "recommended: zero3" not in text and "each row split over" not in text
    if pipe["recommended"]:
        assert f"--set strategy={named}" in pipe["versus"]


def test_plan_of_a_config_recommends_the_split_its_job_runs(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    """Qwen3-8B at 139,264-token rows on 8 x H100: no strategy fits a whole row, and the job auto resolves splits
    it over 2 ranks. The plan recommends that job (its `recommended:` line, JSON `recommended` as `resolved`) and
    exits 0, as train runs it; `best_strategy` says no strategy fits whole rows."""
    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump(dict(model="Qwen/Qwen3-8B", method="lora", max_seq_len=139264, micro_batch=1,
                                       grad_ckpt="full", packing=False)))
    assert main(["plan", str(cfg), "--gpus", "8xH100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["resolved"]["sequence_parallel"] == 2 and d["recommended"] == d["resolved"]["strategy"] == "ddp"
    assert d["best_strategy"] is None
    assert main(["plan", str(cfg), "--gpus", "8xH100"]) == 0
    assert "\nrecommended: ddp with each row split over 2 GPUs (sequence_parallel 2, " in capsys.readouterr().out


def _claims(run_dir: Path, cfg: Config, job: Resolved) -> str:
    """The resume's verdict on `job` in `run_dir`: "ok", or the refusal's message."""
    ran = settled(cfg, job)
    try:
        claim(run_dir, ran, fingerprint(ran, global_batch(ran, job)))
    except UserError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize(("recorded", "grad_accum"), [("model_parallel", 1), ("auto", 4)])
def test_a_resume_on_other_gpus_resolves_anew_where_that_keeps_the_run(host: dict[str, Hardware], tmp_path: Path,
                                                                        recorded: str, grad_accum: int) -> None:
    """A run recorded on 8 x 24 GB (model_parallel, global batch 8; zero3 with rows split over 2, global batch
    32) moved to 8 x 80 GB with grad_accum rebalanced so that eight ddp ranks train the same global batch: the
    job resolved anew (ddp over 8 processes) resumes, not the recorded one, which would change it."""
    from shardfit.cli.train_cmd import decide_launch

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(strategy=recorded), RTX, GPU)
    _record(tmp_path, cfg, old)
    host["gpus"] = parse_gpus("8x80GB", 1, None)
    moved = _run(tmp_path, grad_accum=grad_accum)
    job, nproc = decide_launch(_args(), moved)
    assert job is not None and (job.strategy, job.sequence_parallel, nproc) == ("ddp", 1, 8)
    assert not any("kept from" in w for w in job.why)
    assert _claims(tmp_path, moved, job) == "ok"


def test_a_recorded_job_that_cannot_run_here_is_not_kept(eight_24gb: None, tmp_path: Path) -> None:
    """A run recorded as model_parallel (one process) resumed with --nproc 8, as the UI launches: the recorded job
    cannot run on 8 ranks, so the job resolved anew is taken and the resume's refusal names what differs (the
    global batch), not a strategy the config never named, with the grad_accum that resumes it there, which
    does."""
    from shardfit.cli.train_cmd import decide_launch

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(tmp_path, cfg, old)
    job, _ = decide_launch(_args(8), cfg)
    assert job is not None and (job.strategy, job.sequence_parallel) == ("zero3", 2)
    refused = _claims(tmp_path, cfg, job)
    assert "global_batch_examples: 8 -> 32" in refused and "--set grad_accum=2 (the run's 8 examples" in refused
    fixed = _run(tmp_path, grad_accum=2)
    job, _ = decide_launch(_args(8), fixed)
    assert job is not None and _claims(tmp_path, fixed, job) == "ok"


def test_micro_batch_two_splits_only_where_faster_than_one_process_at_micro_batch_one(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """micro_batch 2 (grad_accum 4) of the long rows on 8 x 24 GB: no strategy fits a whole row of that batch, and
    at micro-batch 1 only model_parallel's one process does (601 tokens/s). The split over 4 ranks (4,425) is
    weighed against that one process, with a reason that says so; `plan` recommends the same job on one
    `recommended:` line. Where the split would not be faster, the smaller micro-batch stays the fix: exit 3."""
    from shardfit.resolve import decide

    job, _ = resolve_job(_long_rows(micro_batch=2, grad_accum=4), RTX, GPU)
    assert (job.strategy, job.sequence_parallel, job.nproc_per_node) == ("zero3", 4, 8)
    assert job.why[0].startswith("sequence_parallel auto -> 4: one 36,864-token row fits a GPU only under "
                                 "model_parallel in one process at micro-batch 1 (601 tokens/s; micro_batch 2 ")
    cfg = _config_file(tmp_path, micro_batch=2, grad_accum=4)
    assert main(["plan", cfg, "--gpus", "8x24GB"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if "recommended: " in x]
    assert len(said) == 1 and said[0].startswith("recommended: zero3 with each row split over 4 GPUs")
    assert said[0].endswith("with whole rows only model_parallel with micro-batch 1 with grad_accum 8 fits, "
                            "601 tokens/s")
    d = _plan(capsys, cfg, "--gpus", "8x24GB")
    assert d["recommended"] == d["resolved"]["strategy"] == "zero3" and d["resolved"]["sequence_parallel"] == 4
    monkeypatch.setattr(decide, "TIE", 10.0)  # the split no faster than one process, within the time model
    with pytest.raises(DoesNotFitError) as e:
        resolve_job(_long_rows(micro_batch=2, grad_accum=4), RTX, GPU)
    assert e.value.exit_code == 3 and "model_parallel with micro-batch 1" in str(e.value)


def test_a_switch_from_a_named_strategy_to_auto_is_not_undone(eight_24gb: None, tmp_path: Path) -> None:
    """A run recorded under `strategy: zero3` (2,048-token rows, 8 ranks) whose config now says auto: auto's ddp
    over the same 8 ranks keeps the global batch, so it runs, not the recorded zero3."""
    from shardfit.cli.train_cmd import decide_launch

    named = _run(tmp_path, strategy="zero3", max_seq_len=2048)
    old, _ = resolve_job(named, RTX, GPU)
    _record(tmp_path, named, old)
    auto = _run(tmp_path, max_seq_len=2048)
    job, _ = decide_launch(_args(), auto)
    assert job is not None and job.strategy == "ddp" and _claims(tmp_path, auto, job) == "ok"


def test_a_kept_job_that_does_not_fit_is_refused_before_loading(host: dict[str, Hardware], tmp_path: Path) -> None:
    """A run recorded on 2 x 24 GB as zero3 with rows split over both ranks (micro_batch 1 x grad_accum 8: 21.4
    GiB, a global batch of 8), resumed at micro_batch 2 x grad_accum 4 (the same 8 examples a step): resolved anew
    nothing fits, and the recorded job keeps the batch but is predicted at 31.9 of 24 GiB. The resume is refused
    before anything loads (exit 3), naming the micro_batch and grad_accum that keep both; with them it resumes."""
    from shardfit.cli.train_cmd import decide_launch

    host["gpus"] = parse_gpus("2x24GB", 1, None)
    cfg = _run(tmp_path)
    old, _ = resolve_job(cfg, host["gpus"], GPU)
    assert (old.strategy, old.sequence_parallel, old.dims.dp) == ("zero3", 2, 1)
    _record(tmp_path, cfg, old)
    with pytest.raises(DoesNotFitError) as e:
        decide_launch(_args(), _run(tmp_path, micro_batch=2, grad_accum=4))
    said = str(e.value)
    assert e.value.exit_code == 3 and "predicted not to fit: 31.9 of 24 GiB per GPU" in said
    assert "--set micro_batch=1 --set grad_accum=8 (the same 8 examples a step, 21.4 GiB per GPU, 1,137 tokens" in said
    assert "(resolved anew: no strategy fits this hardware). To keep" in said
    job, _ = decide_launch(_args(), _run(tmp_path, micro_batch=1, grad_accum=8))
    assert job is not None and (job.strategy, job.sequence_parallel) == ("zero3", 2)
    forced, _ = decide_launch(_args(), _run(tmp_path, micro_batch=2, grad_accum=4, force=True))
    assert forced is not None and forced.sequence_parallel == 2  # force: true starts it anyway, as for any job


def test_a_refused_resume_offers_checkpointing_where_it_fits(host: dict[str, Hardware], tmp_path: Path) -> None:
    """The run recorded on 2 x 24 GB (zero3, rows split over both ranks, micro_batch 1 x grad_accum 8, every block
    checkpointed) resumed with grad_ckpt: none: no smaller micro_batch exists, but grad_ckpt: full keeps the batch
    and the trained result and fits (21.4 GiB), so the refusal (exit 3) names it instead of only starting over;
    with it the run resumes."""
    from shardfit.cli.train_cmd import decide_launch

    host["gpus"] = parse_gpus("2x24GB", 1, None)
    cfg = _run(tmp_path)
    old, _ = resolve_job(cfg, host["gpus"], GPU)
    _record(tmp_path, cfg, old)
    with pytest.raises(DoesNotFitError) as e:
        decide_launch(_args(), _run(tmp_path, grad_ckpt="none"))
    said = str(e.value).split("\n")[0]
    assert e.value.exit_code == 3 and "No smaller micro_batch" not in said, said
    assert ("To keep the run, resume it with --set grad_ckpt=full (every block's activations recomputed in the "
            "backward: the same micro_batch 1 x grad_accum 8 and trained result, 21.4 GiB per GPU") in said, said
    assert "start over there (or set force: true to start it anyway)." in said, said  # as every fit refusal ends
    job, _ = decide_launch(_args(), _run(tmp_path, grad_ckpt="full"))
    assert job is not None and job.kept_as_recorded is False and job.sequence_parallel == 2


def test_a_refused_resume_offers_checkpointing_with_a_smaller_micro_batch(host: dict[str, Hardware],
                                                                         tmp_path: Path) -> None:
    """The same recorded run resumed at micro_batch 2 x grad_accum 4 with grad_ckpt: none (316 GiB a GPU):
    neither micro_batch 1 alone nor grad_ckpt: full alone fits, both together do (21.4 GiB): the refusal (exit 3)
    names that combined change, which then resumes, where it offered only to start over."""
    from shardfit.cli.train_cmd import decide_launch

    host["gpus"] = parse_gpus("2x24GB", 1, None)
    cfg = _run(tmp_path)
    old, _ = resolve_job(cfg, host["gpus"], GPU)
    _record(tmp_path, cfg, old)
    with pytest.raises(DoesNotFitError) as e:
        decide_launch(_args(), _run(tmp_path, micro_batch=2, grad_accum=4, grad_ckpt="none"))
    said = str(e.value).split("\n")[0]
    assert e.value.exit_code == 3 and "No smaller micro_batch" not in said, said
    assert ("To keep the run, resume it with --set grad_ckpt=full --set micro_batch=1 --set grad_accum=8 (every "
            "block's activations recomputed in the backward, and the same 8 examples a step: 21.4 GiB per GPU") \
        in said, said
    job, _ = decide_launch(_args(), _run(tmp_path, micro_batch=1, grad_accum=8, grad_ckpt="full"))
    assert job is not None and job.sequence_parallel == 2


def test_a_rank_started_by_torchrun_resumes_as_train_launches(eight_24gb: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that torchrun (or srun) started without `shardfit train` resolve a resumed run by the same rule: a
    run recorded under the 4-stage pipeline resumes with it on every rank, the job `train --nproc 8` launches,
    not the split that resolving anew gives."""
    import torch

    from shardfit.cli.train_cmd import decide_launch
    from shardfit.parallel.env import DistEnv
    from shardfit.parallel.job import job_of_rank
    from shardfit.resolve.job import ENV

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(pipeline_parallel=4), RTX, GPU)
    _record(tmp_path, cfg, old)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    job, plan = job_of_rank(cfg, DistEnv(3, 8, 3, torch.device("cpu"), "gloo"))
    assert (old.pipeline_parallel, old.sequence_parallel) == (4, 1)
    assert (job.strategy, job.pipeline_parallel, job.sequence_parallel) == (old.strategy, 4, 1) and plan is not None
    launched, _ = decide_launch(_args(8), cfg)
    assert launched == job
    assert _claims(tmp_path, cfg, job) == "ok"


def test_plan_recommends_the_job_a_resumed_run_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`plan CONFIG --gpus 8x24GB` where output_dir holds a run recorded as model_parallel (a global batch of 8):
    train resumes it as recorded, not as the rows split over 2 ranks (a global batch of 32), so the plan resolves
    and recommends that job and says it is the resumed run's. A run it would refuse is said beside the table."""
    run = tmp_path / "run"
    cfg = _run(run)
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(run, cfg, old)
    path = _config_file(tmp_path, output_dir=str(run), data=cfg.data)
    d = _plan(capsys, path, "--gpus", "8x24GB")
    assert d["resolved"]["strategy"] == d["recommended"] == "model_parallel"
    assert d["resolved"]["sequence_parallel"] == 1 and "resume_refused" not in d
    assert main(["plan", path, "--gpus", "8x24GB"]) == 0
    text = capsys.readouterr().out
    said = [x for x in text.splitlines() if x.startswith("recommended: ")]
    assert len(said) == 1 and said[0].startswith(f"recommended: model_parallel, the job below: the run in {run} "
                                                 "resumes as it was recorded")
    assert "\n  resumed as recorded: the run in " in text
    split = tmp_path / "split"  # a run recorded as zero3 over 2 x 24 GB, planned at a micro-batch that does not fit
    two = parse_gpus("2x24GB", 1, None)
    ran = _run(split)
    old, _ = resolve_job(ran, two, GPU)
    _record(split, ran, old)
    path = _config_file(tmp_path, output_dir=str(split), data=ran.data, micro_batch=2, grad_accum=4)
    d = _plan(capsys, path, "--gpus", "2x24GB")
    assert "--set micro_batch=1 --set grad_accum=8" in d["resume_refused"] and "resolved" not in d


def test_check_on_named_gpus_checks_the_job_a_resumed_run_runs(tmp_path: Path) -> None:
    """`check CONFIG --gpus 8x24GB` where output_dir holds a run recorded as model_parallel: the job checked is
    the one train resumes (model_parallel in one process), not the rows split over 2 ranks resolved anew."""
    from shardfit.check.run import check_config

    cfg = _run(tmp_path / "run")
    Path(cfg.data).write_text(json.dumps({"instruction": "a question", "output": "an answer"}) + "\n")
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(tmp_path / "run", cfg, old)
    job, _ = check_config(cfg, None, RTX)
    assert (job.strategy, job.sequence_parallel, job.nproc_per_node) == ("model_parallel", 1, 1)
    assert any(w.startswith("resumed as recorded: ") for w in job.why)


def test_a_different_run_is_refused_as_different_not_kept(eight_24gb: None, tmp_path: Path) -> None:
    """A run recorded as model_parallel (a global batch of 8) resumed with another lr at micro_batch 2 x grad_accum
    4 is another run: the recorded job is not kept (nor refused as not fitting, exit 3, with advice that `claim`
    then refuses); the job resolved anew runs and `claim` refuses it naming lr (exit 2)."""
    from shardfit.cli.train_cmd import decide_launch

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(tmp_path, cfg, old)
    other = _run(tmp_path, micro_batch=2, grad_accum=4, lr=5e-5)
    job, _ = decide_launch(_args(), other)
    assert job is not None and job.strategy != "model_parallel"
    assert not any(w.startswith("resumed as recorded") for w in job.why) and not job.kept_as_recorded
    assert "lr: 0.0002 -> 5e-05" in _claims(tmp_path, other, job)
    longer = _run(tmp_path, max_steps=500)  # a longer schedule of the same run still keeps the recorded job
    job, _ = decide_launch(_args(), longer)
    assert job is not None and job.strategy == "model_parallel"


@pytest.mark.parametrize(("name", "text"), [
    ("run.json", '{"fingerprint": "x"}'), ("run.json", '{"fingerprint": [1, 2]}'), ("run.json", "[1]"),
    ("run.json", "[" * 200_000), ("preflight.json", "[" * 200_000), ("config.yaml", "[" * 20_000)])
def test_a_hand_edited_run_directory_is_exit_2_naming_the_file(eight_24gb: None, tmp_path: Path, name: str,
                                                               text: str, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory whose run.json is not an object (or holds a fingerprint that is not one), or whose records
    are nested too deeply to parse: train, a rank torchrun started, check (here and on named GPUs) and plan exit
    2 naming the file, not as a bug in shardfit."""
    import torch

    from shardfit.cli.train_cmd import decide_launch
    from shardfit.parallel.env import DistEnv
    from shardfit.parallel.job import job_of_rank
    from shardfit.resolve.job import ENV

    run = tmp_path / "run"
    cfg = _run(run)
    Path(cfg.data).write_text(json.dumps({"instruction": "a question", "output": "an answer"}) + "\n")
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(run, cfg, old)
    (run / name).write_text(text)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for start in (lambda: decide_launch(_args(), cfg),
                  lambda: job_of_rank(cfg, DistEnv(0, 8, 0, torch.device("cpu"), "gloo"))):
        with pytest.raises(UserError) as e:
            start()
        assert str(run / name) in str(e.value)
    path = _config_file(tmp_path, output_dir=str(run), data=cfg.data)
    for argv in (["check", path], ["check", path, "--gpus", "8x24GB"], ["plan", path, "--gpus", "8x24GB"]):
        assert main(argv) == 2, argv
        assert str(run / name) in capsys.readouterr().err
    if name == "run.json":  # claim reads it too, for a strategy named (no run directory record read before it)
        assert str(run / name) in _claims(run, cfg, old)
        assert _claims(run, dataclasses.replace(cfg, resume="never"), old) == "ok"  # never: it goes


def test_a_refused_resume_names_the_grad_accum_that_keeps_the_batch_anew(eight_24gb: None, tmp_path: Path) -> None:
    """A run recorded as model_parallel (a global batch of 8) resumed at micro_batch 2 x grad_accum 4: the recorded
    job does not fit at micro_batch 2, and micro_batch 1 keeps it (601 tokens/s); the refusal also names
    grad_accum 2, which keeps the batch on the job resolved anew (zero3 with rows split over 4, 4,425 tokens/s),
    and that resumes."""
    from shardfit.cli.train_cmd import decide_launch

    cfg = _run(tmp_path)
    old, _ = resolve_job(_long_rows(strategy="model_parallel"), RTX, GPU)
    _record(tmp_path, cfg, old)
    with pytest.raises(DoesNotFitError) as e:
        decide_launch(_args(), _run(tmp_path, micro_batch=2, grad_accum=4))
    said = str(e.value).split("\n")[0]
    assert "--set micro_batch=1 --set grad_accum=8 (the same 8 examples a step, 16.6 GiB per GPU, 601 tokens/s)" \
        in said
    assert ("or --set grad_accum=2, which keeps the batch on the job resolved anew (zero3, sequence_parallel 4, "
            "pipeline_parallel 1: 16.9 GiB per GPU, 4,425 tokens/s)") in said
    faster = _run(tmp_path, micro_batch=2, grad_accum=2)
    job, _ = decide_launch(_args(), faster)
    assert job is not None and (job.strategy, job.sequence_parallel) == ("zero3", 4)
    assert _claims(tmp_path, faster, job) == "ok"


def test_check_on_nodes_like_this_machine_checks_the_job_train_resumes(eight_24gb: None, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`check CONFIG --nodes 2` without --gpus where output_dir holds a run recorded over 2 nodes of 8 x 24 GB as
    zero3 with rows split over 8: check resolves on 2 nodes like this one, the job `train --nnodes 2` resumes."""
    from shardfit.cli.train_cmd import decide_launch

    run = tmp_path / "run"
    cfg = _run(run)
    Path(cfg.data).write_text(json.dumps({"instruction": "a question", "output": "an answer"}) + "\n")
    old, _ = resolve_job(_long_rows(strategy="zero3", sequence_parallel=8), RTX, GPU, nnodes=2)
    _record(run, cfg, old)
    two = _args()
    two.nnodes, two.master_addr = 2, "10.0.0.1"
    launched, _ = decide_launch(two, cfg)
    assert launched is not None and (launched.sequence_parallel, launched.nnodes) == (8, 2)
    assert main(["check", _config_file(tmp_path, output_dir=str(run), data=cfg.data), "--nodes", "2",
                 "--json"]) in (0, 1)
    checked = json.loads(capsys.readouterr().out)["resolved"]
    assert (checked["strategy"], checked["sequence_parallel"], checked["nnodes"]) == ("zero3", 8, 2)


def test_a_rank_refused_as_it_resolves_still_meets_the_others(host: dict[str, Hardware], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With an output_dir per node, a node whose run directory holds a run whose recorded job does not fit is
    refused as its ranks resolve (exit 3). Its ranks still take part in the agreement on the job, with the
    refusal in place of a job, so that the other nodes' ranks hear the nodes differ instead of waiting for them in
    a collective; where every rank agrees, the refusal is raised after it."""
    import torch

    from shardfit.parallel import job as rank_job
    from shardfit.parallel.env import DistEnv
    from shardfit.resolve.job import ENV
    from shardfit.resolve.resume import ResumeDoesNotFit

    host["gpus"] = parse_gpus("2x24GB", 1, None)
    cfg = _run(tmp_path)
    old, _ = resolve_job(cfg, host["gpus"], GPU)
    _record(tmp_path, cfg, old)
    agreed: list[dict] = []
    monkeypatch.setattr(rank_job, "require_same", lambda env, values, what, fix: agreed.append(values))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ResumeDoesNotFit):
        rank_job.agreed_job(_run(tmp_path, micro_batch=2, grad_accum=4), DistEnv(1, 2, 1, torch.device("cpu"), "gloo"))
    assert agreed == [{"refused": "ResumeDoesNotFit (exit 3)"}]
    job, _ = rank_job.agreed_job(cfg, DistEnv(1, 2, 1, torch.device("cpu"), "gloo"))
    assert agreed[1] == job.decisions() and job.sequence_parallel == 2
