"""The planner's audio tower (plan/audio.py AudioShape): its weights against transformers' module, its saved
activations against autograd's saved-tensor hooks, the analytic estimate against `plan --simulate`'s fake-tensor
step (Qwen2.5-Omni's thinker with fake log-mel features), and `plan CONFIG` reading the clips from the data."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

from shardfit.plan.audio import AudioLoad, AudioShape, audio_shape_of
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.media import VisionShape
from shardfit.plan.shapes import ModelShape, resolve_shape, tower_params
from shardfit.plan.workload import Workload
from tests.helpers import run_here, tiny_omni_config, write_config, write_wav
from tests.media_checks import assert_estimate_matches_simulation


@pytest.fixture(scope="module")
def omni_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-Omni as a config.json alone: what plan and --simulate read (no weights, no tokenizer)."""
    out = tmp_path_factory.mktemp("omni-config")
    config = tiny_omni_config()
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    config.save_pretrained(out)
    return out


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_audio_shape_weights_are_the_towers() -> None:
    """params() is the module's parameter count, for the tiny test tower and for the catalog's Qwen2.5-Omni 3B/7B
    (Whisper-large-v3-sized towers, built on the meta device from transformers' defaults and the 3B's width)."""
    config = tiny_omni_config()
    tiny = audio_shape_of(config.to_dict())
    assert tiny == AudioShape(layers=1, dim=32, ffn=64, heads=2, out=32)
    assert tiny.params() == _params(Qwen2_5OmniAudioEncoder(config.thinker_config.audio_config))
    for model, out in (("Qwen/Qwen2.5-Omni-7B", 3584), ("Qwen/Qwen2.5-Omni-3B", 2048)):
        shape = resolve_shape(model)
        with torch.device("meta"):
            tower = Qwen2_5OmniAudioEncoder(Qwen2_5OmniAudioEncoderConfig(output_dim=out))
        assert shape.audio is not None and shape.audio.params() == _params(tower), model
        assert shape.extra_params == shape.audio.params() + shape.vision.params()


@pytest.mark.parametrize(("frames", "dtype"), [(437, torch.float32), (150, torch.bfloat16), (801, torch.bfloat16)])
def test_saved_bytes_are_what_autograd_saves(frames: int, dtype: torch.dtype) -> None:
    """A trainable tower's saved tensors for one clip (several chunks, a padded tail, or one short chunk), counted
    with saved-tensor hooks (each storage once, weights left out), are what saved_bytes predicts."""
    shape = AudioShape(layers=2, dim=48, ffn=96, heads=4, out=40, mels=80)
    config = Qwen2_5OmniAudioEncoderConfig(d_model=48, encoder_ffn_dim=96, encoder_attention_heads=4, encoder_layers=2,
                                           output_dim=40, num_mel_bins=80)
    config._attn_implementation = "sdpa"
    tower = Qwen2_5OmniAudioEncoder(config).to(dtype)
    weights = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tower(torch.randn(80, frames, dtype=dtype), feature_lens=torch.tensor([frames]))
    low = 4 if dtype == torch.float32 else 2
    assert shape.saved_bytes(frames, low) == sum(saved.values())


@pytest.mark.parametrize(("strategy", "method", "trainable", "precision", "images"), [
    ("single", "lora", False, "bf16", 0),  # the default: LoRA on the language model, the audio tower frozen
    ("zero3", "lora", False, "bf16", 1),  # FSDP's mixed precision keeps a 16-bit copy of the features; an image too
    ("single", "full", True, "fp32", 0)])  # a trainable tower saves every block's activations
def test_analytic_audio_terms_agree_with_simulate(omni_config: Path, strategy: str, method: str, trainable: bool,
                                                  precision: str, images: int) -> None:
    """Two clips of 4.37 s per sample (and an image of 8x12 patches): estimate and fake-tensor step agree on the
    peak moment and on every column within 5% (0.1 MiB for near-empty ones), and the clips are a real share of the
    activations."""
    w = Workload(method=method, precision=precision, seq_len=256, micro_batch=2, grad_ckpt="none", lora_rank=8,
                 audio_clips=2, audio_frames=AudioLoad(2, 4.37).frames(), audio_trainable=trainable,
                 images=images, image_rows=8, image_cols=12)
    hw = parse_gpus("2x80GB" if strategy == "zero3" else "1x80GB")
    shape = resolve_shape(str(omni_config))
    ca, cs = assert_estimate_matches_simulation(shape, w, hw, strategy, str(omni_config))
    assert ca.peak_phase == cs.peak_phase == "forward"
    text = estimate(shape, dataclasses.replace(w, audio_clips=0), hw, strategy).per_gpu_gib
    assert ca.per_gpu_gib.activations - text.activations > (1.0 if trainable else 0.3) * text.activations, \
        (ca.per_gpu_gib.activations, text.activations)


