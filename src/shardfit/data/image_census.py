"""What a config's data holds in images, for the planner before anything loads: how many images the rows carry and
how large they are, from an evenly spread sample of rows (each image's size read from its header only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardfit.data.formats import BadRow
from shardfit.data.images import image_size
from shardfit.data.media import Media, extract_media
from shardfit.data.reader import read_rows
from shardfit.errors import UserError


@dataclass(frozen=True)
class MediaSample:
    """Up to `sample` rows spread evenly over the data files, read once for every census of a plan: the rows in the
    files, the rows looked at, and the media of each readable one."""

    rows: int
    sampled: int
    media: list[Media]


@dataclass(frozen=True)
class MediaCounts:
    """What the sampled rows carry of one medium: the planner sizes the heaviest sample, the most in one row."""

    rows: int  # rows in the data files
    sampled: int  # rows looked at
    with_media: int  # sampled rows that carry at least one
    items: int  # how many the sampled rows carry
    most_per_row: int

    def summary(self, kind: str, noun: str) -> str:
        """The start of the line that says what the plan took from the data."""
        mean = self.items / max(self.with_media, 1)
        return (f"{kind} from the data: {self.with_media} of {self.sampled} sampled rows (of {self.rows}) carry "
                f"{noun}, {mean:.1f} per such row on average, at most {self.most_per_row}")


@dataclass(frozen=True)
class ImageCensus(MediaCounts):
    """The sampled rows' images, and the largest image (by pixels) seen."""

    width: int
    height: int

    def describe(self) -> str:
        """One line saying what the plan took from the data."""
        return (f"{self.summary('images', 'images')}; the largest is {self.width}x{self.height}. Planned as "
                f"{self.most_per_row} per sample of {self.width}x{self.height} "
                "(--images-per-sample / --image-size override)")


def sampled_media(paths: str | list[str], sample: int = 256) -> MediaSample:
    """The media of up to `sample` rows spread evenly over the files. Rows that would not train (bad JSON, a
    missing file) are left out here: `check` and `train` report them."""
    rows = [(row, Path(p).parent) for p in ([paths] if isinstance(paths, str) else paths) for row in read_rows(p)]
    step = max(1, len(rows) // sample)
    picked = rows[::step][:sample]
    media = []
    for row, base in picked:
        try:
            media.append(extract_media(row.data, base)[1])
        except (BadRow, UserError):
            continue
    return MediaSample(len(rows), len(picked), media)


def image_census(sample: MediaSample) -> ImageCensus | None:
    """The images of the sampled rows; None when no sampled row has one."""
    with_images = images = most = 0
    largest = (0, 0)
    for m in sample.media:
        files = m.images
        if not files:
            continue
        with_images += 1
        images += len(files)
        most = max(most, len(files))
        for f in files:
            size = image_size(f)  # the files were checked (extract_media): a header read cannot fail here
            if size[0] * size[1] > largest[0] * largest[1]:
                largest = size
    if not with_images:
        return None
    return ImageCensus(sample.rows, sample.sampled, with_images, images, most, largest[0], largest[1])
