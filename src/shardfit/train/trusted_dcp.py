"""Reading a DCP checkpoint without letting its files run code.

torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain `pickle.load`, and every non-tensor value
of the state dict (optimizer hyperparameters, ...) with an unrestricted `torch.load`: a crafted checkpoint runs
whatever its pickles call. The sha256 manifest does not help, since whoever crafts a checkpoint writes a matching
manifest. So loading goes through:

- `TrustedReader`: `.metadata` through an unpickler that builds only what DCP metadata consists of (its
  dataclasses, torch.Size, dtypes and layouts, paths, containers), and shard file names that stay inside the
  checkpoint directory;
- `TrustedLoadPlanner`: non-tensor values with `torch.load(weights_only=True)`, as the tensors already are.

Anything else is a UserError naming the file: the checkpoint is not one shardfit wrote, or was altered since.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from shardfit.errors import UserError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a `.metadata` written by torch 2.13 refers to (listed from real saves of a model and its AdamW state,
# in one process and over two FSDP2 ranks; tests/test_checkpoint_trust.py checks a real save still loads): DCP's
# metadata dataclasses, the shard-location record of the filesystem writer, torch.Size (tensor sizes and chunk
# offsets), the layout lookup torch pickles layouts through, and the path type of `storage_meta.checkpoint_id`
# (the others for saves made on Windows or with older protocols). Builtin lists, dicts and tuples have their own
# pickle opcodes; dtypes are admitted by type below. None of these does more than build the value it is given.
ALLOWED_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})


def not_trusted(path: Path, why: str) -> UserError:
    """The error for a checkpoint file that is not what shardfit writes."""
    return UserError(f"{path}: not a checkpoint shardfit wrote, or altered since ({why}). It was not loaded: a "
                     "checkpoint's metadata and values are pickles, which could run code. Resume only from "
                     "checkpoints your own runs wrote (resume: never starts the run over).")


def refusal(error: Exception) -> str:
    """The sentence of a failed load that says why: torch's weights_only error opens with, and ends its reason
    with, advice to load the file unrestricted or allow its globals (exactly what must not happen here)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    reason = reason.removeprefix("WeightsUnpickler error:").split(". Please use", 1)[0].strip()
    return reason or type(error).__name__


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ALLOWED_GLOBALS and torch dtypes: no other callable can be reached."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")


def _check_shape(metadata: object) -> Metadata:
    """The unpickled object must be DCP metadata whose shard files are names inside the checkpoint directory."""
    if not isinstance(metadata, Metadata):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
            for k, v in metadata.state_dict_metadata.items()):
        raise ValueError("its state_dict_metadata is not a map of names to tensor or bytes entries")
    if not isinstance(metadata.storage_data, dict):
        raise ValueError("it has no storage_data map")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise ValueError("its storage_data is not a map of indexes to shard locations")
        name = info.relative_path
        if not isinstance(name, str) or not name or PurePath(name).name != name or name in (".", ".."):
            raise ValueError(f"a shard location {name!r} is not a file name inside the checkpoint")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise ValueError("its storage_meta is not DCP's")
    return metadata


def read_metadata(path: Path) -> Metadata:
    """DCP metadata from `path` through the restricted unpickler; a UserError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            return _check_shape(_MetadataUnpickler(f).load())
    except FileNotFoundError:
        raise not_trusted(path, "the file is missing") from None
    except Exception as e:  # noqa: BLE001 - whatever a crafted or damaged pickle raises, it is not loaded
        raise not_trusted(path, refusal(e)) from None


class TrustedReader(FileSystemReader):
    """DCP's filesystem reader with `.metadata` (and a rank's `__N.metadata`) read by `read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # What FileSystemReader.read_metadata does after its unpickling: DCP reads the load id from here.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `weights_only=True` (plain Python values and
    tensors, which is all a training state holds) instead of an unrestricted unpickling."""

    def __init__(self, checkpoint: Path):
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a crafted or damaged value is refused, whatever it raises
            raise not_trusted(self.checkpoint, f"its value {fqn}: {refusal(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
