"""What every export writer shares: the result it reports, opaque objects turned back into pickles,
sizes like "5GB", files that appear only once complete, and Hugging Face's sharded safetensors layout."""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import ckptfmt
from ckptfmt.converters.safetensors_format import INDEX_NAME, write_file
from ckptfmt.errors import CheckpointError


@dataclass
class ExportResult:
    """What an export wrote, and what it could not carry over."""

    path: str
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


class _Repickled:
    """Pickles as ``pickle.loads(data)``: an opaque object's own pickle, unchanged."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return pickle.loads, (self.data,)


def restore_opaque(value, found: list[str]):
    """The state with each OpaqueObject replaced by its pickle (containers rebuilt only when needed)."""
    kind = type(value)
    if kind is ckptfmt.OpaqueObject:
        found.append(f"{value.module}.{value.qualname}")
        return _Repickled(value.pickle)
    if kind in (dict, OrderedDict):
        items = [(restore_opaque(k, found), restore_opaque(v, found)) for k, v in value.items()]
        if all(a is k and b is v for (a, b), (k, v) in zip(items, value.items())):
            return value
        return kind(items)
    if kind in (list, tuple, set, frozenset):
        items = [restore_opaque(v, found) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return kind(items)
    return value


#: Hugging Face's default shard size (save_pretrained's max_shard_size).
DEFAULT_SHARD_SIZE = 5_000_000_000
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like '5GB' (10**9), '2GiB' (2**30), '100MB' or '123456'."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if unit not in _SIZE_UNITS:
            raise CheckpointError(f"shard size {value!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise CheckpointError(f"shard size {value!r}: expected bytes or a size like '5GB'")
    if size <= 0:
        raise CheckpointError(f"shard size {value!r} must be positive")
    return size


def safetensors_shards(folder: str, tensors: list, metadata: dict, limit: int, notes: list[str]) -> ExportResult:
    """Hugging Face layout: model-0000i-of-0000N.safetensors and model.safetensors.index.json."""
    shards: list[list] = [[]]
    size = 0
    for t in tensors:  # greedy, in key order; a tensor over the limit gets a shard of its own
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    count = len(shards)
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot create the output folder: {exc}") from exc
    stale = sorted(
        n for n in os.listdir(folder) if re.fullmatch(r"model-\d+-of-\d+\.safetensors", n) and n not in names
    )
    if stale:
        notes.append(f"{folder}: older shard file(s) not in the new index are left as they were: {', '.join(stale)}")
    temps = [os.path.join(folder, f".{name}.tmp-{os.getpid()}") for name in names]
    try:
        for tmp, shard in zip(temps, shards):  # every shard first, then renames, the index last
            write_file(tmp, shard, metadata)
        for tmp, name in zip(temps, names):
            os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
    index_path = os.path.join(folder, INDEX_NAME)
    write_atomically(index_path, lambda tmp: write_json(tmp, index))
    files = [os.path.join(folder, name) for name in names] + [index_path]
    return ExportResult(folder, len(tensors), sum(os.path.getsize(f) for f in files), notes, files)


def write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_atomically(dest: str, write) -> None:
    """Write through a temp file and rename, so a failed export never leaves a half file."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
