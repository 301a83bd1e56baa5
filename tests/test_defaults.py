"""`compile: auto`, `attn_implementation: auto` and `precision: auto`: the measured rules, and the config keys that
take them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardfit.config import Config, load_config
from shardfit.data.loader import BatchSchedule
from shardfit.data.tokenize import Encoded
from shardfit.errors import UserError
from shardfit.parallel.env import fast_cpu_bf16, resolve_precision
from shardfit.resolve.defaults import (
    CPU_BF16_WIDTH_MULTIPLE,
    CUDNN_PLAN_S,
    CUDNN_PLAN_SHARE,
    EAGER_ATTENTION_BF16_MAX_WIDTH,
    EAGER_ATTENTION_MAX_LEN,
    cudnn_attention_allowed,
    eager_attention_max_width,
    resolve_attention,
    resolve_compile,
    resolve_speed_settings,
    row_width_multiple,
)


def test_compile_auto_only_where_it_pays() -> None:
    assert resolve_compile("auto", "cpu", packing=True) is False
    assert resolve_compile("auto", "cpu", packing=False) is False
    assert resolve_compile("auto", "cuda", packing=True) is False  # static shapes would undo packing
    assert resolve_compile("auto", "cuda", packing=False) is True
    assert resolve_compile(True, "cpu", packing=True) is True and resolve_compile(False, "cuda", False) is False


def test_attention_auto_follows_device_compile_and_row_shape() -> None:
    assert resolve_attention("auto", "cpu", True, 256, compiled=True) == "eager"
    assert resolve_attention("auto", "cpu", True, 256, compiled=False) == "auto"  # uncompiled eager is slower
    assert resolve_attention("auto", "cpu", True, EAGER_ATTENTION_MAX_LEN + 1, compiled=True) == "auto"
    assert resolve_attention("auto", "cpu", False, 256, compiled=True) == "auto"  # no mask: SDPA's causal kernel
    assert resolve_attention("auto", "cuda", True, 256, compiled=True) == "auto"
    assert resolve_attention("sdpa", "cpu", True, 256, compiled=True) == "sdpa"  # an explicit choice is kept


def test_attention_auto_for_short_bf16_rows_on_cpu() -> None:
    """Uncompiled bf16 on CPU: eager attention for the micro-batches up to the measured width, the model's kernel
    above it; never for fp32, compiled blocks, GPUs or a named kernel. The config keeps `auto`."""
    assert eager_attention_max_width("auto", "cpu", False, "bf16") == EAGER_ATTENTION_BF16_MAX_WIDTH
    assert eager_attention_max_width("auto", "cpu", False, "fp32") == 0
    assert eager_attention_max_width("auto", "cpu", True, "bf16") == 0
    assert eager_attention_max_width("auto", "cuda", False, "bf16") == 0
    assert eager_attention_max_width("sdpa", "cpu", False, "bf16") == 0
    cfg = Config(max_seq_len=1024, precision="bf16")
    assert resolve_speed_settings(cfg, "cpu").attn_implementation == "auto"


def test_attention_by_width_switches_per_micro_batch() -> None:
    """The switch sets eager attention for narrow micro-batches and the loaded kernel for wide ones, counts each,
    and the loss is the same under both kernels."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from shardfit.models.attention_by_width import AttentionByWidth
    from shardfit.train.loss import CausalLMLoss

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    assert AttentionByWidth.for_model(model, 0) is None
    switch = AttentionByWidth.for_model(model, 8)
    assert switch is not None and switch.wide == "sdpa"
    loss = CausalLMLoss(model, chunk=4)
    ids = torch.randint(1, 64, (2, 8))
    switch.before(ids.shape[-1])  # the loop sets the kernel for each micro-batch before its forward
    narrow, _ = loss(ids, None, ids)
    assert model.config._attn_implementation == "eager"
    wide_ids = torch.cat([ids, ids], dim=1)
    switch.before(wide_ids.shape[-1])
    loss(wide_ids, None, wide_ids)
    assert model.config._attn_implementation == "sdpa"
    again, _ = CausalLMLoss(model, chunk=4)(ids, None, ids)  # the same rows under SDPA
    assert torch.allclose(narrow, again, rtol=1e-4)
    assert dict(switch.used) == {"eager": 1, "sdpa": 1}


