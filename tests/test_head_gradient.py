"""The trained head's gradient in a bf16 run: from bf16 operands into an fp32 result on a GPU that has the kernel
(train/loss.py `widening_matmul`), checked on a CPU with a recorder of the loss's matmuls that stands in for the
CUDA-only kernel."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardfit.config import load_config
from shardfit.data.tokenize import IGNORE
from shardfit.parallel.env import init_distributed
from shardfit.train import loss as loss_mod
from shardfit.train.loss import chunked_cross_entropy, widening_matmul
from shardfit.train.metrics import MetricsLog, StepLogger
from shardfit.train.recipe import FineTune
from tests.helpers import write_config

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "addmm_", "linear"}


class LossMatmuls(TorchDispatchMode):
    """Records the operand dtypes of every matmul called from train/loss.py; runs the CUDA-only widening
    `addmm` (aten::addmm.dtype_out) on a CPU as fp32 arithmetic on the same 16-bit operands."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in MATMULS and any(f.filename.endswith("train/loss.py") for f in traceback.extract_stack()):
            operands = args[1:3] if name.startswith("add") or name == "baddbmm" else args[:2]
            self.seen.append((str(func), tuple(a.dtype for a in operands)))
        if func is torch.ops.aten.addmm.dtype_out and args[0].device.type == "cpu":
            out = kwargs["out"]
            return out.copy_(args[0].float() + args[1].float() @ args[2].float())
        return func(*args, **kwargs)


def _case(widen: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LossMatmuls]:
    """A full fine-tune's head (fp32 weights) under bf16 autocast: the loss, the hidden states' and the head's
    gradients, and the loss's matmuls."""
    torch.manual_seed(0)
    h = torch.randn(2, 30, 32, dtype=torch.bfloat16, requires_grad=True)
    head = nn.Linear(32, 300, bias=False)
    y = torch.randint(0, 300, (2, 30))
    y[:, :5] = IGNORE
    with LossMatmuls() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = chunked_cross_entropy(h, head, y, chunk=16, widen=widen)
        loss.backward()
    return loss.detach(), h.grad, head.weight.grad, rec


def test_a_bf16_run_puts_no_fp32_operand_into_the_loss_matmuls_where_the_kernel_exists() -> None:
    loss, gh, gw, rec = _case(widen=True)
    assert any("addmm.dtype_out" in op for op, _ in rec.seen), rec.seen
    assert all(torch.float32 not in dtypes for _, dtypes in rec.seen), rec.seen
    assert gw.dtype == torch.float32
    ref_loss, ref_gh, ref_gw, ref = _case(widen=False)  # the fp32 matmul it replaces
    assert any(torch.float32 in dtypes for _, dtypes in ref.seen)
    assert torch.equal(loss, ref_loss) and torch.equal(gh, ref_gh)  # only the head's gradient changes path
    # From the bf16-rounded softmax gradient instead of its fp32 value: within bf16's rounding of the result.
    assert torch.allclose(gw, ref_gw, rtol=2e-2, atol=2e-2 * float(ref_gw.abs().max()))


def test_a_cpu_keeps_the_fp32_head_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not widening_matmul(torch.device("cpu"))
    *_, rec = _case(widen=None)
    assert not any("dtype_out" in op for op, _ in rec.seen)
    monkeypatch.setattr(loss_mod, "widening_matmul", lambda device: True)  # the GPU's answer
    *_, rec = _case(widen=None)
    assert any("addmm.dtype_out" in op for op, _ in rec.seen)


def test_a_bf16_full_fine_tune_step_on_the_gpu_path(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole bf16 full fine-tune step with the GPU's answer: no fp32 operand in any matmul of the loss."""
    monkeypatch.setattr(loss_mod, "widening_matmul", lambda device: True)
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_qwen2), data=str(small_data), output_dir=str(tmp_path / "r"),
                       method="full", precision="bf16", max_seq_len=256, micro_batch=4, grad_accum=1, max_steps=2,
                       attn_implementation="sdpa")
    recipe = FineTune(load_config(cfg), init_distributed(), quiet=True)
    recipe.setup()
    rows = recipe.batches.step(0)
    recipe.logger = StepLogger(MetricsLog(recipe.run_dir, recipe.env), recipe.env, 100, 2, 0, recipe.batches.epoch_of,
                               0.0, show=False)
    with LossMatmuls() as rec:
        grad_norm = recipe.train_step(0, rows)
    assert torch.isfinite(grad_norm)
    assert any("addmm.dtype_out" in op for op, _ in rec.seen), rec.seen
    assert all(torch.float32 not in dtypes for _, dtypes in rec.seen), rec.seen
