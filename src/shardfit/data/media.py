"""Images, audio clips and videos in data rows, in the layouts users already have, reduced to one form before the
text formats read them: every message content a string with an `<image>` / `<audio>` / `<video>` placeholder where
a medium goes, and the row's media in placeholder order (images as absolute paths, clips as paths or WAV bytes,
videos as their frames' absolute paths or their file).

- LLaMA-Factory / ms-swift: `messages` or `conversations` with `<image>` / `<audio>` / `<video>` in the text plus
  `images` / `audios` / `videos` lists (a video: a video file, a list of frame images, or a folder of them).
- OpenAI content parts: a content list of `{"type": "text", "text": ...}`, `{"type": "image", "image": PATH}`,
  `{"type": "image_url", "image_url": {"url": PATH}}` (a plain string url too), `{"type": "audio", "audio": PATH}`,
  `{"type": "input_audio", "input_audio": {"data": BASE64 or PATH, "format": "wav"}}` and
  `{"type": "video", "video": FILE, FRAMES or FOLDER}`.

Paths are relative to the data file. Every file is opened here, before any model loads, so a missing or
unreadable image or clip stops the run (or is counted under skip_bad_rows) naming its row.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfit.data.audio import AudioInput, checked_audio, probe_wav
from shardfit.data.formats import BadRow
from shardfit.data.images import unreadable_image
from shardfit.data.video import VIDEO, VideoClip, video_clip

IMAGE = "<image>"
AUDIO = "<audio>"
_AUDIO_PARTS = ("audio", "input_audio", "audio_url")


@dataclass(frozen=True)
class Media:
    """The media of one row, each kind in the order of its placeholders."""

    images: tuple[str, ...] = ()  # absolute paths
    audios: tuple[AudioInput, ...] = ()  # absolute paths or WAV bytes
    videos: tuple[VideoClip, ...] = ()  # each video: its frames' absolute paths in time order, or its file


def extract_media(row: Any, base: Path) -> tuple[Any, Media]:
    """The row with OpenAI content parts flattened to strings (a placeholder where a medium was) and its media:
    paths resolved against `base` (the data file's folder), every image and frame verified, every clip's header
    read. A row without media comes back unchanged with an empty `Media`."""
    if not isinstance(row, dict):
        return row, Media()
    images: list[str] = []
    audios: list[AudioInput] = []
    videos: list[Any] = []
    turns = row.get("messages")
    if isinstance(turns, list) and any(isinstance(t, dict) and isinstance(t.get("content"), list) for t in turns):
        row = dict(row, messages=[_flatten_turn(t, i, images, audios, videos) for i, t in enumerate(turns)])
    text = _all_text(row)
    images = _listed(row, "images", IMAGE, images, text)
    clips = _listed(row, "audios", AUDIO, audios, text)
    videos = _listed(row, "videos", VIDEO, videos, text, frames=True)
    return row, Media(tuple(_checked(p, base) for p in images),
                      tuple(c if isinstance(c, bytes) else checked_audio(c, base) for c in clips),
                      tuple(_frames_checked(video_clip(v, base, f"videos[{k}]"), base) for k, v in enumerate(videos)))


def _listed(row: dict, key: str, tag: str, parts: list, text: str, frames: bool = False) -> list:
    """The media of one kind: the row's `key` list, or those its content parts named; their count must match the
    placeholders in the text. `frames`: an entry may also be a list of paths (a video's frames)."""
    listed = row.get(key)
    what = key[:-1]
    if listed is not None:
        if isinstance(listed, str):
            listed = [listed]
        ok = (str, list) if frames else str
        if not isinstance(listed, list) or not all(isinstance(p, ok) for p in listed):
            raise BadRow(f"'{key}' must be a list of " + ("frame folders or lists of frame images" if frames
                                                          else "file paths"))
        if parts:
            raise BadRow(f"the row has both an '{key}' list and {what} content parts; use one of them")
        parts = list(listed)
    n_tags = text.count(tag)
    if not parts:
        if n_tags:
            raise BadRow(f"the text has {tag} placeholders but the row lists no {key}; add an '{key}' list")
        return []
    if n_tags != len(parts):
        raise BadRow(f"{n_tags} {tag} placeholder(s) in the text but {len(parts)} {what}(s); put one {tag} where "
                     f"each {what} goes, in the order of '{key}'")
    return parts


def _flatten_turn(turn: Any, i: int, images: list[str], audios: list[AudioInput], videos: list[Any]) -> Any:
    if not isinstance(turn, dict) or not isinstance(turn.get("content"), list):
        return turn
    text: list[str] = []
    for j, part in enumerate(turn["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            images.append(_part_path(part, kind, where))
            text.append(IMAGE)
        elif kind in _AUDIO_PARTS:
            audios.append(_audio_part(part, kind, where))
            text.append(AUDIO)
        elif kind in ("video", "video_url"):
            value = part.get(kind)
            videos.append(value.get("url") if isinstance(value, dict) else value)
            text.append(VIDEO)
        else:
            raise BadRow(f"{where}: a content part needs type text, image, image_url, audio, input_audio or video")
    return dict(turn, content="".join(text))


def _part_path(part: dict, kind: str, where: str) -> str:
    value = part.get(kind)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise BadRow(f"{where}: an {kind} part needs a file path ('{kind}': PATH)")
    if value.startswith(("http://", "https://", "data:")):
        what = "audio" if kind in _AUDIO_PARTS else "image"
        raise BadRow(f"{where}: {value[:40]}...: only local {what} files are read; download the {what} and give "
                     "its path")
    return value.removeprefix("file://")


def _audio_part(part: dict, kind: str, where: str) -> AudioInput:
    """A clip of an audio content part: a path, or (input_audio) base64 WAV data decoded to bytes."""
    if kind != "input_audio":
        return _part_path(part, kind, where)
    spec = part.get("input_audio")
    data = spec.get("data") if isinstance(spec, dict) else None
    if not isinstance(data, str) or not data:
        raise BadRow(f"{where}: an input_audio part needs {{'data': BASE64 or PATH, 'format': 'wav'}}")
    fmt = str(spec.get("format") or "wav").lower()
    if fmt != "wav":
        raise BadRow(f"{where}: input_audio format {fmt!r}: only wav is read; convert the clip to WAV")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    elif "." in data:  # base64 has no dots; a path to a .wav file has one
        return data.removeprefix("file://")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRow(f"{where}: input_audio data is neither base64 WAV data nor a path to a .wav file") from None
    try:
        probe_wav(raw)
    except BadRow as e:
        raise BadRow(f"{where}: {e}") from None
    return raw


def _all_text(row: dict) -> str:
    parts: list[str] = []
    for key in ("messages", "conversations"):
        for turn in row.get(key) or []:
            if isinstance(turn, dict):
                parts += [v for k, v in turn.items() if k in ("content", "value") and isinstance(v, str)]
    parts += [row[k] for k in ("instruction", "input", "system") if isinstance(row.get(k), str)]
    return "\n".join(parts)


def _frames_checked(clip: VideoClip, base: Path) -> VideoClip:
    """A video whose frame images all exist and decode (a video file's header was read already)."""
    return dataclasses.replace(clip, frames=tuple(_checked(f, base) for f in clip.frames)) if clip.frames else clip


def _checked(path: str, base: Path) -> str:
    """The absolute path of an image that exists and decodes."""
    p = Path(path).expanduser()
    p = p if p.is_absolute() else base / p
    problem = unreadable_image(p)
    if problem == "not found":
        raise BadRow(f"image not found: {p} (paths are relative to the data file's folder)")
    if problem:
        raise BadRow(f"image {p} {problem}")
    return str(p.resolve())
