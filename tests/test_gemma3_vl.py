"""Gemma 3 on image rows: shardfit's forward (the tower and projector's soft tokens in the image tokens, the
language model under the model's own mask, image tokens attending both ways) gives the loss the model's own forward
gives; a LoRA run trains on the rows (the tower frozen, the projector trained under train_projector); ZeRO-3 on
two ranks, one of them without an image, equals one process."""

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
from shardfit.infer.generate import Sampling
from shardfit.infer.images import generate_with_images, image_inputs
from shardfit.models.adapters import setup_trainable
from shardfit.models.anatomy import MEDIA_FLAG, vision_units
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.plan.media import MediaLoad
from shardfit.plan.shapes import resolve_shape
from shardfit.train import soft_token_forward
from shardfit.train.loss import CausalLMLoss
from tests.gemma3_vl import SOFT_TOKENS, make_tiny_gemma3_vl
from tests.helpers import read_jsonl, run_here, train_here, write_config
from tests.media_checks import assert_adapters_match, assert_two_ranks_match_one, pick_rows


@pytest.fixture(scope="module")
def gemma_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noise images of two sizes (the processor resizes both to the tower's square), and rows with one image
    (the `images` list), two images (OpenAI content parts) and none."""
    root = tmp_path_factory.mktemp("gemma3-data")
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a": (64, 64), "b": (96, 64)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
    rows = [{"messages": [{"role": "user", "content": "<image>What is this?"},
                          {"role": "assistant", "content": "noise"}], "images": ["a.png"]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                       {"type": "text", "text": " and "},
                                                       {"type": "image_url", "image_url": {"url": "b.png"}},
                                                       {"type": "text", "text": ": which is wider?"}]},
                          {"role": "assistant", "content": "the second"}]},
            {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    return root / "train.jsonl"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"), tokenizer_dir)


def _examples(model: Path, data: Path) -> list:
    cfg = Config(model=str(model), data=str(data), precision="fp32", max_seq_len=128, lora=LoraSettings(rank=4))
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    assert vision is not None and vision.soft_grid == (1, 2, 2)
    return encode_split(cfg, tok, read_split(cfg), vision)[0]


def test_an_image_is_its_soft_tokens_between_gemma_markers(tiny_gemma3: Path, gemma_rows: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_gemma3)
    ex = _examples(tiny_gemma3, gemma_rows)[1]
    text = tok.decode(ex.input_ids)
    image = "<start_of_image>" + "<image_soft_token>" * SOFT_TOKENS + "<end_of_image>"
    assert text.count(f"\n\n{image}\n\n") == 2  # as Gemma3Processor writes an image
    assert ex.mrope is None and len(ex.image_grid_thw) == 2  # 1-D positions
    assert all(t == IGNORE for t, i in zip(ex.targets, ex.input_ids, strict=True)
               if i == tok.convert_tokens_to_ids("<image_soft_token>"))


@torch.no_grad()
def test_image_rows_lose_what_the_model_own_forward_loses(tiny_gemma3: Path, gemma_rows: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    setattr(model, MEDIA_FLAG, True)  # as build_model marks a Gemma 3 whose folder has the processor files
    loss = CausalLMLoss(model)
    rows = no_pack(_examples(tiny_gemma3, gemma_rows))[:3]
    assert [len(r.pixel_values) for r in rows] == [1, 1, 0]  # ImagePixels per example: 1 image, 2 images, none
    for row in rows:
        b = collate([row], pad_id=2)
        total, n = loss(b.input_ids, b.position_ids, b.targets, **b.media)
        labels = torch.cat([torch.full((1, 1), IGNORE), b.targets[:, :-1]], dim=1)  # the model shifts them itself
        ids = b.input_ids
        own = model(input_ids=ids, pixel_values=b.media.get("pixel_values"),
                    token_type_ids=(ids == model.config.image_token_id).long(), labels=labels)
        tol = 1e-6 * own.loss.item()
        assert (total / n).item() == pytest.approx(own.loss.item(), abs=tol)
        if not row.pixel_values:
            continue
        # Without the image features, or without the image tokens' two-way attention, the loss differs by far
        # more than the tolerance: the test sees both.
        with monkeypatch.context() as m:
            m.setattr(soft_token_forward, "soft_tokens", lambda body, px: torch.zeros(
                px.shape[0], SOFT_TOKENS, model.config.text_config.hidden_size))
            bare = loss(b.input_ids, b.position_ids, b.targets, **b.media)[0] / n
        assert abs(bare.item() - own.loss.item()) > 10 * tol
        with monkeypatch.context() as m:
            m.setattr("transformers.models.gemma3.modeling_gemma3.get_block_sequence_ids_for_mask",
                      lambda tt, device=None: torch.full_like(tt, -1))
            causal = loss(b.input_ids, b.position_ids, b.targets, **b.media)[0] / n
        assert abs(causal.item() - own.loss.item()) > 10 * tol


def test_plan_counts_soft_tokens_per_image(capsys: pytest.CaptureFixture) -> None:
    """`shardfit plan` of the published Gemma 3 config: mm_tokens_per_image (256) per image whatever its size, the
    tower's 896-pixel square in 14-pixel patches; a sample whose images fill the sequence is refused."""
    shape = resolve_shape("google/gemma-3-27b-it")
    assert shape.soft_tower is not None
    load = shape.soft_tower.load(MediaLoad(3, 1024, 768))
    assert load.tokens_per_image() == 256 and load.tokens_per_sample() == 768
    assert load.patches_per_image() == (896 // 14) ** 2 and load.resized() == (896, 896)
    code, out, err = run_here(capsys, "plan", "--model", "google/gemma-3-27b-it", "--gpus", "8x80GB", "--seq", "2048",
                              "--images-per-sample", "3", "--image-size", "1024x768", "--json")
    assert code in (0, 3), err[-2000:]
    media = json.loads(out)["media"]
    assert media["tokens_per_image"] == 256 and media["media_tokens_per_sample"] == 768
    code, _, err = run_here(capsys, "plan", "--model", "google/gemma-3-27b-it", "--gpus", "8x80GB", "--seq", "512",
                            "--images-per-sample", "2", "--image-size", "64x64")
    assert code == 2 and "take 512 tokens (256 each)" in err and "fewer images" in err, err


@pytest.mark.slow
def test_a_lora_run_trains_on_image_rows(tmp_path: Path, tiny_gemma3: Path, gemma_rows: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "g.yaml", model=str(tiny_gemma3), data=str(gemma_rows), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=3, log_steps=1, save_steps=100, lr=1e-2,
                       warmup_ratio=0.0, lora={"rank": 4, "alpha": 8}, strategy="single", train_projector=True,
                       output_dir=str(tmp_path / "run"), report_to=["none"])
    out = train_here(cfg, capsys)
    assert "6 images" in out and "never packed" in out, out[-2000:]
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) for m in metrics)
    saved = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert not [k for k in saved if "vision_tower" in k]  # the tower stays as it is
    assert any("multi_modal_projector" in k for k in saved)  # train_projector: the projector trained whole
    assert any("language_model" in k and "lora_A" in k for k in saved)
    assert (tmp_path / "run" / "adapter" / "preprocessor_config.json").is_file()


