"""Qwen3-Omni-MoE's thinker on media rows: the log-mel features, audio token counts and M-RoPE positions against
transformers' own, the loss of image and audio rows against the thinker's own forward (deepstack features and the
chunked audio tower included), a run on image and audio rows with the talker and code2wav left out, videos refused
naming their row, and ZeRO-3 on two ranks (one without media every step) against one process."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

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
from tests.families import MEDIA_MATRIX
from tests.helpers import read_jsonl, run_cli, run_here, train_here, write_config, write_wav
from tests.media_checks import assert_adapters_match, assert_two_ranks_match_one, pick_rows
from tests.qwen3_omni import make_tiny_qwen3_omni


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def omni3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny-qwen3-omni"), tokenizer_dir)


@pytest.fixture(scope="module")
def media_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noise images, a 1.5 s clip (two chunks of the audio tower) and a 0.5 s stereo 22.05 kHz one, in rows: an
    image row and an audio row with `images` / `audios` lists, a clip and an image as content parts (the clip as
    base64 input_audio), and a text row."""
    root = tmp_path_factory.mktemp("qwen3-omni-data")
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a": (64, 64), "b": (96, 64)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
    write_wav(root / "beep.wav", 1.5, 440.0)
    write_wav(root / "low.wav", 0.5, 220.0, rate=22050, channels=2)
    inline = base64.b64encode((root / "beep.wav").read_bytes()).decode()
    rows = [{"messages": [{"role": "user", "content": "<image>What is this?"},
                          {"role": "assistant", "content": "noise"}], "images": ["a.png"]},
            {"messages": [{"role": "user", "content": "<audio>Pitch?"}, {"role": "assistant", "content": "low"}],
             "audios": ["low.wav"]},
            {"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": inline, "format": "wav"}},
                {"type": "image", "image": "b.png"}, {"type": "text", "text": "Sound and picture?"}]},
                {"role": "assistant", "content": "a beep and noise"}]},
            {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}]
    return _write(root / "train.jsonl", rows)


def _cfg(model: Path, data: Path, **over) -> Config:
    return Config(**dict(dict(model=str(model), data=str(data), precision="fp32", max_seq_len=256), **over),
                  lora=LoraSettings(rank=4, alpha=8))


def _encoded(model: Path, data: Path, **over):
    cfg = _cfg(model, data, **over)
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    return vision, encode_split(cfg, tok, read_split(cfg), vision)[0]


def test_features_tokens_and_positions_match_transformers(omni3: Path, media_rows: Path) -> None:
    vision, examples = _encoded(omni3, media_rows)
    ap = vision.audio
    assert (ap.audio_token, ap.start, ap.end, ap.chunk) == ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>", 100)
    for name in ("beep.wav", "low.wav"):
        clip = ap.samples(str(media_rows.parent / name))
        # Qwen3-Omni's processor: a clip padded to its batch's longest (alone: not at all), no truncation.
        own = ap.feature_extractor([clip], sampling_rate=16000, padding=True, truncation=False,
                                   return_attention_mask=True, return_tensors="pt")
        feats, lens = ap.features([clip])
        assert lens.tolist() == [int(own["attention_mask"].sum())] and torch.equal(feats, own["input_features"][0])
        assert ap.tokens(len(clip)) == int(_get_feat_extract_output_lengths(lens, 50)[0])
    ex = examples[2]  # a 1.5 s clip (150 frames: 13 + 7 tokens) then a 96x64 image (6 tokens)
    ids = torch.tensor([ex.input_ids])
    assert int((ids == ap.audio_token_id).sum()) == 20 and int((ids == vision.image_token_id).sum()) == 6
    media = {ap.audio_token_id, vision.image_token_id}
    assert all(t == IGNORE for i, t in zip(ex.input_ids[1:], ex.targets, strict=False) if i in media)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(omni3)
    want, _ = model.model.get_rope_index(ids, image_grid_thw=ex.image_grid_thw, attention_mask=torch.ones_like(ids),
                                         audio_seqlens=ex.audio.load()[1])
    assert want[:, 0].long().tolist() == ex.mrope


