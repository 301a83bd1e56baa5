"""Image files opened within bounds: every image, whether a data row's, a video frame or `chat --image`, goes
through here.

A small file can stand for a huge image: a PNG of one colour at 11000x11000 pixels is 350 KB on disk, 363 MB
decoded and about 2.4 GiB once the image processor has made float copies of it at full size; a header can claim
60000x60000. So:

- the header's size is checked against MAX_IMAGE_PIXELS before a pixel is decoded (a file over it is refused,
  named, with the fix);
- a file is checked to decode whole when the data is read (PIL's `verify` misses a truncated JPEG, GIF or BMP);
  a JPEG is decoded at 1/8 scale for that, which still reads all of its data;
- an image larger than the model sees is shrunk in 8 bits, to exactly the size the image processor would resize
  it to and with its filter, before the processor makes float copies: the patches come out the same
  (tests/test_bad_inputs_round3.py), the float copies are of the small image.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfit.data.formats import BadRow
from shardfit.plan.media import MediaLoad

# 8192 x 8192: a 4K frame is 8.3 million pixels, Qwen2-VL sees at most 12.8 million. Decoded, an image at the cap
# is 192 MiB of 8-bit RGB; PIL's own warning starts at 89 million, its refusal at 179 million.
MAX_IMAGE_PIXELS = 8192 * 8192
# Qwen2-VL's processor refuses an image whose long side is over 200 times its short side; such an image is left
# whole for the processor to refuse (shrunk first, it could pass where the processor would not have).
MAX_ASPECT = 200
_FIX = "re-save it as PNG or JPEG"


@dataclass(frozen=True)
class Fit:
    """The resize an image processor applies (Qwen2-VL style: within [min_pixels, max_pixels], sides multiples of
    patch x merge, aspect kept) and its filter."""

    min_pixels: int
    max_pixels: int
    patch: int
    merge: int
    resample: int

    def target(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the processor resizes a `width` x `height` image to."""
        h, w = MediaLoad(1, width, height, self.min_pixels, self.max_pixels, self.patch, self.merge).resized()
        return w, h


def fit_of(image_processor: Any) -> Fit | None:
    """The resize of a Qwen2-VL-style image processor (None for one whose bounds it does not carry)."""
    size = getattr(image_processor, "size", None)
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    lo, hi = get("shortest_edge"), get("longest_edge")
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    resample = getattr(image_processor, "resample", None)
    if not all(isinstance(v, int) and v > 0 for v in (lo, hi, patch, merge)) or resample is None:
        return None
    return Fit(lo, hi, patch, merge, int(resample))


def _too_large(width: int, height: int) -> str:
    return (f"is {width}x{height} pixels ({width * height / 1e6:.0f} million), more than shardfit decodes "
            f"({MAX_IMAGE_PIXELS / 1e6:.0f} million, e.g. 8192x8192; the model sees at most image_max_pixels of "
            "them); downscale it, e.g. convert IN -resize 4096x4096 OUT")


@contextmanager
def _opened(p: Path) -> Iterator[Any]:
    """The image at `p`, its header read and its size checked against the cap; BadRow for anything else."""
    from PIL import Image, UnidentifiedImageError  # Pillow only for image data: text-only runs never import it

    try:
        with warnings.catch_warnings():
            # PIL warns from 89 million pixels: the cap below refuses such images first, with the fix
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(p)
    except Image.DecompressionBombError as e:
        raise BadRow(f"image {p}: its header claims more pixels than can be decoded safely ({e}); {_FIX} at a "
                     "sane size") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise BadRow(f"image {p} cannot be read ({type(e).__name__}: {e}); {_FIX}") from None
    with im:
        if im.size[0] * im.size[1] > MAX_IMAGE_PIXELS:
            raise BadRow(f"image {p} {_too_large(*im.size)}")
        yield im


def unreadable_image(p: Path) -> str | None:
    """Why the image file `p` cannot be used (missing, too large, a header or data that does not decode whole),
    or None when it can; the pixels are not kept."""
    if not p.is_file():
        return "not found"
    try:
        with _opened(p) as im:
            if im.format == "PNG":
                im.verify()  # reads every chunk and checks its CRC: a cut file fails, without inflating pixels
            else:
                im.draft("RGB", (max(1, im.size[0] // 8), max(1, im.size[1] // 8)))  # JPEG: decode at 1/8 scale
                im.load()
    except BadRow as e:
        return str(e).removeprefix(f"image {p} ")
    except (OSError, SyntaxError, ValueError) as e:
        return f"cannot be read ({type(e).__name__}: {e}); {_FIX}"
    return None


def image_size(path: str) -> tuple[int, int]:
    """(width, height) from the header alone; BadRow as `decoded` would raise."""
    with _opened(Path(path)) as im:
        return im.size


def decoded(path: str, fit: Fit | None = None) -> Any:
    """The image at `path` as an RGB PIL image, shrunk to `fit`'s target when it is larger; BadRow naming the file
    when it is over the cap or does not decode."""
    from PIL import Image

    p = Path(path)
    try:
        with _opened(p) as im:
            im.load()
            rgb = im if im.mode == "RGB" else im.convert("RGB")  # no second full-size copy when already RGB
    except (OSError, SyntaxError, ValueError) as e:
        if isinstance(e, BadRow):
            raise
        raise BadRow(f"image {p} cannot be decoded ({type(e).__name__}: {e}); {_FIX}") from None
    if fit is not None:
        width, height = rgb.size
        short, long = sorted(rgb.size)
        # A side under patch x merge rounds differently in the processor: such slim images stay as they are.
        if width * height > fit.max_pixels and short >= fit.patch * fit.merge and long <= MAX_ASPECT * short:
            size = fit.target(width, height)
            if size != rgb.size:
                rgb = rgb.resize(size, Image.Resampling(fit.resample))
    return rgb
