"""Checks the multimodal tests share: the loss of packed against unpacked rows, and two ranks (one without media
in every step) against one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardfit.data.loader import collate
from shardfit.data.packing import no_pack, pack
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import Hardware
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from shardfit.simulate.step import simulate
from shardfit.train.loss import CausalLMLoss
from tests.helpers import read_jsonl, run_cli, train_here, write_config


@torch.no_grad()
def summed_loss(loss: CausalLMLoss, rows: list) -> float:
    """The summed token loss of `rows`, one row per batch."""
    out = 0.0
    for r in rows:
        b = collate([r], pad_id=2)
        out += float(loss(b.input_ids, b.position_ids, b.targets, **b.media)[0])
    return out


def assert_packed_loss_equals_unpacked(model: torch.nn.Module, examples: list, max_len: int = 256) -> None:
    """Packing several examples into a row (each keeping its own positions and media) changes no token's loss."""
    loss = CausalLMLoss(model)
    packed, single = pack(examples, max_len), no_pack(examples)
    assert len(packed) < len(single)
    assert summed_loss(loss, packed) == pytest.approx(summed_loss(loss, single), rel=1e-5)


def pick_rows(rows: Path, picks: tuple[int, ...], dest: Path) -> Path:
    """A data file at `dest` of the lines `picks` of the JSONL file `rows`, in that order."""
    lines = rows.read_text().splitlines()
    dest.write_text("".join(lines[i] + "\n" for i in picks))
    return dest


def assert_two_ranks_match_one(tmp_path: Path, model: Path, data: Path, strategy: str, steps: int,
                               **over: object) -> tuple[Path, Path]:
    """Train `model` on `data` (two rows, one per rank) on one process with grad_accum 2 and on 2 ranks of
    `strategy`: the same losses at every step (fp32 on both sides: only the reduction order differs). `over` adds
    or replaces keys of the shared setting (unpacked rows, micro-batch 1, lr 1e-2). Returns both run folders."""
    keys = dict(model=str(model), data=str(data), precision="fp32", max_seq_len=128, micro_batch=1, max_steps=steps,
                log_steps=1, save_steps=100, lr=1e-2, warmup_ratio=0.0, packing=False, report_to=["none"],
                watchdog_min_s=120.0) | over
    one = write_config(tmp_path / "one.yaml", **keys, strategy="single", grad_accum=2,
                       output_dir=str(tmp_path / "one"))
    two = write_config(tmp_path / "two.yaml", **keys, strategy=strategy, output_dir=str(tmp_path / "two"))
    train_here(one)
    r = run_cli("train", str(two), "--nproc", "2", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    want = [m["loss"] for m in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    have = [m["loss"] for m in read_jsonl(tmp_path / "two" / "metrics.jsonl")]
    assert len(have) == steps and have == pytest.approx(want, rel=1e-5)
    return tmp_path / "one", tmp_path / "two"


def assert_adapters_match(one: Path, two: Path, part: str, atol: float) -> None:
    """Both runs saved the same adapter tensors, `part` (a module name) among them, equal within `atol`."""
    a = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert any(part in k for k in a) and a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=atol)


PARTS = ("weights", "grads", "optimizer", "activations", "logits", "temporaries")


def assert_estimate_matches_simulation(shape: ModelShape, w: Workload, hw: Hardware, strategy: str,
                                       config: str | None):  # noqa: ANN201 - the two candidates
    """The analytic estimate and the fake-tensor simulation of one candidate agree within 5 % on every column;
    returns both for the caller's own checks."""
    ca, cs = estimate(shape, w, hw, strategy), simulate(shape, w, hw, strategy, config)
    for part in PARTS:
        assert getattr(ca.per_gpu_gib, part) == pytest.approx(getattr(cs.per_gpu_gib, part), rel=0.05, abs=1e-4), part
    return ca, cs