def test_plan_reads_audio_from_the_configs_data(tmp_path: Path, omni_config: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """With a config and no audio flags, plan samples the data's rows: the most clips in a row (2), each as long as
    the longest clip seen (2.5 s, from its WAV header), said on stderr; the flags override it and reach
    --simulate."""
    write_wav(tmp_path / "a" / "short.wav", 1.0)
    write_wav(tmp_path / "a" / "long.wav", 2.5, rate=8000)
    rows = [{"messages": [{"role": "user", "content": "<audio>Pitch?"}, {"role": "assistant", "content": "A"}],
             "audios": ["a/short.wav"]},
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a/long.wav"},
                                                       {"type": "audio", "audio": "a/short.wav"},
                                                       {"type": "text", "text": "Longer?"}]},
                          {"role": "assistant", "content": "the first"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "omni.yaml", model=str(omni_config), data=str(tmp_path / "train.jsonl"),
                       precision="bf16", max_seq_len=256, micro_batch=1)
    code, printed, err = run_here(capsys, "plan", str(cfg), "--gpus", "1x24GB", "--strategy", "single")
    assert code == 0, err[-2000:]
    assert "audio from the data: 2 of 3 sampled rows (of 3) carry clips, 1.5 per such row on average, at most 2; " \
           "the longest is 2.50 s" in err
    assert "audio: 2 clip(s) per sample of 2.5 s (kept 2.5 s): 250 log-mel frames through the audio tower and 62 " \
           "tokens in the sequence each" in printed
    code, printed, err = run_here(capsys, "plan", str(cfg), "--gpus", "1x24GB", "--strategy", "single", "--json",
                                  "--audio-per-sample", "1", "--audio-seconds", "3", "--simulate")
    assert code == 0 and "audio from the data" not in err, err[-2000:]
    out = json.loads(printed)
    assert (out["workload"]["audio_clips"], out["workload"]["audio_frames"]) == (1, 300)
    assert out["candidates"][0]["estimator"] == "simulated"


@pytest.mark.parametrize(("trainable", "grad_ckpt"), [(False, "full"), (True, "none")])
def test_catalog_omni_shape_simulates_its_towers(trainable: bool, grad_ckpt: str) -> None:
    """An Omni id from the catalog (no config.json) is simulated as a Qwen2.5-Omni config of its text and tower
    shapes: the towers' weights and the clip's activations agree with the estimate, LoRA on a trainable audio tower
    included (its adapters in the optimizer, no convolution activations: the convolutions have none)."""
    vision = VisionShape(depth=2, dim=64, mlp=172, heads=4, out=256, gated=True)
    audio = AudioShape(layers=2, dim=64, ffn=128, heads=4, out=256)
    shape = ModelShape("tiny/Tiny-Omni", 2, 256, 704, 8, 2, 4096, vision=vision, audio=audio,
                       extra_params=tower_params(vision, audio))
    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=1, grad_ckpt=grad_ckpt, lora_rank=8,
                 audio_clips=1, audio_frames=300, audio_trainable=trainable)
    hw = parse_gpus("1x80GB")
    assert_estimate_matches_simulation(shape, w, hw, "single", None)


@pytest.mark.parametrize("seconds", [0.4, 1.0, 1.5, 7.3, 30.0])
def test_qwen3_omni_plan_counts_its_towers_tokens(seconds: float, capsys: pytest.CaptureFixture) -> None:
    """Qwen3-Omni's tower counts tokens per chunk of 2 x n_window frames (13 a second), not Qwen2.5-Omni's 25: the
    plan of the catalog model counts what its data path (and transformers, tests/test_qwen3_omni.py) counts."""
    from shardfit.cli.main import main
    from shardfit.plan.audio import HOP, SAMPLE_RATE, clip_tokens

    assert main(["plan", "--model", "Qwen/Qwen3-Omni-30B-A3B-Instruct", "--gpus", "8xH100", "--method", "lora",
                 "--seq", "2048", "--audio-per-sample", "1", "--audio-seconds", str(seconds), "--json"]) in (0, 3)
    audio = json.loads(capsys.readouterr().out)["audio"]
    frames = round(seconds * SAMPLE_RATE) // HOP  # a lone clip: whole hops only
    assert audio["frames_per_clip"] == frames
    assert audio["tokens_per_clip"] == clip_tokens(frames, 100)
    if seconds == 1.5:
        assert audio["tokens_per_clip"] == 20  # 13 for the first 100 frames, 7 for the last 50
