"""Video rows on Qwen2-VL / Qwen2.5-VL, as frames or video files: rows in each format and their validation, a file
sampled like its frames, temporal patches, video tokens and M-RoPE positions against the models' own get_rope_index,
packing, and a real CLI run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from shardfit.config import Config, LoraSettings
from shardfit.data.dataset import DataStats, encode_split, load_conversations, read_split
from shardfit.data.tokenize import IGNORE
from shardfit.data.video import VideoSettings, load_video, video_clip
from shardfit.errors import UserError
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from tests.helpers import read_jsonl, train_here, write_config, write_images
from tests.media_checks import assert_packed_loss_equals_unpacked, assert_two_ranks_match_one

FRAMES = {"f1": (255, 0, 0), "f2": (0, 200, 0), "f3": (0, 0, 255)}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(root: Path | None = None) -> list[dict]:
    """A `videos` row with a frames folder, a content-part row with a frame list, a row with an image and a video,
    and a text row. `root`: absolute paths."""
    a = f"{root}/" if root else ""
    frames = [f"{a}clip/{n}.png" for n in FRAMES]
    return [
        {"messages": [{"role": "user", "content": "<video>What happens?"},
                      {"role": "assistant", "content": "red, green, blue"}], "videos": [f"{a}clip"]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": frames[:2]},
                                                   {"type": "text", "text": "Colours?"}]},
                      {"role": "assistant", "content": "red then green"}]},
        {"messages": [{"role": "user", "content": "<image> and <video>: same first colour?"},
                      {"role": "assistant", "content": "yes"}], "images": [f"{a}clip/f1.png"],
         "videos": [frames[1:]]},
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]},
    ]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("video-data")
    write_images(root / "clip", FRAMES)
    return _write(root / "train.jsonl", _rows())


def _encoded(model: Path, data: Path, **over):
    keys = dict(model=str(model), data=str(data), precision="fp32", max_seq_len=256)
    keys.update(over)
    cfg = Config(**keys, lora=LoraSettings(rank=4, alpha=8))
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    return vision, encode_split(cfg, tok, read_split(cfg), vision)[0]


def test_video_rows_carry_their_frames(video_data: Path) -> None:
    convs = load_conversations(str(video_data), False, DataStats())
    assert [len(c.videos) for c in convs] == [1, 1, 1, 0]
    assert [len(v) for v in convs[0].videos + convs[1].videos + convs[2].videos] == [3, 2, 2]
    assert convs[1].messages[0]["content"] == "<video>Colours?"
    assert convs[0].videos[0].frames[0].endswith("clip/f1.png")


@pytest.mark.parametrize("row, why", [
    ({"messages": [{"role": "user", "content": "<video><video>?"}, {"role": "assistant", "content": "x"}],
      "videos": ["clip"]}, "2 <video> placeholder(s) in the text but 1 video(s)"),
    ({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
      "videos": ["talk.mp4"]}, "video file not found"),
    ({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
      "videos": ["broken.mp4"]}, "does not decode as a video"),
    ({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
      "videos": ["nothere"]}, "video frames folder not found"),
    ({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
      "videos": [["clip/f1.png", "clip/gone.png"]]}, "image not found"),
])
def test_bad_video_rows_name_their_line(video_data: Path, row: dict, why: str) -> None:
    (video_data.parent / "broken.mp4").write_bytes(b"\x00\x01 not a video" * 64)
    path = _write(video_data.parent / "bad.jsonl", [_rows()[0], row])
    with pytest.raises(UserError, match=rf"bad\.jsonl:2: .*{re.escape(why)}"):
        load_conversations(str(path), False, DataStats())
    stats = DataStats()
    assert len(load_conversations(str(path), True, stats)) == 1 and stats.skipped == 1


def test_temporal_patches_hold_consecutive_frames(tiny_vl: Path, video_data: Path) -> None:
    processor = AutoImageProcessor.from_pretrained(tiny_vl, backend="pil")
    clip = video_data.parent / "clip"
    frames = [Image.open(clip / n).convert("RGB") for n in ("f1.png", "f3.png", "f2.png")]
    pixels, grid = load_video(processor, frames)
    assert grid.tolist() == [[2, 4, 4]] and pixels.shape == (32, 3 * 2 * 14 * 14)
    # The patch embedding reads a row as (channel, frame, 14, 14): frame k of a temporal patch is video frame 2g+k,
    # the last patch repeating the last frame.
    rows = pixels.reshape(2, 16, 3, 2, 14 * 14)
    image = processor(images=frames, return_tensors="pt")["pixel_values"].reshape(3, 16, 3, 2, 14 * 14)
    for g, k, frame in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 2)):
        assert torch.equal(rows[g, :, :, k], image[frame, :, :, 0])


@pytest.mark.parametrize("arch", ["tiny_vl", "tiny_vl25"])
def test_video_tokens_and_positions_match_the_model(arch: str, request: pytest.FixtureRequest,
                                                    video_data: Path) -> None:
    path = request.getfixturevalue(arch)
    vision, examples = _encoded(path, video_data, video_fps=1.0)
    ex = examples[2]  # a 56x56 image (4 tokens), then 2 frames of 56x56 (1 temporal patch: 4 tokens)
    ids = torch.tensor([ex.input_ids])
    video = vision.video.token_id
    assert ex.video_grid_thw.tolist() == [[1, 4, 4]] and int((ids == video).sum()) == 4
    assert all(t == IGNORE for i, t in zip(ex.input_ids[1:], ex.targets, strict=False) if i == video)
    model = AutoModelForImageTextToText.from_pretrained(path)
    extra = {"second_per_grid_ts": torch.tensor([2.0])} if arch == "tiny_vl25" else {}
    ex0 = examples[0]  # three frames: 2 temporal patches, temporal positions spaced by the model's interval
    for e in (ex, ex0):
        ids = torch.tensor([e.input_ids])
        kinds = (ids == vision.image_token_id).int() + 2 * (ids == video).int()
        want, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=e.image_grid_thw,
                                             video_grid_thw=e.video_grid_thw, **extra)
        assert want[:, 0].tolist() == e.mrope
    # video_max_frames samples frames down: three frames become two, one temporal patch.
    _, capped = _encoded(path, video_data, video_max_frames=2)
    assert capped[0].video_grid_thw.tolist() == [[1, 4, 4]]


def _write_video(path: Path, colours: list[tuple[int, int, int]], fps: int) -> Path:
    """A lossless video file (PNG frames in a QuickTime container) of solid 56x56 frames, one per colour."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("png", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "rgb24"
        for rgb in colours:
            frame = av.VideoFrame.from_ndarray(np.full((56, 56, 3), rgb, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def test_video_file_trains_as_its_frames(tiny_vl25: Path, video_data: Path, tmp_path: Path) -> None:
    """A video file sampled at video_fps gives the same pixels, grid and positions as its frames given as images."""
    root = video_data.parent
    _write_video(tmp_path / "clip.mov", list(FRAMES.values()), fps=2)
    (tmp_path / "clip").symlink_to(root / "clip")
    rows = _rows()[:1]
    data = _write(tmp_path / "file.jsonl", [dict(rows[0], videos=["clip.mov"])])
    frames = _write(tmp_path / "frames.jsonl", rows)
    (a,), (b,) = (_encoded(tiny_vl25, d, video_fps=2.0)[1] for d in (data, frames))
    assert a.input_ids == b.input_ids and a.mrope == b.mrope and a.video_grid_thw.tolist() == [[2, 4, 4]]
    assert torch.equal(a.video.load(), b.video.load())


def test_video_file_is_sampled_at_video_fps(tmp_path: Path) -> None:
    """10 frames at 4 fps (2.5 s) sampled at 2 fps keep 5 frames evenly spread; video_max_frames caps them."""
    _write_video(tmp_path / "v.mov", [(25 * i, 0, 0) for i in range(10)], fps=4)
    clip = video_clip("v.mov", tmp_path, "videos[0]")
    assert (clip.file_frames, clip.seconds, clip.rate) == (10, 2.5, 4.0)
    five = VideoSettings("<|video_pad|>", 0, max_frames=64, fps=2.0).sampled(clip)
    assert five.picks == (0, 2, 4, 7, 9) and five.fps == 2.0 and five.source_fps == 4.0
    assert [im.getpixel((0, 0))[0] for im in five.images()] == [0, 50, 100, 175, 225]
    three = VideoSettings("<|video_pad|>", 0, max_frames=3, fps=2.0).sampled(clip)
    assert three.picks == (0, 4, 9) and three.fps == pytest.approx(1.2)


def test_video_file_without_pyav_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_video(tmp_path / "v.mov", [(0, 0, 0)] * 2, fps=2)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(Exception, match=r"needs PyAV: pip install 'shardfit\[video\]'.*ffmpeg -i v\.mov"):
        video_clip("v.mov", tmp_path, "videos[0]")


def test_packed_loss_equals_unpacked_with_video(tiny_vl25: Path, video_data: Path) -> None:
    _, examples = _encoded(tiny_vl25, video_data)
    assert_packed_loss_equals_unpacked(AutoModelForImageTextToText.from_pretrained(tiny_vl25, dtype=torch.float32),
                                       examples)

def test_train_with_video_frames(tmp_path: Path, tiny_vl: Path, video_data: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl), data=str(video_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=2, log_steps=1, save_steps=100,
                       strategy="single", output_dir=str(tmp_path / "run"), report_to=["none"])
    assert "1 images, 3 videos (M-RoPE positions kept per example in packed rows)" in train_here(cfg, capsys)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


@pytest.mark.slow
@pytest.mark.heavy  # test_vl_families.py holds the media-free zero3 rank; this, the same with a video row
def test_rank_without_video_matches_single_process(tmp_path: Path, tiny_vl25: Path, video_data: Path) -> None:
    """One row with a video and one text row, one row per rank under zero3: the rank without a video still runs
    the vision tower (on a blank image), so the collectives match; losses equal one process's."""
    root = video_data.parent
    data = _write(tmp_path / "two.jsonl", [_rows(root)[0], _rows(root)[3]])
    assert_two_ranks_match_one(tmp_path, tiny_vl25, data, "zero3", steps=3, train_projector=True)
