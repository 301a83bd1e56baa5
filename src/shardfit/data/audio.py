"""Audio clips in data rows: WAV files (or inline base64 WAV) read with the standard library's `wave`, mixed to
mono, resampled to the feature extractor's rate, cut at `audio_max_seconds`, and turned into the log-mel features
and the token count an audio tower (Qwen2.5-Omni's or Qwen3-Omni's, Whisper-style features) expects.

No audio library is needed: `wave` reads PCM WAV, and the resampler below is a windowed-sinc filter in numpy.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardfit.data.formats import BadRow
from shardfit.plan.audio import clip_tokens

# A clip is a file path or the bytes of a WAV file (OpenAI `input_audio` data, base64-decoded).
AudioInput = str | bytes

_FIX = "re-save it as PCM WAV (e.g. ffmpeg -i IN -ac 1 -ar 16000 OUT.wav)"
# Sampling rates a clip may declare: telephone audio is 8 kHz, studio audio at most 768 kHz. A header outside says
# something else (a file of 100 KB "at 8 Hz" would be 3.5 hours, resampled to millions of samples).
MIN_RATE, MAX_RATE = 1_000, 768_000


def _name(src: AudioInput) -> str:
    return src if isinstance(src, str) else "inline audio data"


def _open(src: AudioInput) -> wave.Wave_read:
    try:
        return wave.open(src if isinstance(src, str) else io.BytesIO(src), "rb")
    except (wave.Error, EOFError, OSError, RuntimeError) as e:  # RuntimeError: a chunk size beyond the file
        raise BadRow(f"audio {_name(src)} cannot be read ({type(e).__name__}: {e}); {_FIX}") from None


def probe_wav(src: AudioInput) -> float:
    """The clip's duration in seconds, from its header; a file that is not readable PCM WAV is a `BadRow`."""
    with _open(src) as w:
        if w.getsampwidth() not in (1, 2, 3, 4):
            raise BadRow(f"audio {_name(src)}: {8 * w.getsampwidth()}-bit samples are not PCM WAV; {_FIX}")
        if not MIN_RATE <= w.getframerate() <= MAX_RATE:
            raise BadRow(f"audio {_name(src)}: its header says {w.getframerate()} samples per second, outside "
                         f"{MIN_RATE}-{MAX_RATE} Hz (a damaged or mislabelled file); {_FIX}")
        return w.getnframes() / w.getframerate()


