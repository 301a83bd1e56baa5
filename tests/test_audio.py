"""Audio fine-tuning of the Qwen2.5-Omni thinker: WAV reading and resampling, audio rows in each format and their
validation, the log-mel features and audio tokens against transformers' own, M-RoPE positions against the
thinker's get_rope_index, packing, LoRA and FSDP units, and real CLI runs (single, and 2 ranks where one rank's
batch has no audio)."""

from __future__ import annotations

import base64
import json
import re
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2_5OmniThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)

from shardfit.cli.main import main
from shardfit.config import Config, LoraSettings
from shardfit.data.audio import read_wav, resample
from shardfit.data.dataset import DataStats, encode_split, load_conversations, read_split
from shardfit.data.loader import collate
from shardfit.data.packing import no_pack
from shardfit.data.tokenize import IGNORE
from shardfit.errors import UserError
from shardfit.models.adapters import setup_trainable
from shardfit.models.anatomy import audio_units
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel.parallelize import fsdp_units
from shardfit.plan.audio import AudioLoad
from shardfit.train.loss import CausalLMLoss
from tests.helpers import (
    make_tiny_omni,
    read_jsonl,
    run_cli,
    run_here,
    train_here,
    write_config,
    write_images,
    write_wav,
)
from tests.media_checks import assert_adapters_match, assert_packed_loss_equals_unpacked, assert_two_ranks_match_one


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(root: Path, absolute: bool = False) -> list[dict]:
    """An audio row per format (audios list, ShareGPT, audio part, base64 input_audio with an image) and a text
    row, for the media under `root`; `absolute`: absolute paths (for data files elsewhere)."""
    a = f"{root}/" if absolute else ""
    inline = base64.b64encode((root / "a" / "beep.wav").read_bytes()).decode()
    return [
        {"messages": [{"role": "user", "content": "<audio>What do you hear?"},
                      {"role": "assistant", "content": "a beep"}], "audios": [f"{a}a/beep.wav"]},
        {"conversations": [{"from": "human", "value": "<audio>Pitch?"}, {"from": "gpt", "value": "low"}],
         "audios": [f"{a}a/low.wav"]},
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": f"{a}a/low.wav"},
                                                   {"type": "text", "text": "Pitch?"}]},
                      {"role": "assistant", "content": "low"}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                    "input_audio": {"data": inline, "format": "wav"}},
                                                   {"type": "image", "image": f"{a}img/red.png"},
                                                   {"type": "text", "text": "Sound and colour?"}]},
                      {"role": "assistant", "content": "a beep, red"}]},
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]},
    ]


