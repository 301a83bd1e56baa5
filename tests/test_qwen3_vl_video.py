"""Video rows on Qwen3-VL (dense and MoE): the timestamped blocks its processor writes (a "<S seconds>" text, then
vision_start, one temporal patch's tokens, vision_end, per temporal patch), checked against transformers' own
Qwen3VLProcessor text, get_rope_index and forward (pixel_values_videos, video_grid_thw), and a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen3VLProcessor

from shardfit.config import Config, LoraSettings
from shardfit.data.dataset import encode_split, read_split
from shardfit.data.loader import collate
from shardfit.data.packing import no_pack
from shardfit.data.tokenize import IGNORE
from shardfit.data.video import SampledVideo, VideoClip
from shardfit.errors import UserError
from shardfit.models.experts import aux_loss_of, moe_top_k
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.train import media_forward
from shardfit.train.loss import CausalLMLoss
from tests.helpers import read_jsonl, run_here, write_config
from tests.media_checks import assert_adapters_match, assert_two_ranks_match_one, pick_rows
from tests.vl_families import make_tiny_glm4v_moe, make_tiny_qwen3_vl

FRAMES = 5  # 64x64 noise frames: 4x4 patches of 16 pixels, 4 tokens per temporal patch; 5 frames, 3 patches


def _rows() -> list[dict]:
    """A video row (a frames folder), an image-and-video row (a frame list) and a text row."""
    return [{"messages": [{"role": "user", "content": "<video>What happens?"},
                          {"role": "assistant", "content": "noise moves"}], "videos": ["clip"]},
            {"messages": [{"role": "user", "content": "<image> and <video>: the same noise?"},
                          {"role": "assistant", "content": "no"}], "images": ["a.png"],
             "videos": [["clip/f0.png", "clip/f1.png", "clip/f2.png"]]},
            {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}]


@pytest.fixture(scope="module")
def video_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noise frames and a noise image (every patch differs, so every feature and deepstack feature does)."""
    root = tmp_path_factory.mktemp("qwen3-vl-video")
    rng = np.random.default_rng(0)
    (root / "clip").mkdir()
    for i in range(FRAMES):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / "clip" / f"f{i}.png")
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(root / "a.png")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return root / "train.jsonl"


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def tiny_qwen3_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  tokenizer_dir: Path) -> Path:
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)


def _encoded(model: Path, data: Path, **over):
    cfg = Config(**{"model": str(model), "data": str(data), "precision": "fp32", "max_seq_len": 256,
                    "video_fps": 2.0, **over}, lora=LoraSettings(rank=4))
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    return tok, vision, encode_split(cfg, tok, read_split(cfg), vision)[0]


def _transformers_text(tok, vision, messages: list[dict], grid: torch.Tensor, frames: list[int], fps: float) -> str:
    """The row's text as transformers' Qwen3VLProcessor writes it: the chat template's
    <|vision_start|><|video_pad|><|vision_end|>, its video pad replaced by the processor's own timestamped blocks."""
    vs = vision.video
    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token=vision.start, vision_end_token=vision.end, video_token=vs.token,
                           _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    meta = SimpleNamespace(fps=fps, frames_indices=frames)
    blocks = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    marked = [dict(m, content=m["content"].replace("<image>", vision.start + vision.image_token + vision.end)
                   .replace("<video>", vision.start + vs.token + vision.end)) for m in messages]
    text = tok.apply_chat_template(marked, tokenize=False)
    image_tokens = vision.image_token * 6  # a.png: 96x64 pixels, 6x4 patches, 6 tokens
    return text.replace(vs.token, blocks, 1).replace(vision.image_token, image_tokens, 1)


def test_video_tokens_and_positions_match_transformers(tiny_qwen3_vl: Path, video_rows: Path) -> None:
    tok, vision, examples = _encoded(tiny_qwen3_vl, video_rows)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl)
    rows = _rows()
    for ex, row, n in ((examples[0], rows[0], FRAMES), (examples[1], rows[1], 3)):
        t = math.ceil(n / 2)
        assert ex.video_grid_thw.tolist() == [[t, 4, 4]]
        # The frames are at video_fps (2): frame k at k / 2 seconds, a temporal patch at its two frames' mean.
        want = tok(_transformers_text(tok, vision, row["messages"], ex.video_grid_thw, list(range(n)), 2.0),
                   add_special_tokens=False)["input_ids"]
        assert ex.input_ids == want
        ids = torch.tensor([ex.input_ids])
        assert int((ids == vision.video.token_id).sum()) == t * 4
        kinds = (ids == vision.image_token_id).int() + 2 * (ids == vision.video.token_id).int()
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=ex.image_grid_thw,
                                            video_grid_thw=ex.video_grid_thw)
        assert pos[:, 0].tolist() == ex.mrope
    assert "<0.2 seconds>" in tok.decode(examples[0].input_ids) and "<2.0 seconds>" in tok.decode(examples[0].input_ids)


def test_video_pixels_are_the_video_processor_patches(tiny_qwen3_vl: Path, video_rows: Path) -> None:
    """The frames through the image processor, paired into temporal patches, give the layout Qwen3-VL's video
    processor makes: (t, 2, C, h/2, 2, 16, w/2, 2, 16) frames -> rows (t, h/2, w/2, 2, 2), columns (C, 2, 16, 16),
    the last frame repeated to fill the last patch."""
    _, _, examples = _encoded(tiny_qwen3_vl, video_rows)
    processor = AutoImageProcessor.from_pretrained(tiny_qwen3_vl, backend="pil")
    frames = [np.asarray(Image.open(video_rows.parent / "clip" / f"f{i}.png"), np.float32) / 255 for i in
              range(FRAMES)] + [np.asarray(Image.open(video_rows.parent / "clip" / f"f{FRAMES - 1}.png"),
                                           np.float32) / 255]
    video = (torch.tensor(np.stack(frames)) - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std)
    video = video.permute(0, 3, 1, 2)  # (frames, C, 64, 64): frames at their size (a multiple of 32, in bounds)
    patches = video.reshape(3, 2, 3, 2, 2, 16, 2, 2, 16).permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(3 * 16, -1)
    torch.testing.assert_close(examples[0].video.load(), patches, rtol=0, atol=1e-5)


