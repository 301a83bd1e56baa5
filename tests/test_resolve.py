"""One resolved job: `resolve` decides every `auto` once, `train` launches what it decided, and `plan`, `check` and
every rank of `train` print or record the same job."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.config import Config, load_config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.hardware import parse_gpus
from shardfit.resolve import DeviceFacts, Resolved, resolve_job
from shardfit.resolve.decide import precision_for
from tests.helpers import run_cli, write_config

GPU = DeviceFacts("cuda", True)
EIGHT_4090 = parse_gpus("8x4090")
# A 7B model whose weights and training state fit only when split over the cards (the planner's verdict: no
# strategy that keeps a replica per GPU fits 24 GB, model_parallel does).
BIG = "Qwen/Qwen2.5-7B-Instruct"


def _args(nproc: int | None = None, nnodes: int = 1) -> argparse.Namespace:
    return argparse.Namespace(nproc=nproc, nnodes=nnodes, node_rank=0, master_addr=None, master_port=None,
                              rdzv_endpoint=None)


def test_auto_picks_model_parallel_on_a_host_of_gpus_in_one_process() -> None:
    job, plan = resolve_job(Config(model=BIG), EIGHT_4090, GPU)
    assert plan is not None and plan.recommended == "model_parallel"
    assert (job.strategy, job.nproc_per_node, job.world) == ("model_parallel", 1, 1)
    assert job.hardware.gpus_per_node == 8  # one process over every local GPU
    assert "model_parallel" in job.why[0]


def test_auto_never_picks_a_strategy_the_method_refuses() -> None:
    """QLoRA's 4-bit weights cannot train split by a device map (the method table): `auto` leaves model_parallel
    out for it, where it picks model_parallel for LoRA on the same host."""
    pytest.importorskip("torchao")
    for model in (BIG, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        try:
            job, _ = resolve_job(Config(model=model, method="qlora"), EIGHT_4090, GPU)
        except DoesNotFitError:
            continue
        assert job.strategy != "model_parallel"


def test_auto_with_the_processes_given_keeps_to_multi_rank_strategies() -> None:
    with pytest.raises(DoesNotFitError):  # 8 ranks: nothing multi-rank fits the 7B on 24 GB cards
        resolve_job(Config(model=BIG), EIGHT_4090, GPU, nproc=8)
    small, _ = resolve_job(Config(model="HuggingFaceTB/SmolLM2-135M-Instruct"), EIGHT_4090, GPU, nproc=8)
    assert small.nproc_per_node == 8 and small.strategy in ("ddp", "zero2", "zero3")
    alone, _ = resolve_job(Config(model="HuggingFaceTB/SmolLM2-135M-Instruct"), EIGHT_4090, GPU, nproc=1)
    assert alone.strategy in ("single", "model_parallel") and alone.world == 1


def test_an_explicit_strategy_sets_the_processes_and_names_only_flags_given() -> None:
    mp, _ = resolve_job(Config(model=BIG, strategy="model_parallel"), EIGHT_4090, GPU)
    assert (mp.strategy, mp.nproc_per_node) == ("model_parallel", 1)  # no --nproc: nothing to drop
    with pytest.raises(UserError) as e:
        resolve_job(Config(model=BIG, strategy="model_parallel"), EIGHT_4090, GPU, nproc=2)
    assert "--nproc 2" in str(e.value) and "--nnodes" not in str(e.value)
    with pytest.raises(UserError) as e:
        resolve_job(Config(model=BIG, strategy="model_parallel"), EIGHT_4090, GPU, nnodes=2)
    assert "--nnodes 2" in str(e.value) and "--nproc" not in str(e.value)
    z3, _ = resolve_job(Config(model=BIG, strategy="zero3"), EIGHT_4090, GPU)
    assert (z3.strategy, z3.nproc_per_node) == ("zero3", 8)  # one rank per local GPU
    cpu = dataclasses.replace(EIGHT_4090, gpus_per_node=1, name="cpu", cpu_mem_gib=64.0)
    one, _ = resolve_job(Config(model=BIG, strategy="zero3", force=True), cpu, DeviceFacts("cpu", False))
    assert one.strategy == "single" and "--nproc N" in one.why[0]


def test_train_launches_what_was_resolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """train's own decision on a faked host of eight 24 GB GPUs: auto starts one process (model_parallel), not a
    rank per GPU; an explicit multi-rank strategy starts eight."""
    from shardfit.cli import train_cmd
    from shardfit.parallel import job as rank_job

    monkeypatch.setattr(rank_job, "node_hardware", lambda threads=None: EIGHT_4090)
    monkeypatch.setattr(rank_job, "cuda_available", lambda: True)
    monkeypatch.setattr(rank_job, "device_facts", lambda device, precision="auto": GPU)
    job, nproc = train_cmd.decide_launch(_args(), Config(model=BIG))
    assert nproc == 1 and job is not None and job.strategy == "model_parallel"
    job, nproc = train_cmd.decide_launch(_args(), Config(model=BIG, strategy="zero3", force=True))
    assert nproc == 8 and job.strategy == "zero3"
    assert Resolved.from_env(job.to_env()) == job  # what the ranks read is what was decided


def test_precision_rule_is_one_function() -> None:
    assert precision_for("auto", DeviceFacts("cuda", True)) == "bf16"
    assert precision_for("auto", DeviceFacts("cuda", False)) == "fp16"
    assert precision_for("auto", DeviceFacts("cpu", False)) == "fp32"
    assert precision_for("fp32", DeviceFacts("cuda", True)) == "fp32"


def _decisions(job: dict) -> dict:
    """The resolved job's decisions: without the CPU's matmul rates and the reasons quoting the times they
    predict, which each process measures for itself (they move with the machine's load)."""
    return Resolved.from_json(job).decisions()


@pytest.mark.slow
def test_plan_check_and_train_print_the_same_job(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """The same config through `plan`, `check` and `train` (one process, then two ranks): one resolved job. `plan`
    and `check` run in this process (the CLI's `main`, no start-up each), `train` as a user runs it: each in its
    own process."""
    env = {"OMP_NUM_THREADS": "1"}

    def resolved(*args: str) -> dict:
        capsys.readouterr()
        main([*args, "--json"])
        return json.loads(capsys.readouterr().out)["resolved"]

    for nproc in (1, 2):
        run = tmp_path / f"run{nproc}"
        cfg = write_config(tmp_path / f"c{nproc}.yaml", model=str(tiny_llama), data=str(small_data),
                           max_seq_len=128, micro_batch=2, max_steps=1, output_dir=str(run),
                           **({"strategy": "zero3"} if nproc == 2 else {}))
        flags = ["--nproc", str(nproc)] if nproc > 1 else []
        checked = resolved("check", str(cfg), *flags)
        trained = run_cli("train", str(cfg), *flags, env=env, timeout=600)
        assert trained.returncode == 0, trained.stderr[-2000:]
        recorded = json.loads((run / "summary.json").read_text())["resolved"]
        assert _decisions(recorded) == _decisions(checked)
        assert recorded["nproc_per_node"] == nproc
        if nproc == 1:
            assert _decisions(resolved("plan", str(cfg))) == _decisions(recorded)
        assert Resolved.from_json(recorded).strategy == ("single" if nproc == 1 else "zero3")
    assert load_config(tmp_path / "c1.yaml").strategy == "auto"  # the config keeps what the user wrote
