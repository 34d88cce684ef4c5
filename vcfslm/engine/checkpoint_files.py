"""The files and tensors of a safetensors checkpoint folder, read with the safetensors library.

A folder written by `save_pretrained` holds either one `model.safetensors` or shards named
by `model.safetensors.index.json`. `open_file` opens one of them with `safe_open` (which
maps the file: a tensor it returns is a view of the mapping, read from disk as it is
touched); `checkpoint_entries` lists every tensor of the folder (name, file, dtype, shape)
from the files' headers, reading no tensor, and checks the folder against its index.
Whatever is wrong with a folder is a CheckpointError naming the folder or the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors' words for a header it cannot read ("<prefix><reason>"), and the reason it
# gives a file too short to hold a header.
_SAFETENSORS_PREFIX = "Error while deserializing header: "
_HEADER_TOO_SMALL = "header too small"


class CheckpointError(ValueError):
    """A checkpoint folder whose files do not hold what the model needs."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its name, file, dtype as safetensors writes it ("BF16"),
    and shape."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the index's shards, else model.safetensors,
    else every *.safetensors (sorted)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        shards = sorted(set(_index_map(index).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder}: {INDEX_NAME} names shard {missing[0]}, which is not in the folder")
        return [folder / s for s in shards]
    if (folder / SINGLE_NAME).is_file():
        return [folder / SINGLE_NAME]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file (a checkpoint saved with "
                              "save_pretrained(safe_serialization=True) is needed)")
    return files


def open_file(path: Path):
    """`safe_open(path, framework="pt")`: the file mapped, its header checked by safetensors.
    The mapping lives as long as the handle or any tensor taken from it."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        reason = str(exc).removeprefix(_SAFETENSORS_PREFIX)
        if reason == _HEADER_TOO_SMALL:
            raise CheckpointError(f"{path}: too short for a safetensors file") from None
        raise CheckpointError(f"{path}: not a readable safetensors file ({reason})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in its header's order."""
    path = Path(path)
    handle = open_file(path)
    entries = []
    for name in handle.keys():
        part = handle.get_slice(name)
        entries.append(TensorEntry(name, path, part.get_dtype(), tuple(int(d) for d in part.get_shape())))
    return entries


def checkpoint_entries(folder: Path) -> list[TensorEntry]:
    """Every tensor of a checkpoint folder, file by file; names are unique and, for a sharded
    checkpoint, in the shard its index names."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    expected = _index_map(index) if index.is_file() else None
    entries: list[TensorEntry] = []
    seen: dict[str, Path] = {}
    for path in checkpoint_files(folder):
        for entry in read_header(path):
            if entry.name in seen:
                raise CheckpointError(f"{folder}: tensor {entry.name} is in both {seen[entry.name].name} "
                                      f"and {path.name}")
            if expected is not None and expected.get(entry.name) != path.name:
                raise CheckpointError(f"{folder}: tensor {entry.name} is in {path.name}, but {INDEX_NAME} "
                                      f"places it in {expected.get(entry.name, 'no shard')}")
            seen[entry.name] = path
            entries.append(entry)
    if expected is not None:
        absent = sorted(set(expected) - set(seen))
        if absent:
            raise CheckpointError(f"{folder}: {INDEX_NAME} names tensor {absent[0]}, which is in no shard")
    return entries


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not a mapping")
    return {str(k): str(v) for k, v in weight_map.items()}