def test_timestamps_count_in_the_file_own_frames() -> None:
    """A file of 10 frames at 4 fps sampled to frames 0, 2, 4, 7, 9: the patches (0, 2), (4, 7), (9, 9) are at
    0.25, 1.375 and 2.25 seconds, as Qwen3VLProcessor computes them from the frame indices and the file's rate."""
    sampled = SampledVideo(VideoClip(file="v.mov", file_frames=10, seconds=2.5, rate=4.0), (0, 2, 4, 7, 9), 2.0, 4.0)
    want = Qwen3VLProcessor._calculate_timestamps(None, [0, 2, 4, 7, 9], 4.0, 2)
    assert sampled.patch_seconds(2) == pytest.approx(want) == [0.25, 1.375, 2.25]


@torch.no_grad()
def test_video_rows_lose_what_the_model_own_forward_loses(tiny_qwen3_vl: Path, video_rows: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A video row and an image-and-video row: shardfit's loss equals the model's own forward on
    pixel_values_videos and video_grid_thw (its own positions from get_rope_index, its deepstack in token order),
    and leaving the deepstack features out moves it by far more than the tolerance."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl, dtype=torch.float32).eval()
    moe = moe_top_k(model) > 0
    loss = CausalLMLoss(model, moe_top_k=moe_top_k(model), aux=aux_loss_of(model, model.config))
    _, vision, examples = _encoded(tiny_qwen3_vl, video_rows)
    rows = [r for r in no_pack(examples) if r.videos]
    assert [bool(r.pixel_values) for r in rows] == [False, True]
    for row in rows:
        b = collate([row], pad_id=2)
        total, n = loss(b.input_ids, b.position_ids, b.targets, **b.media)
        labels = torch.cat([torch.full((1, 1), IGNORE), b.targets[:, :-1]], dim=1)  # the model shifts them itself
        ids = b.input_ids
        kinds = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
        own = model(input_ids=ids, pixel_values=b.media.get("pixel_values"),
                    image_grid_thw=b.media.get("image_grid_thw"), pixel_values_videos=b.media["pixel_values_videos"],
                    video_grid_thw=b.media["video_grid_thw"], mm_token_type_ids=kinds, labels=labels,
                    output_router_logits=moe)
        tol = 2e-6 * own.loss.item()  # fp32: the two sum the same terms in another order
        assert (total / n).item() == pytest.approx(own.loss.item(), abs=tol)
        with monkeypatch.context() as m:
            m.setattr(media_forward, "deepstack_inputs", lambda spans, layers: {})
            bare = loss(b.input_ids, b.position_ids, b.targets, **b.media)[0] / n
        assert abs(bare.item() - own.loss.item()) > 10 * tol


def test_glm45v_video_rows_are_refused_naming_the_models(tmp_path: Path, tokenizer_dir: Path,
                                                         video_rows: Path) -> None:
    model = make_tiny_glm4v_moe(tmp_path / "glm", tokenizer_dir)
    with pytest.raises(UserError, match=r"train\.jsonl:1: the row has videos, which shardfit trains on Qwen2-VL, "
                                        r"Qwen2\.5-VL and Qwen3-VL \(dense and MoE\) only"):
        _encoded(model, video_rows)


@pytest.mark.slow
def test_a_run_trains_on_video_rows(tmp_path: Path, tiny_qwen3_vl: Path, video_rows: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_qwen3_vl), data=str(video_rows), precision="fp32",
                       max_seq_len=256, micro_batch=2, max_steps=2, log_steps=1, save_steps=100, lr=1e-2,
                       warmup_ratio=0.0, lora={"rank": 4, "alpha": 8}, strategy="single",
                       output_dir=str(tmp_path / "run"), report_to=["none"])
    code, out, err = run_here(capsys, "train", str(cfg))  # one process: the CLI's `main` here, no start-up
    assert code == 0, err[-3000:]
    assert "1 images, 2 videos" in out, out[-2000:]
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    if "moe" in tiny_qwen3_vl.name:
        assert all(m["aux_loss"] > 0 for m in metrics)


@pytest.mark.slow
@pytest.mark.heavy  # test_vl_families.py holds image rows on two ranks; this, an image-and-video row on one rank
def test_zero3_rank_without_media_matches_one_process(tmp_path: Path, tokenizer_dir: Path, video_rows: Path) -> None:
    """Qwen3-VL-MoE, one row per rank: the rank with the image-and-video row and the rank with the text row run
    the same tower and deepstack units, so ZeRO-3's collectives match and the losses equal one process's."""
    model = make_tiny_qwen3_vl(tmp_path / "model", tokenizer_dir, "qwen3_vl_moe")
    data = pick_rows(video_rows, (1, 2), video_rows.parent / "two.jsonl")
    one, two = assert_two_ranks_match_one(tmp_path, model, data, "zero3", steps=3, max_seq_len=256,
                                          train_projector=True, video_fps=2.0, lora={"rank": 4, "alpha": 8})
    # Adam turns the reduction-order noise of a near-zero gradient into a visible step: 6.7e-6 measured on one of
    # 512 merger values after 3 steps at lr 1e-2 (the image-only case stays within 1e-6).
    assert_adapters_match(one, two, "merger", atol=2e-5)