@pytest.fixture(scope="module")
def audio_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sine-wave clips (a 16 kHz mono beep, a 22.05 kHz stereo low tone), an image, and train.jsonl (one row per
    format; ShareGPT rows in a file of their own, as formats are detected per file)."""
    root = tmp_path_factory.mktemp("audio-data")
    write_wav(root / "a" / "beep.wav", 1.0, 440.0)
    write_wav(root / "a" / "low.wav", 0.5, 220.0, rate=22050, channels=2)
    write_images(root / "img", {"red": (255, 0, 0)})
    rows = _rows(root)
    _write(root / "sharegpt.jsonl", [rows[1]])
    return _write(root / "train.jsonl", [r for i, r in enumerate(rows) if i != 1])


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_tiny_omni(tmp_path_factory.mktemp("tiny-omni-media"), tokenizer_dir)


def _cfg(model: Path, data: Path, **over) -> Config:
    keys = dict(model=str(model), data=str(data), precision="fp32", max_seq_len=256)
    keys.update(over)
    return Config(**keys, lora=LoraSettings(rank=4, alpha=8))


def _encoded(model: Path, data: Path, **over):
    cfg = _cfg(model, data, **over)
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    split = read_split(cfg)
    return vision, split, encode_split(cfg, tok, split, vision)[0]


def test_wav_is_read_mixed_and_resampled(tmp_path: Path) -> None:
    path = write_wav(tmp_path / "s.wav", 0.5, 440.0, rate=22050, channels=2)
    x, rate = read_wav(str(path))
    assert rate == 22050 and x.shape == (11025,)
    y = resample(x, rate, 16000)
    t = np.arange(len(y)) / 16000
    assert len(y) == 8000
    # Away from the edges (where the filter sees the silence beyond the clip) the tone is the same tone.
    np.testing.assert_allclose(y[200:-200], 0.5 * np.sin(2 * np.pi * 440 * t[200:-200]), atol=2e-3)
    # 24-bit and 8-bit PCM decode to the same samples as 16-bit (within their resolution).
    for width, enc in ((3, lambda v: (v * 2 ** 23).astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()),
                       (1, lambda v: (v * 127 + 128).astype(np.uint8).tobytes())):
        other = tmp_path / f"w{width}.wav"
        with wave.open(str(other), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(width)
            w.setframerate(rate)
            w.writeframes(enc(x))
        np.testing.assert_allclose(read_wav(str(other))[0], x, atol=2 / 2 ** (8 * width - 1) + 1e-4)


def test_features_and_token_counts_match_transformers(omni: Path, audio_data: Path) -> None:
    vision, _, examples = _encoded(omni, audio_data)
    ap = vision.audio
    clip = ap.samples(str(audio_data.parent / "a" / "low.wav"))
    # Omni's processor pads every clip to the extractor's 30-second window and masks the padding.
    whole = ap.feature_extractor(clip, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                                 return_tensors="pt")
    n = int(whole["attention_mask"].sum())
    feats, lens = ap.features([clip])
    assert lens.tolist() == [n] and torch.equal(feats, whole["input_features"][0, :, :n])
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni)
    assert ap.tokens(len(clip)) == int(model.model.audio_tower._get_feat_extract_output_lengths(lens)[1])
    # The planner counts what the data path counts, before anything loads.
    for name, seconds in (("low.wav", 0.5), ("beep.wav", 1.0)):
        path = str(audio_data.parent / "a" / name)
        assert AudioLoad(1, seconds).tokens_per_clip() == ap.tokens(ap.n_samples(path))
    assert AudioLoad(1, 47.3, max_seconds=0.25).tokens_per_clip() == 6


def test_plan_counts_audio_tokens_and_refuses_what_cannot_fit(capsys: pytest.CaptureFixture) -> None:
    args = ("plan", "--model", "Qwen/Qwen2.5-Omni-7B", "--gpus", "8x24GB", "--batch", "1", "--json")
    code, out, err = run_here(capsys, *args, "--audio-per-sample", "2", "--audio-seconds", "10", "--seq", "2048")
    assert code in (0, 3), err
    audio = json.loads(out)["audio"]
    assert audio["tokens_per_clip"] == 250 and audio["audio_tokens_per_sample"] == 500
    code, _, err = run_here(capsys, *args, "--audio-per-sample", "4", "--audio-seconds", "30", "--seq", "2048")
    assert code == 2 and "3000 tokens" in err and "--audio-seconds" in err


def test_audio_rows_in_each_format_carry_their_clips(audio_data: Path) -> None:
    convs = load_conversations([str(audio_data), str(audio_data.parent / "sharegpt.jsonl")], False, DataStats())
    assert [len(c.audios) for c in convs] == [1, 1, 1, 0, 1] and [len(c.images) for c in convs] == [0, 0, 1, 0, 0]
    assert convs[1].messages[0]["content"] == "<audio>Pitch?"
    assert convs[2].messages[0]["content"] == "<audio><image>Sound and colour?"
    assert isinstance(convs[2].audios[0], bytes)  # base64 input_audio, decoded
    assert Path(convs[4].audios[0]).is_absolute() and convs[4].audios[0].endswith("a/low.wav")


@pytest.mark.parametrize("row, why", [
    ({"messages": [{"role": "user", "content": "<audio><audio>?"}, {"role": "assistant", "content": "x"}],
      "audios": ["a/beep.wav"]}, "2 <audio> placeholder(s) in the text but 1 audio(s)"),
    ({"messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "x"}]},
     "lists no audios"),
    ({"messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "x"}],
      "audios": ["a/missing.wav"]}, "audio not found"),
    ({"messages": [{"role": "user", "content": "<audio>?"}, {"role": "assistant", "content": "x"}],
      "audios": ["broken.wav"]}, "cannot be read"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                                       "format": "mp3"}}]},
                   {"role": "assistant", "content": "x"}]}, "only wav is read"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "https://x/a.wav"}]},
                   {"role": "assistant", "content": "x"}]}, "only local audio files"),
])
def test_bad_audio_rows_name_their_line_or_are_counted(audio_data: Path, row: dict, why: str) -> None:
    (audio_data.parent / "broken.wav").write_bytes(b"RIFF0000WAVEnot really")
    good = _rows(audio_data.parent)[0]
    path = _write(audio_data.parent / "bad.jsonl", [good, row, good])
    with pytest.raises(UserError, match=rf"bad\.jsonl:2: .*{re.escape(why)}"):
        load_conversations(str(path), False, DataStats())
    stats = DataStats()
    assert len(load_conversations(str(path), True, stats)) == 2 and stats.skipped == 1


def test_audio_tokens_and_positions_match_the_thinker(omni: Path, audio_data: Path) -> None:
    vision, _, examples = _encoded(omni, audio_data)
    ap = vision.audio
    ex = examples[2]  # a 1 s clip (100 frames -> 25 tokens) then a 56x56 image (4 tokens)
    ids = torch.tensor([ex.input_ids])
    feats, lens = ex.audio.load()
    assert lens.tolist() == [100] and int((ids == ap.audio_token_id).sum()) == 25
    assert int((ids == vision.image_token_id).sum()) == 4
    media = {ap.audio_token_id, vision.image_token_id}
    assert all(t == IGNORE for i, t in zip(ex.input_ids[1:], ex.targets, strict=False) if i in media)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni)
    want, _ = model.model.get_rope_index(ids, image_grid_thw=ex.image_grid_thw, attention_mask=torch.ones_like(ids),
                                         audio_seqlens=lens)
    assert want[:, 0].tolist() == ex.mrope
    # A clip whose tokens cannot fit stops before the model, naming the row and both fixes.
    with pytest.raises(UserError, match=r"train\.jsonl:1: its 25 audio tokens and text take \d+ tokens, beyond "
                                        r"max_seq_len=30; raise max_seq_len, or lower audio_max_seconds"):
        _encoded(omni, audio_data, max_seq_len=30)
    # audio_max_seconds cuts clips: 0.25 s is 25 frames, 6 tokens.
    _, _, short = _encoded(omni, audio_data, audio_max_seconds=0.25)
    assert sum(1 for t in short[0].input_ids if t == ap.audio_token_id) == 6


def test_packed_loss_equals_unpacked_and_the_models_own(omni: Path, audio_data: Path) -> None:
    vision, _, examples = _encoded(omni, audio_data)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni, dtype=torch.float32)
    assert_packed_loss_equals_unpacked(model, examples)
    # The thinker's own forward (30-second padded features, its own positions) gives the same loss.
    ex = examples[2]
    b = collate(no_pack([ex]), pad_id=2)
    clip = vision.audio.samples(ex.audio.sources[0])
    whole = vision.audio.feature_extractor(clip, sampling_rate=16000, padding="max_length",
                                           return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, input_features=whole["input_features"],
                       feature_attention_mask=whole["attention_mask"], pixel_values=ex.pixel_values.load(),
                       image_grid_thw=ex.image_grid_thw, attention_mask=torch.ones_like(b.input_ids)).logits[0]
        keep = b.targets[0] != IGNORE
        want = torch.nn.functional.cross_entropy(logits[keep], b.targets[0][keep], reduction="sum")
        mine = float(CausalLMLoss(model)(b.input_ids, b.position_ids, b.targets, **b.media)[0])
        assert mine == pytest.approx(float(want), rel=1e-5)


def test_lora_leaves_frozen_towers_alone_and_units_uniform(omni: Path, audio_data: Path) -> None:
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni, dtype=torch.float32)
    wrapped = setup_trainable(model, _cfg(omni, audio_data))
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert any("language_model" in n and "lora_" in n for n in names)
    assert not any("audio_tower" in n or "visual" in n for n in names)
    assert len(audio_units(wrapped)) == 1 and all(any(u is v for v in fsdp_units(wrapped))
                                                  for u in audio_units(wrapped))
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni, dtype=torch.float32)
    full = setup_trainable(model, _cfg(omni, audio_data, method="full", freeze_audio_tower=False))
    tower = {n: p.requires_grad for n, p in full.named_parameters() if "audio_tower" in n}
    # The tower trains, except the begin/end-of-audio embedding that only the talker reads.
    assert all(on for n, on in tower.items() if "audio_bos_eos_token" not in n)
    assert not any(on for n, on in tower.items() if "audio_bos_eos_token" in n)


@pytest.mark.heavy  # test_qwen3_omni trains on image and audio rows together
def test_train_with_audio_and_images_writes_adapter_and_processor(tmp_path: Path, omni: Path, audio_data: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "omni.yaml", model=str(omni), data=str(audio_data), precision="fp32",
                       max_seq_len=256, micro_batch=2, max_steps=2, log_steps=1, save_steps=100,
                       strategy="single", output_dir=str(tmp_path / "run"), report_to=["none"])
    assert "1 images, 3 audio clips (M-RoPE positions kept per example in packed rows)" in train_here(cfg, capsys)
    assert all(np.isfinite(m["loss"]) for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    adapter = tmp_path / "run" / "adapter"
    extractor = WhisperFeatureExtractor.from_pretrained(adapter)
    assert extractor.feature_size == 128
    assert json.loads((adapter / "preprocessor_config.json").read_text())["image_processor_type"]
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert weights and not any("audio_tower" in k for k in weights)
    # A bad clip stops the run before the model loads, naming file:line.
    bad = _write(tmp_path / "bad.jsonl", [_rows(audio_data.parent, True)[0],
                                          {"messages": [{"role": "user", "content": "<audio>"},
                                                        {"role": "assistant", "content": "x"}],
                                           "audios": [str(tmp_path / "gone.wav")]}])
    r = run_cli("train", str(cfg), "--set", f"data={bad}", "--set", f"output_dir={tmp_path / 'bad'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad.jsonl:2:" in r.stderr and "audio not found" in r.stderr and "loading" not in r.stderr


@pytest.mark.slow
def test_export_merge_generates_from_a_clip(tmp_path: Path, omni: Path, audio_data: Path) -> None:
    cfg = write_config(tmp_path / "omni.yaml", model=str(omni), data=str(audio_data), precision="fp32",
                       max_seq_len=256, micro_batch=4, max_steps=1, save_steps=100, strategy="single",
                       output_dir=str(tmp_path / "run"), report_to=["none"])
    train_here(cfg)  # and export below: both in this process (the CLI's own `main`: no start-up each)
    # export --merge gives a thinker that AutoModelForImageTextToText loads and that generates from a clip.
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged")
    extractor = WhisperFeatureExtractor.from_pretrained(tmp_path / "merged")
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    clip, _ = read_wav(str(audio_data.parent / "a" / "beep.wav"))
    feats = extractor(clip, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                      return_tensors="pt")
    prompt = ("<|im_start|>user\n<|audio_bos|>" + "<|AUDIO|>" * 25 + "<|audio_eos|>What?<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = merged.generate(ids, attention_mask=torch.ones_like(ids), input_features=feats["input_features"],
                          feature_attention_mask=feats["attention_mask"], max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.heavy), "zero3",
                                      pytest.param("zero3_offload", marks=pytest.mark.heavy)])
def test_rank_without_audio_matches_single_process(tmp_path: Path, omni: Path, audio_data: Path,
                                                   strategy: str, capsys: pytest.CaptureFixture) -> None:
    """Two rows, one with a clip and one text-only, one row per rank: every step one rank has no audio (the ZeRO-3
    stall of Omni models). The audio tower trains (LoRA on it), so its gradients are reduced across ranks too.
    The thinker alone is built (no talker or token2wav in the adapter), and `check` of the 2-rank config reports
    exactly the findings the launch applied."""
    data = _write(tmp_path / "two.jsonl", [_rows(audio_data.parent, True)[0], _rows(audio_data.parent)[4]])
    one, two = assert_two_ranks_match_one(tmp_path, omni, data, strategy, steps=3, freeze_audio_tower=False)
    # Adam turns the reduction order's rounding in tiny gradients into ~1e-5 differences of a weight
    assert_adapters_match(one, two, "audio_tower", atol=5e-5)
    adapter = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert not any("talker" in k or "token2wav" in k for k in adapter)
    # `check` launches no ranks: the CLI's `main` in this process.
    code, out, err = run_here(capsys, "check", str(tmp_path / "two.yaml"), "--nproc", "2", "--json")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    checked, applied = json.loads(out), json.loads((two / "preflight.json").read_text())
    assert checked["ok"] is applied["ok"] is True and applied["strategy"] == strategy

    def key(f: dict) -> tuple:
        return f["rule"], f["where"], f["severity"], f["auto_fixed"]

    assert sorted(map(key, checked["findings"])) == sorted(map(key, applied["findings"]))
