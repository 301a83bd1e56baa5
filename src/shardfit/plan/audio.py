"""Audio tokens before anything loads: how many tokens an audio clip adds to the language model's sequence for a
Qwen2.5-Omni-style audio tower (Whisper log-mel frames every 10 ms, a stride-2 convolution, then pooling by 2:
25 tokens a second), as shardfit's data path counts them (tested against it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardfit.errors import UserError

SAMPLE_RATE = 16000  # Whisper-style feature extractors resample every clip to 16 kHz
HOP = 160  # samples per log-mel frame (10 ms)
WINDOW_S = 300.0  # Qwen2.5-Omni's feature extractor window (chunk_length): longer clips are cut here


@dataclass(frozen=True)
class AudioLoad:
    """Audio clips per training sample, their length, and the cut (`audio_max_seconds`)."""

    clips_per_sample: int
    seconds: float
    max_seconds: float | None = None

    def kept_seconds(self) -> float:
        """The length the tower sees: the clip, cut at audio_max_seconds and at the extractor's window."""
        return min(self.seconds, WINDOW_S if self.max_seconds is None else min(self.max_seconds, WINDOW_S))

    def frames(self) -> int:
        """Log-mel frames of one clip (one per hop, the last partial hop included)."""
        samples = math.ceil(self.kept_seconds() * SAMPLE_RATE)
        return max(1, -(-samples // HOP))

    def tokens_per_clip(self) -> int:
        """Tokens one clip adds to the sequence: frames halved by the convolution, then by the pooling."""
        after_conv = (self.frames() - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1

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
