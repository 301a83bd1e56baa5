"""`plan --simulate` with images: the real vision-language step (vision tower on fake pixel patches, image tokens
in the sequence, M-RoPE positions) under fake tensors, against the analytic estimate's vision terms (plan/media.py),
column by column, on tiny Qwen2-VL and Qwen2.5-VL configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.media import MediaLoad, VisionShape
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.workload import Workload
from tests.helpers import run_here, write_config, write_images
from tests.media_checks import assert_estimate_matches_simulation


@pytest.mark.parametrize(("arch", "strategy", "method", "trainable", "precision", "grad_ckpt"), [
    ("tiny_vl", "single", "lora", False, "bf16", "none"),  # the default: LoRA on the language model, tower frozen
    ("tiny_vl25", "zero3", "lora", False, "bf16", "none"),  # FSDP's mixed precision keeps a 16-bit pixel copy
    ("tiny_vl25", "single", "full", True, "fp32", "none"),  # a trainable tower saves every block's activations
    ("tiny_vl25", "single", "full", False, "fp32", "none"),  # full's default: the tower has no grads, no moments
    ("tiny_vl", "zero3", "full", False, "bf16", "none"),
    ("tiny_vl", "zero3", "full", True, "bf16", "none"),
    ("tiny_vl", "single", "full", True, "fp32", "full")])  # checkpointed vision blocks keep their inputs only
def test_analytic_vision_terms_agree_with_simulate(arch: str, strategy: str, method: str, trainable: bool,
                                                   precision: str, grad_ckpt: str,
                                                   request: pytest.FixtureRequest) -> None:
    """Two images of 8x12 patches per sample: estimate and fake-tensor step agree on the peak moment and on every
    column within 5% (0.1 MiB for near-empty ones), and the estimate's image terms are a real share of it."""
    path = str(request.getfixturevalue(arch))
    w = Workload(method=method, precision=precision, seq_len=256, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=8,
                 images=2, image_rows=8, image_cols=12, vision_trainable=trainable)
    hw = parse_gpus("2x80GB" if strategy == "zero3" else "1x80GB")
    shape = resolve_shape(path)
    assert shape.vision is not None and shape.vision.gated == (arch == "tiny_vl25")
    ca, cs = assert_estimate_matches_simulation(shape, w, hw, strategy, path)
    if method == "full":  # the tower is trained or not: a small share of a tiny model, so no absolute slack here
        for part in ("grads", "optimizer"):
            assert getattr(ca.per_gpu_gib, part) == pytest.approx(getattr(cs.per_gpu_gib, part), rel=0.02), part
    assert ca.peak_phase == cs.peak_phase == "forward"
    text = estimate(shape, dataclasses.replace(w, images=0), hw, strategy).per_gpu_gib
    assert ca.per_gpu_gib.activations - text.activations > (0.5 if trainable else 0.2) * text.activations, \
        (ca.per_gpu_gib.activations, text.activations)


def test_plan_simulates_images_from_the_flags(tiny_vl: Path, capsys: pytest.CaptureFixture) -> None:
    """`--images-per-sample` / `--image-size` reach the simulated step: the patches of each resized image go
    through the tower, and the workload says so."""
    args = ("plan", "--model", str(tiny_vl), "--gpus", "1x24GB", "--seq", "256", "--batch", "2", "--precision",
            "bf16", "--strategy", "single", "--json")
    code, printed, err = run_here(capsys, *args, "--images-per-sample", "2", "--image-size", "168x112",
                                  "--image-max-pixels", "50000", "--simulate")
    assert code == 0, err[-2000:]
    out = json.loads(printed)
    assert out["workload"]["images"] == 2 and (out["workload"]["image_rows"], out["workload"]["image_cols"]) == (8, 12)
    assert out["media"]["patches_per_image"] == 96 == MediaLoad(1, 168, 112).patches_per_image()
    assert out["candidates"][0]["estimator"] == "simulated"


def test_plan_counts_images_from_the_configs_data(tmp_path: Path, tiny_vl: Path, capsys: pytest.CaptureFixture) -> None:
    """With a config and no image flags, plan samples the data's rows: the most images in a row (2) at the largest
    size seen (112x56), said on stderr; the flags override it."""
    write_images(tmp_path / "img", {"red": (255, 0, 0)})
    write_images(tmp_path / "img", {"wide": (9, 9, 9)}, size=(112, 56))
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
             "images": ["img/red.png"]},
            {"messages": [{"role": "user", "content": "<image><image>Wider?"},
                          {"role": "assistant", "content": "the first"}], "images": ["img/wide.png", "img/red.png"]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl), data=str(tmp_path / "train.jsonl"),
                       precision="bf16", max_seq_len=256, micro_batch=1, image_max_pixels=112 * 112)
    code, out, err = run_here(capsys, "plan", str(cfg), "--gpus", "1x24GB", "--strategy", "single")
    assert code == 0, err[-2000:]
    assert "images from the data: 2 of 3 sampled rows (of 3) carry images, 1.5 per such row on average, at most 2; " \
           "the largest is 112x56" in err
    assert "images: 2 per sample of 112x56 (resized to 112x56): 32 patches" in out
    code, out, err = run_here(capsys, "plan", str(cfg), "--gpus", "1x24GB", "--strategy", "single", "--json",
                              "--images-per-sample", "1", "--image-size", "56x56")
    assert code == 0 and "images from the data" not in err
    assert json.loads(out)["media"]["patches_per_image"] == 16


@pytest.mark.parametrize("gated", [False, True])
def test_catalog_vl_shape_simulates_its_tower(gated: bool) -> None:
    """A VL id from the catalog (no config.json) is simulated as a Qwen2-VL / Qwen2.5-VL config of its vision and
    text shapes: the tower's weights and the images' activations agree with the estimate."""
    vision = VisionShape(depth=2, dim=64, mlp=256 if not gated else 172, heads=4, out=256, gated=gated)
    shape = ModelShape("tiny/Tiny-VL", 2, 256, 704, 8, 2, 4096, vision=vision, extra_params=vision.params())
    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=1, grad_ckpt="full", lora_rank=8,
                 images=1, image_rows=8, image_cols=12)
    hw = parse_gpus("1x80GB")
    assert_estimate_matches_simulation(shape, w, hw, "single", None)