def test_cudnn_attention_only_where_its_plans_pay() -> None:
    """cuDNN's attention builds a plan per input shape: `auto` keeps SDPA off it on a GPU when the run's new shapes
    would take more than CUDNN_PLAN_SHARE of its predicted time (or the time is unknown); compiled blocks (one
    shape), an explicit `sdpa` and a CPU keep PyTorch's choice."""
    # The H100 bench's short-row LoRA: a new width nearly every one of 60 steps of ~0.07 s.
    assert not cudnn_attention_allowed("auto", "cuda", compiled=False, new_shapes=58, run_s=60 * 0.07)
    # Packed rows filled to max_seq_len: a few shapes over a long run of 2-second steps.
    assert cudnn_attention_allowed("auto", "cuda", compiled=False, new_shapes=60, run_s=1000 * 2.0)
    bound = CUDNN_PLAN_SHARE * 100.0 / CUDNN_PLAN_S
    assert cudnn_attention_allowed("auto", "cuda", compiled=False, new_shapes=bound, run_s=100.0)
    assert not cudnn_attention_allowed("auto", "cuda", compiled=False, new_shapes=bound + 1, run_s=100.0)
    assert not cudnn_attention_allowed("auto", "cuda", compiled=False, new_shapes=1, run_s=None)
    assert cudnn_attention_allowed("auto", "cuda", compiled=True, new_shapes=58, run_s=1.0)
    assert cudnn_attention_allowed("sdpa", "cuda", compiled=False, new_shapes=58, run_s=1.0)
    assert cudnn_attention_allowed("auto", "cpu", compiled=False, new_shapes=58, run_s=1.0)


def test_new_shape_share_counts_shapes_not_seen_before() -> None:
    """Rows of many lengths two to a micro-batch: nearly every micro-batch a new (rows, width); packed into rows of
    one width: one shape after the first."""
    varied = [Encoded(list(range(n)), [1] * n) for n in range(10, 90)]
    schedule = BatchSchedule(varied, micro_batch=2, grad_accum=1, world=1, rank=0, seed=0)
    shapes = schedule.first_shapes(steps=20)
    assert len(shapes) == 20 and schedule.new_shape_share(steps=20) == len(set(shapes)) / 20 > 0.5
    same = [Encoded(list(range(64)), [1] * 64) for _ in range(80)]
    assert BatchSchedule(same, micro_batch=2, grad_accum=1, world=1, rank=0, seed=0).new_shape_share(20) == 1 / 20


def test_attention_kernel_scope_leaves_cudnn_out_and_restores_it() -> None:
    """The flags are process-wide: inside the run's scope cuDNN is off and the other kernels on; after it, what the
    process had before (also when the run fails)."""
    from shardfit.models.build import attention_kernels

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled())
    with pytest.raises(RuntimeError), attention_kernels(allow_cudnn=False):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        raise RuntimeError("the run failed")
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled()) == before
    with attention_kernels(allow_cudnn=True):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]


def test_training_and_its_final_save_run_inside_the_attention_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfit.train import recipe

    before, seen = torch.backends.cuda.cudnn_sdp_enabled(), {}

    class Run:  # the recipe's phases, recording what the attention flags are in each
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            pass

        def setup(self) -> None:
            seen["setup"] = torch.backends.cuda.cudnn_sdp_enabled()

        def allows_cudnn_attention(self) -> bool:
            return False

        def fit(self) -> None:
            seen["fit"] = torch.backends.cuda.cudnn_sdp_enabled()

        def finish(self) -> str:
            seen["finish"] = torch.backends.cuda.cudnn_sdp_enabled()
            return "result"

        def release(self) -> None:
            seen["release"] = torch.backends.cuda.cudnn_sdp_enabled()

    monkeypatch.setattr(recipe, "FineTune", Run)
    assert recipe.train(Config(), None) == "result"  # type: ignore[arg-type]
    assert seen == {"setup": before, "fit": False, "finish": False, "release": before}


def test_row_widths_are_rounded_only_for_bf16_on_cpu() -> None:
    """oneDNN's per-shape kernels (bf16 on CPU) want few distinct widths; MKL's fp32 and GPU kernels do not."""
    assert row_width_multiple("cpu", "bf16", compiled=False) == CPU_BF16_WIDTH_MULTIPLE > 1
    assert row_width_multiple("cpu", "fp32", compiled=False) == 1
    assert row_width_multiple("cpu", "bf16", compiled=True) == 1  # compiled runs pad to max_seq_len already
    assert row_width_multiple("cuda", "bf16", compiled=False) == 1


def test_resolved_config_and_the_keys(tmp_path: Path) -> None:
    cfg = resolve_speed_settings(Config(max_seq_len=256), "cpu")
    assert cfg.compile is False and cfg.attn_implementation == "auto"
    forced = resolve_speed_settings(Config(max_seq_len=256, compile=True), "cpu")
    assert forced.compile is True and forced.attn_implementation == "eager"
    assert resolve_speed_settings(Config(packing=False), "cuda").compile is True
    f = tmp_path / "c.yaml"
    f.write_text("model: m\ndata: d.jsonl\ncompile: auto\n")
    assert load_config(f, check_files=False).compile == "auto"
    assert load_config(f, ["compile=true"], check_files=False).compile is True
    f.write_text("model: m\ndata: d.jsonl\ncompile: sometimes\n")
    with pytest.raises(UserError, match=r"c.yaml:3: 'compile' is 'sometimes'.*choose one of: auto, true, false"):
        load_config(f, check_files=False)


