"""What a config's data holds in images, for the planner before anything loads: how many images the rows carry and
how large they are, from an evenly spread sample of rows (each image's size read from its header only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardfit.data.formats import BadRow
from shardfit.data.media import Media, extract_media
from shardfit.data.reader import read_rows
from shardfit.errors import UserError


@dataclass(frozen=True)
class ImageCensus:
    """The sampled rows' images. The planner sizes the heaviest sample: the most images in one row and the largest
    image (by pixels) seen."""

    rows: int  # rows in the data files
    sampled: int  # rows looked at
    with_images: int  # sampled rows that carry at least one image
    images: int  # images in the sampled rows
    most_per_row: int
    width: int  # the largest image seen
    height: int

    def describe(self) -> str:
        """One line saying what the plan took from the data."""
        mean = self.images / max(self.with_images, 1)
        return (f"images from the data: {self.with_images} of {self.sampled} sampled rows (of {self.rows}) carry "
                f"images, {mean:.1f} per such row on average, at most {self.most_per_row}; the largest is "
                f"{self.width}x{self.height}. Planned as {self.most_per_row} per sample of {self.width}x{self.height} "
                "(--images-per-sample / --image-size override)")


def sampled_media(paths: str | list[str], sample: int = 256) -> tuple[int, int, list[Media]]:
    """(rows in the data files, rows sampled, the media of each readable sampled row): up to `sample` rows spread
    evenly over the files. Rows that would not train (bad JSON, a missing file) are left out here: `check` and
    `train` report them."""
    rows = [(row, Path(p).parent) for p in ([paths] if isinstance(paths, str) else paths) for row in read_rows(p)]
    step = max(1, len(rows) // sample)
    picked = rows[::step][:sample]
    media = []
    for row, base in picked:
        try:
            media.append(extract_media(row.data, base)[1])
        except (BadRow, UserError):
            continue
    return len(rows), len(picked), media


def image_census(paths: str | list[str], sample: int = 256) -> ImageCensus | None:
    """The images of up to `sample` rows spread evenly over the data files; None when no sampled row has one."""
    from PIL import Image  # Pillow only for image data: text-only plans never import it

    total, sampled, media = sampled_media(paths, sample)
    with_images = images = most = 0
    largest = (0, 0)
    for m in media:
        files = m.images
        if not files:
            continue
        with_images += 1
        images += len(files)
        most = max(most, len(files))
        for f in files:
            with Image.open(f) as im:
                if im.size[0] * im.size[1] > largest[0] * largest[1]:
                    largest = im.size
    if not with_images:
        return None
    return ImageCensus(total, sampled, with_images, images, most, largest[0], largest[1])
