"""What a config's data holds in audio, for the planner before anything loads: how many clips the rows carry and how
long the longest is, from the same evenly spread sample of rows as the image census (each clip's length read from
its WAV header only)."""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.data.audio import probe_wav
from shardfit.data.image_census import MediaCounts, MediaSample


@dataclass(frozen=True)
class AudioCensus(MediaCounts):
    """The sampled rows' clips; the planner takes each as long as the longest clip seen."""

    seconds: float

    def describe(self) -> str:
        """One line saying what the plan took from the data."""
        return (f"{self.summary('audio', 'clips')}; the longest is {self.seconds:.2f} s. Planned as "
                f"{self.most_per_row} per sample of {self.seconds:.2f} s (--audio-per-sample / --audio-seconds "
                "override)")


def audio_census(sample: MediaSample) -> AudioCensus | None:
    """The clips of the sampled rows; None when no sampled row has one."""
    rows = [m.audios for m in sample.media if m.audios]
    if not rows:
        return None
    longest = max(probe_wav(c) for clips in rows for c in clips)
    return AudioCensus(sample.rows, sample.sampled, len(rows), sum(map(len, rows)), max(map(len, rows)), longest)
