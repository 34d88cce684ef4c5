"""Where each tensor of a safetensors checkpoint lies: its file, dtype, shape and byte range.

A folder written by `save_pretrained` holds either one `model.safetensors` or shards named
by `model.safetensors.index.json`. A safetensors file is an 8-byte little-endian header
length, a JSON header (name -> dtype, shape, data_offsets), then the tensors' bytes. The
header is read here without the safetensors library: the loader maps the bytes itself, so
that it can view them without a copy and give each tensor's pages back once it is packed.

Pure file reading: no torch, nothing loaded but the headers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Bytes per element of the dtypes safetensors writes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint folder whose files do not hold what the model needs."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: `start` is its first byte's offset in `path`."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


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


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in the order of their bytes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    base = 8 + length
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {meta!r}") from None
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or begin < 0 or base + end > size:
            raise CheckpointError(f"{path}: tensor {name}: bytes {begin}..{end} do not hold {dtype} {list(shape)} "
                                  f"within the file ({size} bytes)")
        entries.append(TensorEntry(name, path, dtype, shape, base + begin, end - begin))
    return sorted(entries, key=lambda e: e.start)


def checkpoint_entries(folder: Path) -> list[TensorEntry]:
    """Every tensor of a checkpoint folder, file by file in byte order; names are unique and,
    for a sharded checkpoint, in the shard its index names."""
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
