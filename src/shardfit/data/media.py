"""Images in data rows, in the layouts users already have, reduced to one form before the text formats read them:
every message content a string with an `<image>` placeholder where an image goes, and the row's image files as
absolute paths in placeholder order.

- LLaMA-Factory / ms-swift: `messages` or `conversations` with `<image>` in the text plus an `images` list.
- OpenAI content parts: a content list of `{"type": "text", "text": ...}`, `{"type": "image", "image": PATH}` and
  `{"type": "image_url", "image_url": {"url": PATH}}` (a plain string url too).

Paths are relative to the data file. Every file is opened here, before any model loads, so a missing or
unreadable image stops the run (or is counted under skip_bad_rows) naming its row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardfit.data.formats import BadRow

IMAGE = "<image>"
_UNSUPPORTED = {"videos": "video", "audios": "audio"}
_UNSUPPORTED_PARTS = {"video": "video", "video_url": "video", "input_audio": "audio", "audio": "audio",
                      "audio_url": "audio"}


def extract_images(row: Any, base: Path) -> tuple[Any, tuple[str, ...]]:
    """The row with OpenAI content parts flattened to strings (`<image>` where an image was), and its image paths
    resolved against `base` (the data file's folder). A row without images comes back unchanged with ()."""
    if not isinstance(row, dict):
        return row, ()
    for key, what in _UNSUPPORTED.items():
        if row.get(key):
            raise BadRow(f"'{key}': {what} inputs are not supported yet (images are); remove the {what} from the row")
    images: list[str] = []
    turns = row.get("messages")
    if isinstance(turns, list) and any(isinstance(t, dict) and isinstance(t.get("content"), list) for t in turns):
        row = dict(row, messages=[_flatten_turn(t, i, images) for i, t in enumerate(turns)])
    listed = row.get("images")
    if listed is not None:
        if isinstance(listed, str):
            listed = [listed]
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise BadRow("'images' must be a list of file paths")
        if images:
            raise BadRow("the row has both an 'images' list and image content parts; use one of them")
        images = list(listed)
    if not images:
        if IMAGE in _all_text(row):
            raise BadRow(f"the text has {IMAGE} placeholders but the row lists no images; add an 'images' list")
        return row, ()
    n_tags = _all_text(row).count(IMAGE)
    if n_tags != len(images):
        raise BadRow(f"{n_tags} {IMAGE} placeholder(s) in the text but {len(images)} image(s); put one {IMAGE} "
                     "where each image goes, in the order of 'images'")
    return row, tuple(_checked(p, base) for p in images)


def _flatten_turn(turn: Any, i: int, images: list[str]) -> Any:
    if not isinstance(turn, dict) or not isinstance(turn.get("content"), list):
        return turn
    text: list[str] = []
    for j, part in enumerate(turn["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            images.append(_part_path(part, kind, f"messages[{i}].content[{j}]"))
            text.append(IMAGE)
        elif kind in _UNSUPPORTED_PARTS:
            raise BadRow(f"messages[{i}].content[{j}]: {_UNSUPPORTED_PARTS[kind]} inputs are not supported yet "
                         "(images are)")
        else:
            raise BadRow(f"messages[{i}].content[{j}]: a content part needs type text, image or image_url")
    return dict(turn, content="".join(text))


def _part_path(part: dict, kind: str, where: str) -> str:
    value = part.get(kind)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise BadRow(f"{where}: an {kind} part needs a file path ('{kind}': PATH)")
    if value.startswith(("http://", "https://", "data:")):
        raise BadRow(f"{where}: {value[:40]}...: only local image files are read; download the image and give its "
                     "path")
    return value.removeprefix("file://")


def _all_text(row: dict) -> str:
    parts: list[str] = []
    for key in ("messages", "conversations"):
        for turn in row.get(key) or []:
            if isinstance(turn, dict):
                parts += [v for k, v in turn.items() if k in ("content", "value") and isinstance(v, str)]
    parts += [row[k] for k in ("instruction", "input", "system") if isinstance(row.get(k), str)]
    return "\n".join(parts)


def _checked(path: str, base: Path) -> str:
    """The absolute path of an image that exists and decodes (header and data checked, pixels not kept)."""
    from PIL import Image, UnidentifiedImageError  # Pillow only for image data: text-only runs never import it

    p = Path(path).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise BadRow(f"image not found: {p} (paths are relative to the data file's folder)")
    try:
        with Image.open(p) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise BadRow(f"image {p} cannot be read ({type(e).__name__}: {e}); re-save it as PNG or JPEG") from None
    return str(p.resolve())