def test_vision_units_are_the_siglip_layers_and_the_projector(tiny_gemma3: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_gemma3, dtype=torch.float32)
    setattr(model, MEDIA_FLAG, True)
    names = [type(u).__name__ for u in vision_units(model)]
    assert names == ["SiglipEncoderLayer", "SiglipEncoderLayer", "Gemma3MultiModalProjector"]


@pytest.mark.slow
@pytest.mark.heavy  # about 45 s: two CLI runs, one on two gloo ranks
def test_zero3_rank_without_image_matches_one_process(tmp_path: Path, tiny_gemma3: Path, gemma_rows: Path) -> None:
    """One row per rank, one rank without an image every step: that rank runs the tower and projector on a blank
    image, so ZeRO-3's collectives match and the losses and adapters equal one process's."""
    data = pick_rows(gemma_rows, (0, 2), gemma_rows.parent / "two.jsonl")
    # packing: false (the shared setting) changes nothing here: Gemma 3 rows are never packed
    one, two = assert_two_ranks_match_one(tmp_path, tiny_gemma3, data, "zero3", steps=3, train_projector=True,
                                          lora={"rank": 4, "alpha": 8})
    assert_adapters_match(one, two, "multi_modal_projector", atol=1e-6)


@torch.no_grad()
def test_chat_generates_from_an_image(tiny_gemma3: Path, gemma_rows: Path) -> None:
    """`chat --image` inputs for Gemma 3: the image's soft tokens marked by token_type_ids (its image mask), no
    grids; the model generates from them."""
    tok = AutoTokenizer.from_pretrained(tiny_gemma3)
    vp = load_vision_processor(resolve_model(str(tiny_gemma3)), Config(model=str(tiny_gemma3)), tok)
    image = str(gemma_rows.parent / "a.png")
    inputs = image_inputs(tok, vp, [{"role": "user", "content": "What is this?"}], [image])
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "token_type_ids"}
    assert int(inputs["token_type_ids"].sum()) == SOFT_TOKENS
    model = AutoModelForImageTextToText.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    reply = generate_with_images(model, tok, vp, [{"role": "user", "content": "What is this?"}], [image],
                                 Sampling(max_new_tokens=3))
    assert isinstance(reply, str) and reply


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_tower_stays_frozen_and_the_projector_trains(tiny_gemma3: Path, method: str) -> None:
    """LoRA and full fine-tunes of Gemma 3 on images: no adapter and no gradient in the SigLIP tower
    (freeze_vision_tower), the projector trained whole under train_projector, the language model trained."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_gemma3, dtype=torch.float32)
    setattr(model, MEDIA_FLAG, True)
    cfg = Config(model=str(tiny_gemma3), method=method, train_projector=True, lora=LoraSettings(rank=4))
    model = setup_trainable(model, cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and not [n for n in trained if "vision_tower" in n]
    assert any("multi_modal_projector" in n for n in trained)
    assert any("language_model" in n for n in trained)
    if method == "lora":
        assert not [n for n, _ in model.named_modules() if "vision_tower" in n and n.endswith("lora_A")]