def read_wav(src: AudioInput, max_frames: int | None = None) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sampling rate of a PCM WAV file or WAV bytes; `max_frames`: read
    no more than that many from the start (a long clip that is cut costs only what is kept)."""
    with _open(src) as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        n = w.getnframes() if max_frames is None else min(w.getnframes(), max_frames)
        try:
            raw = w.readframes(n)
        except (wave.Error, EOFError, OSError, RuntimeError) as e:  # RuntimeError: a chunk size beyond the file
            raise BadRow(f"audio {_name(src)} cannot be read ({type(e).__name__}: {e}); {_FIX}") from None
    if width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit little-endian: widen each sample to 32 bits
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        x = (b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8) | (b[:, 2].astype(np.int8).astype(np.int32)
                                                                             << 16)).astype(np.float32) / 2 ** 23
    else:
        x = np.frombuffer(raw, {2: np.int16, 4: np.int32}[width]).astype(np.float32) / 2 ** (8 * width - 1)
    x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    return x.astype(np.float32), rate


RESAMPLE_ZEROS = 16  # zero crossings of the resampler's sinc each side of an output sample


def resample(x: np.ndarray, rate: int, target: int, zeros: int = RESAMPLE_ZEROS) -> np.ndarray:
    """`x` resampled from `rate` to `target` Hz with a Hann-windowed sinc low-pass at the lower Nyquist frequency
    (`zeros` zero crossings each side). Each output sample is a weighted sum of the input samples around its time,
    the weights computed per output phase (there are target / gcd of them), so the work is one matrix product per
    phase."""
    if rate == target or len(x) == 0:
        return x.astype(np.float32)
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    cutoff = min(1.0, up / down)  # in units of the input Nyquist frequency
    half = int(math.ceil(zeros / cutoff))  # input samples each side of an output time
    n_out = -(-len(x) * up // down)
    padded = np.pad(x.astype(np.float64), (half, half + 1))
    out = np.empty(n_out, np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    k = np.arange(-half, half + 1)
    for phase in range(up):
        idx = np.arange(phase, n_out, up)
        if len(idx) == 0:
            continue
        base = idx * down // up  # the input sample at or before each output time
        frac = phase * down / up - phase * down // up  # the output time's offset from it: the same for the phase
        d = k - frac
        window = np.where(np.abs(d) < half, 0.5 + 0.5 * np.cos(np.pi * d / half), 0.0)
        taps = cutoff * np.sinc(cutoff * d) * window
        block = max(1, (1 << 22) // (2 * half + 1))  # bounded memory: 32 MiB of outputs' input windows at a time
        for s in range(0, len(idx), block):
            out[idx[s:s + block]] = windows[base[s:s + block]] @ taps
    return out.astype(np.float32)


@dataclass(frozen=True)
class AudioProcessor:
    """What encoding needs from a model with an audio tower: its feature extractor (Whisper-style log-mel) and the
    tokens a clip takes. `max_seconds`: clips are cut at this length (the feature extractor's own window when
    None)."""

    feature_extractor: Any
    audio_token: str  # the placeholder the language model reads audio features into (Qwen2.5-Omni: <|AUDIO|>)
    audio_token_id: int
    start: str  # the markers around a clip (Qwen2.5-Omni: <|audio_bos|>, <|audio_eos|>; Qwen3: <|audio_start|>...)
    end: str
    max_seconds: float | None = None
    chunk: int | None = None  # Qwen3-Omni: the tower's chunk of log-mel frames (2 x n_window); None: Qwen2.5-Omni

    @property
    def rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    @property
    def max_samples(self) -> int:
        own = int(self.feature_extractor.n_samples)
        return own if self.max_seconds is None else min(own, int(self.max_seconds * self.rate))

    def frames(self, n_samples: int) -> int:
        """Log-mel frames of a clip of `n_samples`, as the model's own processor makes them: Qwen2.5-Omni's (which
        pads every clip to the extractor's window) one per hop, the last partial hop included; Qwen3-Omni's (which
        pads a clip only to the longest in its batch, so a clip alone not at all) one per whole hop."""
        hop = int(self.feature_extractor.hop_length)
        return max(1, n_samples // hop if self.chunk is not None else -(-n_samples // hop))

    def tokens(self, n_samples: int) -> int:
        """Language-model tokens of a clip, as the model's audio tower makes them from its frames."""
        return clip_tokens(self.frames(n_samples), self.chunk)

    def n_samples(self, src: AudioInput) -> int:
        """Samples of the clip once resampled and cut (`samples(src)`'s length), from the file's header alone."""
        with _open(src) as w:
            n, rate = w.getnframes(), w.getframerate()
        return min(-(-n * self.rate // rate), self.max_samples)

    def samples(self, src: AudioInput) -> np.ndarray:
        """The clip's mono samples at the extractor's rate, cut at `max_samples`. The cut is made at the source
        rate first, keeping the input samples the resampler's window reaches from the last kept output, so the
        kept samples are those of resampling the whole clip, at the cost of the kept part only."""
        probe_wav(src)  # the rate within bounds: the file may have changed since the data was read
        with _open(src) as w:
            rate = w.getframerate()
        g = math.gcd(rate, self.rate)
        up, down = self.rate // g, rate // g
        reach = int(math.ceil(RESAMPLE_ZEROS / min(1.0, up / down))) + 1
        x, rate = read_wav(src, (self.max_samples - 1) * down // up + reach + 1)
        return resample(x, rate, self.rate)[: self.max_samples]

    def features(self, clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of the clips side by side in time, (mel bins, total frames), and each clip's frames.

        Qwen2.5-Omni: each clip is padded with silence just past its last frame rather than to the extractor's whole
        window: the frames that carry the clip come out the same (tested), without computing frames that are
        thrown away. Qwen3-Omni: each clip as its processor gives a clip alone (no padding; tested)."""
        fe = self.feature_extractor
        hop = int(fe.hop_length)
        parts, lens = [], []
        for x in clips:
            n = self.frames(len(x))
            if self.chunk is not None:
                x = np.pad(x, (0, max(0, hop - len(x))))  # a clip shorter than a hop still makes its one frame
                out = fe(x, sampling_rate=self.rate, padding="longest", truncation=False, return_tensors="pt")
            else:
                out = fe(x, sampling_rate=self.rate, padding="max_length", max_length=(n + 2) * hop + int(fe.n_fft),
                         truncation=True, return_tensors="pt")
            parts.append(out["input_features"][0, :, :n])
            lens.append(n)
        return torch.cat(parts, dim=1), torch.tensor(lens, dtype=torch.long)


@dataclass(frozen=True)
class AudioClips:
    """The clips of one example, decoded when a batch needs them (held as paths or WAV bytes)."""

    ap: AudioProcessor
    sources: tuple[AudioInput, ...]

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features (mel bins, frames) of every clip, in order, and each clip's frame count."""
        return self.ap.features([self.ap.samples(s) for s in self.sources])


def checked_audio(value: str, base: Path) -> str:
    """The absolute path of a WAV file that exists and whose header reads."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise BadRow(f"audio not found: {p} (paths are relative to the data file's folder)")
    if p.suffix.lower() not in (".wav", ".wave"):
        raise BadRow(f"audio {p}: only WAV files are read; {_FIX}")
    probe_wav(str(p))
    return str(p.resolve())
