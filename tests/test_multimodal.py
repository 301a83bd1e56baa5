"""Vision-language fine-tuning: image rows in each format, their validation, the processor's tokens and M-RoPE
positions, packing, LoRA on the language model only, and real CLI runs (single, and 2 ranks under zero3 where one
rank's batch has no image)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

from shardfit.cli.main import main
from shardfit.config import Config, LoraSettings
from shardfit.data.dataset import DataStats, encode_split, load_conversations, read_split
from shardfit.data.tokenize import IGNORE
from shardfit.errors import UserError
from shardfit.models.adapters import setup_trainable
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel.parallelize import fsdp_units
from shardfit.plan.media import DEFAULT_MAX_PIXELS, MediaLoad
from tests.helpers import read_jsonl, run_cli, run_here, train_here, write_config, write_images
from tests.media_checks import assert_adapters_match, assert_packed_loss_equals_unpacked, assert_two_ranks_match_one

COLOURS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 255)}


def _rows(folder: str = "img") -> list[dict]:
    """One row per format and colour, a text-only row, and a row with two images of different sizes."""
    rows = []
    for name in COLOURS:
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                  {"role": "assistant", "content": name}], "images": [f"{folder}/{name}.png"]})
        rows.append({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                "image_url": {"url": f"{folder}/{name}.png"}},
                                                               {"type": "text", "text": "Name the colour."}]},
                                  {"role": "assistant", "content": name}]})
    rows.append({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]})
    rows.append({"messages": [{"role": "user", "content": "<image> then <image>: which is wider?"},
                              {"role": "assistant", "content": "the first"}], "images": [f"{folder}/wide.png",
                                                                                         f"{folder}/red.png"]})
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder: generated PNGs under img/ and train.jsonl referring to them by relative path."""
    root = tmp_path_factory.mktemp("vl-data")
    write_images(root / "img", COLOURS)
    write_images(root / "img", {"wide": (90, 90, 90)}, size=(112, 56))
    return _write(root / "train.jsonl", _rows())


def _cfg(model: Path, data: Path, **over) -> Config:
    keys = dict(model=str(model), data=str(data), precision="fp32", max_seq_len=128)
    keys.update(over)
    return Config(**keys, lora=LoraSettings(rank=4, alpha=8))


def _encoded(tiny_vl: Path, data: Path, **over):
    cfg = _cfg(tiny_vl, data, **over)
    source = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    vision = load_vision_processor(source, cfg, tok)
    split = read_split(cfg)
    return cfg, vision, split, encode_split(cfg, tok, split, vision)[0]


def test_rows_in_each_format_carry_their_images(vl_data: Path) -> None:
    (vl_data.parent / "sharegpt.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "blue"}],
         "images": ["img/blue.png"]}]))
    convs = load_conversations([str(vl_data), str(vl_data.parent / "sharegpt.json")], False, DataStats())
    assert [len(c.images) for c in convs] == [1, 1, 1, 1, 1, 1, 0, 2, 1]
    assert all(Path(p).is_absolute() and Path(p).is_file() for c in convs for p in c.images)
    # Content parts become text with a placeholder where the image was, in order.
    assert convs[1].messages[0]["content"] == "<image>Name the colour."
    assert convs[8].images[0].endswith("img/blue.png")


@pytest.mark.parametrize("row, why", [
    ({"messages": [{"role": "user", "content": "<image><image>?"}, {"role": "assistant", "content": "x"}],
      "images": ["img/red.png"]}, "2 <image> placeholder(s) in the text but 1 image(s)"),
    ({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
      "images": ["img/missing.png"]}, "image not found"),
    ({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
      "images": ["broken.png"]}, "cannot be read"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]},
                   {"role": "assistant", "content": "x"}]}, "only local image files"),
    ({"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
      "videos": ["a.mp4"]}, "video file not found"),
])
def test_bad_image_rows_name_their_line_or_are_counted(vl_data: Path, row: dict, why: str) -> None:
    (vl_data.parent / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    good = _rows()[0]
    path = _write(vl_data.parent / "bad.jsonl", [good, row, good])
    with pytest.raises(UserError, match=rf"bad\.jsonl:2: .*{re.escape(why)}"):
        load_conversations(str(path), False, DataStats())
    stats = DataStats()
    assert len(load_conversations(str(path), True, stats)) == 2 and stats.skipped == 1


def test_image_tokens_and_mrope_positions_match_the_model(tiny_vl: Path, vl_data: Path) -> None:
    cfg, vision, split, examples = _encoded(tiny_vl, vl_data)
    ex = examples[-1]  # two images: 112x56 (4x8 patches -> 8 tokens) and 56x56 (4x4 -> 4 tokens)
    ids = torch.tensor([ex.input_ids])
    assert ex.image_grid_thw.tolist() == [[1, 4, 8], [1, 4, 4]]
    assert int((ids == vision.image_token_id).sum()) == 12
    assert all(t == IGNORE for i, t in zip(ex.input_ids[1:], ex.targets, strict=False) if i == vision.image_token_id)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl)
    want, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == vision.image_token_id).int(),
                                         image_grid_thw=ex.image_grid_thw)
    assert want[:, 0].tolist() == ex.mrope