# Imports first (a starved process would spend minutes on them), then the decision, once the machine is busy.
_PRECISION = """
import sys
from shardfit.parallel.env import resolve_precision
print("ready", flush=True)
sys.stdin.readline()
print(resolve_precision("auto", "cpu"), flush=True)
"""


def test_precision_auto_on_cpu_holds_under_load() -> None:
    """`precision: auto` on a CPU compares bf16 and fp32 matmuls in one thread's CPU time: a low-priority process
    on a machine busy with other work decides as a quiet one does, and the thread count is left as it was."""
    threads = torch.get_num_threads()
    quiet = resolve_precision("auto", "cpu")
    assert quiet == ("bf16" if fast_cpu_bf16() else "fp32") and torch.get_num_threads() == threads
    child = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", _PRECISION], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    busy: list[subprocess.Popen] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
        child.stdin.write("go\n")
        child.stdin.flush()
        loaded = child.stdout.readline().strip()
    finally:
        for p in [*busy, child]:
            p.kill()
    assert loaded == quiet


def test_adapter_input_casts_skipped_under_autocast_change_nothing(tiny_llama: Path) -> None:
    """Under bf16 autocast peft's cast of each adapter input to fp32 is undone by autocast at the adapter's matmul,
    so skipping it (skip_adapter_input_casts) leaves the loss and every gradient bitwise as they were."""
    from shardfit.models.adapters import skip_adapter_input_casts
    from shardfit.models.build import build_model
    from shardfit.train.loss import CausalLMLoss

    cfg = Config(model=str(tiny_llama), method="lora", precision="bf16")
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).repeat(2, 1)
    results = []
    for skip in (False, True):
        model = build_model(cfg, "single", weights=True)
        assert next(p for p in model.parameters() if not p.requires_grad).dtype == torch.bfloat16
        if skip:
            assert skip_adapter_input_casts(model) > 0
        module = CausalLMLoss(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = module(ids, pos, ids.roll(-1, 1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    for k in grads_a:
        assert torch.equal(grads_a[k], grads_b[k]), k


def test_a_gpu_run_says_why_it_leaves_cudnn_out(caplog: pytest.LogCaptureFixture) -> None:
    """The recipe's decision for a GPU run of 60 short steps whose widths change (the bench's short-row LoRA on an
    H100, its plan's 0.096 s a step): cuDNN out, and the start-up log says why and how to keep it."""
    from types import SimpleNamespace

    from shardfit.train.recipe import FineTune

    rows = [Encoded(list(range(n)), [1] * n) for n in range(10, 250)]
    run = SimpleNamespace(
        plan=SimpleNamespace(candidate=lambda name: SimpleNamespace(step_s=0.096)),
        strategy=SimpleNamespace(name="single"), total_steps=60, start_step=0, quiet=False, static_shape=False,
        batches=BatchSchedule(rows, micro_batch=4, grad_accum=1, world=1, rank=0, seed=0),
        cfg=Config(compile=False), env=SimpleNamespace(device=torch.device("cuda"), is_main=True))
    with caplog.at_level("INFO", logger="shardfit"):
        assert FineTune.allows_cudnn_attention(run) is False and run.cudnn_attention is False
    assert "SDPA without cuDNN's kernel" in caplog.text and "attn_implementation: sdpa keeps it" in caplog.text
    run.cfg = Config(compile=False, attn_implementation="sdpa")
    assert FineTune.allows_cudnn_attention(run) is True


@pytest.mark.parametrize(("device", "precision", "tf32"), [("cuda", "bf16", True), ("cuda", "fp16", True),
                                                           ("cuda", "fp32", False), ("cpu", "bf16", False),
                                                           ("cpu", "fp32", False)])
def test_tf32_only_for_the_fp32_matmuls_of_a_16_bit_gpu_run(device: str, precision: str, tf32: bool) -> None:
    from shardfit.parallel.env import fast_fp32_matmuls

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fast_fp32_matmuls(torch.device(device), precision) is tf32
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
        # torch 2.9's per-backend setting reads the same, and the legacy flag other libraries read agrees with it
        # (setting only the new one makes reading the legacy flag raise)
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
    finally:
        torch.set_float32_matmul_precision(before)
