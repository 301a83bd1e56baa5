"""`plan --model` with flags that name another tool's stack (peft's kbit preparation, bitsandbytes' kernels or
optimizer) plans that tool's engine, autocast wherever it mixes precision, as `plan --from` plans the same run
(cli/plan_args.py `names_a_tool`); `--tool-autocast` says so explicitly, and without such a flag the plan is of
shardfit's runner (review s65, finding R3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.cli.main import build_parser, main
from shardfit.cli.plan_args import with_flags
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import model_workload

JOBS = Path(__file__).parent / "foreign_jobs"
QLORA16 = ("--model", "Qwen/Qwen2.5-7B-Instruct", "--gpus", "1xH100", "--method", "qlora", "--seq", "4096",
           "--batch", "4", "--strategy", "single", "--adapters-16bit")


def _workload(*flags: str):  # noqa: ANN202 - a Workload
    """The workload `plan --model` plans for `flags`."""
    return with_flags(model_workload(), build_parser().parse_args(["plan", *flags]))


def _total(capsys: pytest.CaptureFixture, *flags: str) -> float:
    assert main(["plan", *flags, "--json"]) == 0
    (single,) = json.loads(capsys.readouterr().out)["candidates"]
    return single["per_gpu_gib"]["total"]


def test_tool_flags_plan_the_tool_s_autocast_as_from_does(capsys: pytest.CaptureFixture) -> None:
    """Qwen2.5-7B bitsandbytes QLoRA with peft's fp32 upcast and 16-bit adapters (a TRL run on peft before 0.12):
    the tool autocasts over the fp32 embedding, so the residual stream is fp32. `--model` with the flags plans
    the same total as the workload with the tool's autocast, 5 GiB over shardfit's runner."""
    flags = (*QLORA16, "--quant-backend", "bnb", "--frozen-fp32")
    w = _workload(*flags)
    assert w.tool_autocast
    shape, hw = resolve_shape("Qwen/Qwen2.5-7B-Instruct"), parse_gpus("1xH100", 1, None)
    tool = make_plan(shape, w, hw, ("single",)).candidates[0].per_gpu_gib.total
    own = make_plan(shape, dataclasses.replace(w, tool_autocast=False), hw, ("single",)).candidates[0]
    assert _total(capsys, *flags) == pytest.approx(tool, abs=0.01)
    assert tool > own.per_gpu_gib.total + 4


@pytest.mark.parametrize("tool, file", [("axolotl", "axolotl/llama31_8b_qlora.yml"),
                                        ("llamafactory", "lf/qwen25_7b_qlora.yaml")])
def test_from_and_model_flags_give_one_workload(tool: str, file: str) -> None:
    """A `--from` QLoRA job's workload, its bitsandbytes and peft settings named again by `--model`'s flags over
    shardfit's runner, is the job's workload: the same plan through both entry points."""
    job = read_job(tool, str(JOBS / file), JobOptions())
    w = job.workload
    assert w.tool_autocast and w.quant_backend == "bnb"
    flags = ["--method", w.method, "--quant-backend", "bnb", *(["--frozen-fp32"] if w.frozen_fp32 else [])]
    args = build_parser().parse_args(["plan", "--model", job.model, *flags])
    assert with_flags(dataclasses.replace(w, tool_autocast=False), args) == w


def test_without_a_tool_flag_the_plan_is_shardfit_s_runner_and_the_flag_wins() -> None:
    """`--adapters-16bit` alone is shardfit's `lora.dtype: bf16` (no autocast beside them); `--tool-autocast`
    makes it peft's 16-bit adapters under a tool's autocast, and `--no-tool-autocast` keeps shardfit's runner
    whatever the other flags name."""
    assert not _workload(*QLORA16).tool_autocast
    assert _workload(*QLORA16, "--tool-autocast").tool_autocast
    assert not _workload(*QLORA16, "--quant-backend", "bnb", "--no-tool-autocast").tool_autocast
    for flag in (("--bnb-optimizer",), ("--quant-backend", "bnb", "--bnb-compute-fp32"), ("--frozen-fp32",)):
        assert _workload(*QLORA16, *flag).tool_autocast
    assert not _workload(*QLORA16, "--quant-backend", "torchao").tool_autocast