def test_image_beyond_max_seq_len_stops_before_the_model(tiny_vl: Path, vl_data: Path) -> None:
    with pytest.raises(UserError, match=r"train\.jsonl:8: its 12 image tokens and text take 57 tokens, beyond "
                                        r"max_seq_len=40; raise max_seq_len, or lower image_max_pixels"):
        _encoded(tiny_vl, vl_data, max_seq_len=40)
    # Fewer pixels per image: fewer tokens, and the same row fits.
    _, _, _, examples = _encoded(tiny_vl, vl_data, max_seq_len=48, image_max_pixels=28 * 28)
    assert examples[-1].image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 2]]


@pytest.mark.parametrize("arch", ["tiny_vl", "tiny_vl25"])
def test_packed_loss_equals_unpacked(arch: str, request: pytest.FixtureRequest, vl_data: Path) -> None:
    path = request.getfixturevalue(arch)
    cfg, vision, split, examples = _encoded(path, vl_data, max_seq_len=256)
    assert_packed_loss_equals_unpacked(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
                                       examples)

def test_lora_adapts_the_language_model_and_keeps_units_uniform(tiny_vl: Path, vl_data: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    wrapped = setup_trainable(model, _cfg(tiny_vl, vl_data, train_projector=True))
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert any("language_model" in n and "lora_" in n for n in names)
    assert not any("visual" in n and "lora_" in n for n in names)
    assert any("merger" in n for n in names) and not any("visual.blocks" in n for n in names)
    for unit in fsdp_units(wrapped):  # every vision unit all-frozen or all-trainable
        if any("visual" in n for n, _ in wrapped.named_modules() if _ is unit):
            assert len({p.requires_grad for p in unit.parameters()}) == 1


# test_qwen3_omni trains on image rows and writes the processor; test_vl_families under zero3
@pytest.mark.heavy
def test_train_with_images_writes_adapter_and_processor(tmp_path: Path, tiny_vl: Path, vl_data: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """`train` as a user runs it; `export` and `chat` in this process (the CLI's own `main`: no start-up each)."""
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl), data=str(vl_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=3, log_steps=1, save_steps=100,
                       strategy="single", output_dir=str(tmp_path / "run"), report_to=["none"])
    r = run_cli("train", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "8 images (M-RoPE positions kept per example in packed rows)" in r.stdout
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "preprocessor_config.json").is_file() and (adapter / "tokenizer.json").is_file()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    # export --merge: a folder the transformers classes load, that generates from an image.
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert "AutoModelForImageTextToText" in capsys.readouterr().out
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    processor = AutoImageProcessor.from_pretrained(tmp_path / "merged", backend="pil")
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    pixels = processor(images=[Image.new("RGB", (56, 56), (255, 0, 0))], return_tensors="pt")
    prompt = ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Colour?<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image = merged.config.image_token_id
    out = merged.generate(ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                          mm_token_type_ids=(ids == image).int(), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    # chat --image on the run: its adapter on the base model, the image through the run's processor.
    assert main(["chat", str(tmp_path / "run"), "--image", str(vl_data.parent / "img" / "red.png"), "--prompt",
                 "Colour?", "--max-new-tokens", "3", "--device", "cpu"]) == 0  # a random model: any reply will do
    # A bad image row stops the run before the model loads, naming file:line.
    bad = _write(tmp_path / "bad.jsonl", [_rows(str(vl_data.parent / "img"))[0],
                                          {"messages": [{"role": "user", "content": "<image>"},
                                                        {"role": "assistant", "content": "x"}]}])
    r = run_cli("train", str(cfg), "--set", f"data={bad}", "--set", f"output_dir={tmp_path / 'bad'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad.jsonl:2:" in r.stderr and "lists no images" in r.stderr and "loading" not in r.stderr


def test_qlora_trains_on_image_rows(tmp_path: Path, tiny_vl: Path, vl_data: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    """4-bit frozen weights under the same image rows: the language model's linears quantized, the tower as is."""
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl), data=str(vl_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=2, log_steps=1, save_steps=100, method="qlora",
                       strategy="single", output_dir=str(tmp_path / "run"), report_to=["none"])
    assert "images" in train_here(cfg, capsys)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, arch", [pytest.param("ddp", "tiny_vl", marks=pytest.mark.heavy),
                                            pytest.param("zero2", "tiny_vl25", marks=pytest.mark.heavy),
                                            pytest.param("zero3", "tiny_vl", marks=pytest.mark.heavy),
                                            # test_vl_families.py holds the imageless zero3 rank
                                            pytest.param("zero3", "tiny_vl25", marks=pytest.mark.heavy)])
def test_rank_without_image_matches_single_process(tmp_path: Path, vl_data: Path, strategy: str, arch: str,
                                                   request: pytest.FixtureRequest) -> None:
    """Two rows, one with an image and one without, one row per rank: every step one rank has no image (the
    classic ZeRO-3 stall). The merger trains (train_projector), so its gradients are reduced across ranks too."""
    tiny_vl = request.getfixturevalue(arch)
    data = _write(vl_data.parent / "two.jsonl", [_rows()[0], _rows()[6]])
    one, two = assert_two_ranks_match_one(tmp_path, tiny_vl, data, strategy, steps=4, train_projector=True)
    assert_adapters_match(one, two, "merger", atol=1e-6)

@pytest.mark.parametrize("size, max_pixels", [((1024, 768), DEFAULT_MAX_PIXELS), ((4000, 3000), 1003520),
                                              ((30, 20), DEFAULT_MAX_PIXELS), ((56, 112), 112 * 112)])
def test_planned_image_tokens_match_the_image_processor(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    media = MediaLoad(1, width, height, max_pixels=max_pixels)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
    grid = processor(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert [1, *[d // 14 for d in media.resized()]] == grid
    assert media.tokens_per_image() == grid[1] * grid[2] // 4


def test_plan_counts_image_tokens_and_refuses_what_cannot_fit(capsys: pytest.CaptureFixture) -> None:
    args = ("plan", "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--gpus", "8x24GB", "--batch", "1", "--json")
    code, out, err = run_here(capsys, *args, "--images-per-sample", "2", "--image-size", "1024x768", "--seq", "4096")
    assert code in (0, 3), err
    media = json.loads(out)["media"]
    assert media["tokens_per_image"] == 999 and media["media_tokens_per_sample"] == 1998
    code, _, err = run_here(capsys, *args, "--images-per-sample", "4", "--image-size", "1024x768", "--seq", "2048")
    assert code == 2 and "3996 tokens" in err and "--image-max-pixels" in err


def test_check_makes_a_half_frozen_vision_block_uniform(tmp_path: Path, tiny_vl: Path, vl_data: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "vl.yaml", model=str(tiny_vl), data=str(vl_data), precision="fp32",
                       max_seq_len=128, method="full", strategy="zero3", freeze_vision_tower=False,
                       freeze_modules=["visual.blocks.0.attn"], output_dir=str(tmp_path / "run"))
    code, out, err = run_here(capsys, "check", str(cfg), "--nproc", "2", "--json")  # zero3 shards on 2 ranks
    assert code == 0, err[-2000:]
    found = {f["rule"]: f for f in json.loads(out)["findings"]}
    rule = found["vision_unit_mixed_requires_grad"]
    assert rule["auto_fixed"] and "vision unit 0" in rule["where"] and "trained whole" in rule["message"]
    assert "unused_module" not in found  # the VL forward runs the vision tower