@torch.no_grad()
def test_media_rows_lose_what_the_thinker_own_forward_loses(omni3: Path, media_rows: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each media row through shardfit's forward and through the thinker's own (its features, positions and
    load-balancing loss): the same loss. Without the deepstack features, the clip's features or the image's, it
    differs by ten times the tolerance or more: the test sees each."""
    _, examples = _encoded(omni3, media_rows)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(omni3, dtype=torch.float32).eval()
    loss = CausalLMLoss(model, moe_top_k=moe_top_k(model), aux=aux_loss_of(model, model.config))
    for ex in no_pack(examples[:3]):
        b = collate([ex], pad_id=2)
        total, n = loss(b.input_ids, b.position_ids, b.targets, **b.media)
        labels = torch.cat([torch.full((1, 1), IGNORE), b.targets[:, :-1]], dim=1)  # the model shifts them itself
        feats = b.media.get("input_features")
        own = model(input_ids=b.input_ids, attention_mask=torch.ones_like(b.input_ids), labels=labels,
                    pixel_values=b.media.get("pixel_values"), image_grid_thw=b.media.get("image_grid_thw"),
                    input_features=None if feats is None else feats[None],
                    feature_attention_mask=None if feats is None else torch.ones(1, feats.shape[1], dtype=torch.long),
                    output_router_logits=True)
        tol = 2e-6 * own.loss.item()  # fp32: the two sum the same terms in another order
        assert (total / n).item() == pytest.approx(own.loss.item(), abs=tol)
        assert float(loss.last_moe.aux_sum) > 0  # the load-balancing loss joined both
        skipped = []
        if feats is not None:
            skipped.append({k: v for k, v in b.media.items() if k not in ("input_features", "audio_feature_lens")})
        if "pixel_values" in b.media:
            skipped.append({k: v for k, v in b.media.items() if k not in ("pixel_values", "image_grid_thw")})
            with monkeypatch.context() as m:
                m.setattr(media_forward, "deepstack_inputs", lambda spans, layers: {})
                bare = loss(b.input_ids, b.position_ids, b.targets, **b.media)[0] / n
            assert abs(bare.item() - own.loss.item()) > 10 * tol
        for media in skipped:
            bare = loss(b.input_ids, b.position_ids, b.targets, **media)[0] / n
            assert abs(bare.item() - own.loss.item()) > 10 * tol


def _train_keys(model: Path, data: Path, out: Path, **over) -> dict:
    return dict(dict(model=str(model), data=str(data), precision="fp32", max_seq_len=256, micro_batch=2, max_steps=2,
                     log_steps=1, save_steps=100, lr=1e-2, warmup_ratio=0.0, strategy="single",
                     lora={"rank": 4, "alpha": 8}, output_dir=str(out), report_to=["none"]), **over)


@pytest.mark.slow
def test_a_run_trains_on_image_and_audio_rows(tmp_path: Path, omni3: Path, media_rows: Path) -> None:
    cfg = write_config(tmp_path / "omni3.yaml", **_train_keys(omni3, media_rows, tmp_path / "run"))
    r = run_cli("train", str(cfg), env={"OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "talker and token2wav not loaded" in r.stderr + r.stdout
    assert "2 images, 2 audio clips" in r.stdout, r.stdout[-2000:]
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) and m["aux_loss"] > 0 for m in metrics)
    adapter = tmp_path / "run" / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(".experts." in k for k in saved)  # LoRA on the routed experts, never on the routers or towers
    assert not [k for k in saved if "visual" in k or "audio_tower" in k or ".gate." in k or "talker" in k]
    processor = json.loads((adapter / "preprocessor_config.json").read_text())
    assert processor["feature_size"] == 128 and processor["patch_size"] == 16
    # A video row stops the run before the model loads, naming file:line and why.
    (tmp_path / "frames").mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(tmp_path / "frames" / f"{i}.png")
    video = _write(tmp_path / "video.jsonl", [{"messages": [{"role": "user", "content": "<video>What moves?"},
                                                            {"role": "assistant", "content": "red"}],
                                               "videos": [[str(tmp_path / "frames" / f"{i}.png") for i in range(2)]]}])
    r = run_cli("train", str(cfg), "--set", f"data={video}", "--set", f"output_dir={tmp_path / 'video'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "video.jsonl:1:" in r.stderr and "videos" in r.stderr and "loading" not in r.stderr


@pytest.mark.slow
def test_full_fine_tune_trains_the_thinker(tmp_path: Path, omni3: Path, media_rows: Path) -> None:
    keys = _train_keys(omni3, media_rows, tmp_path / "run", method="full", lr=1e-3, max_steps=1)
    keys.pop("lora")
    train_here(write_config(tmp_path / "full.yaml", **keys))
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 1 and math.isfinite(metrics[0]["loss"])


@pytest.mark.slow
@pytest.mark.heavy  # about 80 s on 2 cores; tests/test_vl_families.py and tests/test_audio.py cover each tower alone
def test_zero3_rank_without_media_matches_one_process(tmp_path: Path, omni3: Path, media_rows: Path) -> None:
    """One row per rank, one rank with a clip and an image, the other text only every step: that rank runs both
    towers on silence and a blank image (the deepstack mergers too), so ZeRO-3's collectives match and the losses
    equal one process's."""
    data = pick_rows(media_rows, (2, 3), media_rows.parent / "two.jsonl")
    one, two = assert_two_ranks_match_one(tmp_path, omni3, data, "zero3", steps=3, max_seq_len=256,
                                          train_projector=True, lora={"rank": 4, "alpha": 8})
    # Adam turns the reduction order's rounding in tiny gradients into up to ~4e-5 differences of a weight
    assert_adapters_match(one, two, "merger", atol=5e-5)


def test_the_readme_table_names_tests_of_this_file() -> None:
    """The README's families table marks a Qwen3-Omni case tested only where a test here trains it."""
    for (family, _, _), where in MEDIA_MATRIX.items():
        path, name = where.split("::")
        if family.startswith("Qwen3-Omni"):
            assert path == "tests/test_qwen3_omni.py" and callable(globals().get(name)), where


def test_the_speech_side_is_never_built_whatever_gives_the_config(omni3: Path) -> None:
    # A simulation hands build_model a config of its own (the folder's, or the catalog's for a hub id): the talker
    # and code2wav must be left out there too, or building fails on the catalog's talker config.
    from transformers import AutoConfig

    from shardfit.models.build import build_model

    config = AutoConfig.from_pretrained(omni3)
    assert config.enable_audio_output
    model = build_model(_cfg(omni3, omni3), "single", weights=False, config=config)
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert not any("talker" in n or "code2wav" in n for n, _ in model.named_parameters()), names


def test_plan_simulates_zero3_on_a_step_without_media(omni3: Path, capsys: pytest.CaptureFixture) -> None:
    # The step runs the decoder only, so the towers' FSDP units are never gathered: the tracker must not fail
    # on them (simulate/tracker.py).
    code, out, err = run_here(capsys, "plan", "--model", str(omni3), "--gpus", "2x80GB", "--simulate", "--strategy",
                              "zero3", "--seq", "64", "--batch", "1")
    assert code == 0, err[-2000:]
    assert "fake-tensor step" in out
