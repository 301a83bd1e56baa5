"""The 2026 vision-language families on image rows (Qwen3-VL dense and MoE, GLM-4.5V): shardfit's forward (with
Qwen3-VL's deepstack features added to the language model's first blocks) gives the loss the model's own forward
gives, and a run trains on the rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer

from shardfit.config import Config, LoraSettings
from shardfit.data.dataset import encode_split, read_split
from shardfit.data.loader import collate
from shardfit.data.packing import no_pack
from shardfit.data.tokenize import IGNORE
from shardfit.models.experts import aux_loss_of, moe_top_k
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.train import media_forward
from shardfit.train.loss import CausalLMLoss
from tests.helpers import read_jsonl, train_here, write_config
from tests.media_checks import assert_adapters_match, assert_two_ranks_match_one, pick_rows
from tests.vl_families import make_tiny_qwen3_vl, make_tiny_vl_family

ARCHS = ["qwen3_vl", "qwen3_vl_moe", "glm4v_moe"]


@pytest.fixture(scope="module")
def vl_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noise images (every patch differs, so each deepstack feature does) of two sizes, and rows with one image,
    two images and none."""
    root = tmp_path_factory.mktemp("vl-family-data")
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a": (64, 64), "b": (96, 64), "c": (64, 128)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
    rows = [{"messages": [{"role": "user", "content": "<image>What is this?"},
                          {"role": "assistant", "content": "noise"}], "images": ["a.png"]},
            {"messages": [{"role": "user", "content": "<image> and <image>: which is taller?"},
                          {"role": "assistant", "content": "the second"}], "images": ["b.png", "c.png"]},
            {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    return root / "train.jsonl"


@pytest.fixture(scope="module", params=ARCHS)
def tiny_vl_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   tokenizer_dir: Path) -> Path:
    return make_tiny_vl_family(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)


def _examples(model: Path, data: Path) -> list:
    cfg = Config(model=str(model), data=str(data), precision="fp32", max_seq_len=128, lora=LoraSettings(rank=4))
    vision = load_vision_processor(resolve_model(cfg.model), cfg, AutoTokenizer.from_pretrained(model))
    return encode_split(cfg, AutoTokenizer.from_pretrained(model), read_split(cfg), vision)[0]


@torch.no_grad()
def test_image_rows_lose_what_the_model_own_forward_loses(tiny_vl_family: Path, vl_rows: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_family, dtype=torch.float32).eval()
    moe = moe_top_k(model) > 0
    loss = CausalLMLoss(model, moe_top_k=moe_top_k(model), aux=aux_loss_of(model, model.config))
    rows = [r for r in no_pack(_examples(tiny_vl_family, vl_rows)) if r.pixel_values][:2]
    assert [sum(len(g) for g in r.image_grid_thw) for r in rows] == [1, 2]
    for row in rows:
        b = collate([row], pad_id=2)
        total, n = loss(b.input_ids, b.position_ids, b.targets, **b.media)
        labels = torch.cat([torch.full((1, 1), IGNORE), b.targets[:, :-1]], dim=1)  # the model shifts them itself
        ids = b.input_ids
        own = model(input_ids=ids, pixel_values=b.media["pixel_values"], image_grid_thw=b.media["image_grid_thw"],
                    mm_token_type_ids=(ids == model.config.image_token_id).int(), labels=labels,
                    output_router_logits=moe)
        tol = 2e-6 * own.loss.item()  # fp32: the two sum the same terms in another order
        assert (total / n).item() == pytest.approx(own.loss.item(), abs=tol)
        if moe:  # the load-balancing loss joined both, with the config's coefficient
            assert float(loss.last_moe.aux_sum) > 0
        if not getattr(model.config.vision_config, "deepstack_visual_indexes", None):
            continue
        # Without the deepstack features the loss differs by ten times the tolerance or more: the test sees them.
        with monkeypatch.context() as m:
            m.setattr(media_forward, "deepstack_inputs", lambda spans, layers: {})
            bare = loss(b.input_ids, b.position_ids, b.targets, **b.media)[0] / n
        assert abs(bare.item() - own.loss.item()) > 10 * tol


@pytest.mark.slow
def test_a_run_trains_on_image_rows(tmp_path: Path, tiny_vl_family: Path, vl_rows: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl_family), data=str(vl_rows), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=3, log_steps=1, save_steps=100, lr=1e-2,
                       warmup_ratio=0.0, lora={"rank": 4, "alpha": 8}, strategy="single",
                       output_dir=str(tmp_path / "run"), report_to=["none"])
    out = train_here(cfg, capsys)
    assert "6 images" in out, out[-2000:]
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) for m in metrics)
    saved = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert not [k for k in saved if "visual" in k or ".gate." in k]  # the tower and the routers stay as they are
    if "moe" in tiny_vl_family.name:  # GLM-4.5V's transformers class has a load-balancing loss too
        assert all(m["aux_loss"] > 0 for m in metrics)
        assert any(".experts." in k for k in saved)
    assert (tmp_path / "run" / "adapter" / "preprocessor_config.json").is_file()


@pytest.mark.slow
def test_zero3_rank_without_image_matches_one_process(tmp_path: Path, tokenizer_dir: Path, vl_rows: Path) -> None:
    """Qwen3-VL-MoE, one row per rank, one rank without an image every step: that rank runs the tower (its
    deepstack mergers too) on a blank image, so ZeRO-3's collectives match and the losses equal one process's."""
    model = make_tiny_qwen3_vl(tmp_path / "model", tokenizer_dir, "qwen3_vl_moe")
    data = pick_rows(vl_rows, (0, 2), vl_rows.parent / "two.jsonl")
    one, two = assert_two_ranks_match_one(tmp_path, model, data, "zero3", steps=3, train_projector=True,
                                          lora={"rank": 4, "alpha": 8})
    assert_adapters_match(one, two, "merger", atol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ["qwen3_vl", "glm4v_moe"])
def test_zero3_matches_one_process_on_the_other_families(tmp_path: Path, tokenizer_dir: Path, vl_rows: Path,
                                                         arch: str) -> None:
    """Qwen3-VL (dense) and GLM-4.5V as the test above runs Qwen3-VL-MoE: one rank without an image every step."""
    model = make_tiny_vl_family(tmp_path / "model", tokenizer_dir, arch)
    data = pick_rows(vl_rows, (0, 2), vl_rows.parent / f"two-{arch}.jsonl")
    one, two = assert_two_ranks_match_one(tmp_path, model, data, "zero3", steps=3, train_projector=True,
                                          lora={"rank": 4, "alpha": 8})
    assert_adapters_match(one, two, "merger", atol=1e-6)
