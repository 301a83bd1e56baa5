"""What a config's data holds in audio, for the planner before anything loads: how many clips the rows carry and how
long the longest is, from the same evenly spread sample of rows as the image census (each clip's length read from
its WAV header only)."""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.data.audio import probe_wav
from shardfit.data.image_census import sampled_media


@dataclass(frozen=True)
class AudioCensus:
    """The sampled rows' clips. The planner sizes the heaviest sample: the most clips in one row, each as long as
    the longest clip seen."""

    rows: int  # rows in the data files
    sampled: int  # rows looked at
    with_audio: int  # sampled rows that carry at least one clip
    clips: int  # clips in the sampled rows
    most_per_row: int
    seconds: float  # the longest clip seen

    def describe(self) -> str:
        """One line saying what the plan took from the data."""
        mean = self.clips / max(self.with_audio, 1)
        return (f"audio from the data: {self.with_audio} of {self.sampled} sampled rows (of {self.rows}) carry "
                f"clips, {mean:.1f} per such row on average, at most {self.most_per_row}; the longest is "
                f"{self.seconds:.2f} s. Planned as {self.most_per_row} per sample of {self.seconds:.2f} s "
                "(--audio-per-sample / --audio-seconds override)")


def audio_census(paths: str | list[str], sample: int = 256) -> AudioCensus | None:
    """The clips of up to `sample` rows spread evenly over the data files; None when no sampled row has one."""
    total, sampled, media = sampled_media(paths, sample)
    rows = [m.audios for m in media if m.audios]
    if not rows:
        return None
    longest = max(probe_wav(c) for clips in rows for c in clips)
    return AudioCensus(total, sampled, len(rows), sum(map(len, rows)), max(map(len, rows)), longest)
