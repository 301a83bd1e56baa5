"""Audio tokens before anything loads: how many tokens an audio clip adds to the language model's sequence for a
Qwen2.5-Omni-style audio tower (Whisper log-mel frames every 10 ms, a stride-2 convolution, then pooling by 2:
25 tokens a second), as shardfit's data path counts them (tested against it). `clip_tokens` is the one count both
use; it also knows Qwen3-Omni's tower (chunks of 100 frames, each halved three times: 13 tokens a second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardfit.errors import UserError

SAMPLE_RATE = 16000  # Whisper-style feature extractors resample every clip to 16 kHz
HOP = 160  # samples per log-mel frame (10 ms)
WINDOW_S = 300.0  # Qwen2.5-Omni's feature extractor window (chunk_length): longer clips are cut here


def clip_tokens(frames: int, chunk: int | None = None) -> int:
    """Language-model tokens of a clip of `frames` log-mel frames. Qwen2.5-Omni's tower (`chunk` None) halves the
    frames twice (a stride-2 convolution, then pooling by 2); Qwen3-Omni's cuts them into chunks of `chunk`
    frames (2 x its n_window) and halves each chunk three times (three stride-2 convolutions, rounding up)."""
    if chunk is None:
        return ((frames - 1) // 2 + 1 - 2) // 2 + 1
    tail, tokens = frames % chunk, 0
    if tail:
        for _ in range(3):
            tail = (tail - 1) // 2 + 1
        tokens = tail
    per_chunk = chunk
    for _ in range(3):
        per_chunk = (per_chunk - 1) // 2 + 1
    return tokens + frames // chunk * per_chunk


@dataclass(frozen=True)
class AudioLoad:
    """Audio clips per training sample, their length, and the cut (`audio_max_seconds`)."""

    clips_per_sample: int
    seconds: float
    max_seconds: float | None = None
    chunk: int | None = None  # Qwen3-Omni's tower: tokens per chunk of this many frames (AudioShape.token_chunk)

    def kept_seconds(self) -> float:
        """The length the tower sees: the clip, cut at audio_max_seconds and at the extractor's window."""
        return min(self.seconds, WINDOW_S if self.max_seconds is None else min(self.max_seconds, WINDOW_S))

    def frames(self) -> int:
        """Log-mel frames of one clip (one per hop, the last partial hop included)."""
        samples = math.ceil(self.kept_seconds() * SAMPLE_RATE)
        # Qwen3-Omni's processor pads a lone clip not at all: whole hops only (data/audio.py counts the same).
        return max(1, samples // HOP if self.chunk is not None else -(-samples // HOP))

    def tokens_per_clip(self) -> int:
        """Tokens one clip adds to the sequence (`clip_tokens`: Qwen2.5-Omni's whole-clip count, or Qwen3-Omni's
        per chunk)."""
        return clip_tokens(self.frames(), self.chunk)

    def tokens_per_sample(self) -> int:
        return self.clips_per_sample * self.tokens_per_clip()

    def to_json(self) -> dict:
        return {"clips_per_sample": self.clips_per_sample, "seconds": self.seconds,
                "kept_seconds": self.kept_seconds(), "frames_per_clip": self.frames(),
                "tokens_per_clip": self.tokens_per_clip(), "audio_tokens_per_sample": self.tokens_per_sample()}


def check_audio_fits(audio: AudioLoad, seq_len: int, other_media_tokens: int = 0, flag: str = "--seq") -> None:
    """The audio tokens of a sample (with its image tokens) must fit in the sequence: a UserError otherwise."""
    n = audio.tokens_per_sample() + other_media_tokens
    if n >= seq_len:
        raise UserError(f"{audio.clips_per_sample} clip(s) of {audio.seconds:g} s take "
                        f"{audio.tokens_per_sample()} tokens ({audio.tokens_per_clip()} each)"
                        + (f", {other_media_tokens} more for images" if other_media_tokens else "")
                        + f", not less than {flag} {seq_len}: raise {flag}, or lower --audio-seconds "
                        "(audio_max_seconds in a config).")


def describe_audio(audio: AudioLoad) -> str:
    """One line for the plan's table."""
    return (f"audio: {audio.clips_per_sample} clip(s) per sample of {audio.seconds:g} s (kept "
            f"{audio.kept_seconds():g} s): {audio.frames()} log-mel frames through the audio tower and "
            f"{audio.tokens_per_clip()} tokens in the sequence each, {audio.tokens_per_sample()} audio tokens per "
            "sample (counted within the sequence length)")


@dataclass(frozen=True)
class AudioShape:
    """A Qwen2.5-Omni audio tower (Whisper's encoder): two convolutions over `mels` log-mel bins (the second with
    stride 2), `layers` blocks of width `dim` (MLP width `ffn`, `heads` heads, LayerNorm, GELU), a final norm,
    pooling by 2 and a projection to the language model's width `out`. Clips run in chunks of 2 x `window` frames.
    """

    layers: int
    dim: int
    ffn: int
    heads: int
    out: int
    mels: int = 128
    window: int = 100
    positions: int = 1500  # max_source_positions: rows of the sinusoidal position table
    # Qwen3-Omni's tower counts its tokens per chunk of 2 x window frames (clip_tokens); None: Qwen2.5-Omni's.
    token_chunk: int | None = None

    def params(self) -> int:
        """The tower's weights: both convolutions, the blocks (norms, q/k/v/out projections with k bias-free, MLP),
        the final norm, the projection, and the begin/end-of-audio embedding (two rows of `out`)."""
        d, f = self.dim, self.ffn
        convs = self.mels * d * 3 + d + d * d * 3 + d
        block = 2 * 2 * d + 4 * d * d + 3 * d + d * f + f + f * d + d
        return convs + self.layers * block + 2 * d + d * self.out + self.out + 2 * self.out

    def buffer_bytes(self) -> int:
        """The fp32 sinusoidal position table, a buffer on every rank whatever the strategy shards."""
        return 4 * self.positions * self.dim

    def chunked_frames(self, frames: int) -> tuple[int, int]:
        """(padded frames, tokens through the blocks) of one clip of `frames`: cut into chunks of 2 x window
        frames, each padded to the longest chunk and halved (rounding up) by the strided convolution."""
        size = 2 * self.window
        chunks = -(-frames // size)
        tail = frames - (chunks - 1) * size
        longest = size if chunks > 1 else frames
        return chunks * longest, (chunks - 1) * ((size - 1) // 2 + 1) + (tail - 1) // 2 + 1

    def lora_params(self, rank: int) -> int:
        """LoRA adapters on the tower's linear layers (peft's all-linear: each block's q, k, v, out and MLP, and the
        projection), what a LoRA run with a trainable tower adds."""
        d, f = self.dim, self.ffn
        return self.layers * rank * (4 * 2 * d + 2 * (d + f)) + rank * (d + self.out)

    def saved_bytes(self, frames: int, low: int, checkpointed: bool = False, stem: bool = True) -> float:
        """What a trainable tower saves for backward for one clip of `frames`, in the compute precision (`low`
        bytes): the convolutions' and GELUs' inputs over the padded chunks (the padded features; conv1's GELU and
        conv2's input; conv2's GELU at half as many positions), the index and mask tensors (int64), per
        token through the blocks each block's (9 x width + 2 x MLP width + 4) values (norm inputs and statistics,
        q, k, v, attention output, the MLP's inner activations) and an fp32 log-sum-exp per head, and after
        pooling the final norm's and the projection's inputs. Counted with autograd's saved-tensor hooks on
        transformers' Qwen2_5OmniAudioEncoder over a range of widths, MLP widths, heads and mel bins (linear in each).
        `checkpointed` (transformers checkpoints the audio blocks with the decoder's): each block keeps its input.
        Without `stem` (LoRA: the convolutions have no adapters and their input needs no gradient) the convolutions
        save nothing."""
        padded, tokens = self.chunked_frames(frames)
        chunks = -(-frames // (2 * self.window))
        strided = chunks * ((padded // chunks - 1) // 2 + 1)  # conv2's output positions, padding included
        pooled = (tokens - 2) // 2 + 1
        convs = padded * ((self.mels + 2 * self.dim) * low + 8) + strided * self.dim * low if stem else 0
        stem_bytes = convs + tokens * 8
        block = self.dim * low if checkpointed else (9 * self.dim + 2 * self.ffn + 4) * low + 4 * self.heads
        return stem_bytes + self.layers * tokens * block + pooled * ((2 * self.dim + 2) * low + 16)


def audio_shape_of(config: dict) -> AudioShape | None:
    """The audio tower of a Qwen2.5-Omni config.json (`thinker_config.audio_config`), None when it has none;
    missing keys take transformers' defaults (Whisper-large-v3 sizes)."""
    a = (config.get("thinker_config") or {}).get("audio_config")
    if not isinstance(a, dict):
        return None
    # Qwen3-Omni (models/anatomy.py CHUNKED_AUDIO_MODEL_TYPES; its n_window defaults to 50 frames).
    chunked = config.get("model_type") in ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
    return AudioShape(layers=a.get("encoder_layers", 32), dim=a.get("d_model", 1280),
                      ffn=a.get("encoder_ffn_dim", 5120), heads=a.get("encoder_attention_heads", 20),
                      out=a.get("output_dim", 3584), mels=a.get("num_mel_bins", 128), window=a.get("n_window", 100),
                      positions=a.get("max_source_positions", 1500),
                      token_chunk=2 * a.get("n_window", 50) if chunked else None)
