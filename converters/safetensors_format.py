"""safetensors files: import (single files, sharded sets with an index, folders). The writer export uses
is ``safetensors_writer``, the dtype tables ``safetensors_dtypes``; their public names are importable
from here too.

The format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the byte buffer the offsets index, which the tensors must tile exactly (as safetensors
requires: bytes no tensor covers could hold another file). Files are read directly and memory mapped
(copy-on-write, so the file is never written and pages come from the page cache):
each tensor is a zero-copy view of the mapping, never a second copy of the file.

Every malformed input raises a ``CheckpointError`` subclass naming the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import posixpath
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ckptfmt.converters.importer import Imported
from ckptfmt.converters.safetensors_dtypes import NO_TORCH_DTYPE, PACKED, SAFETENSORS_DTYPES
from ckptfmt.converters.safetensors_dtypes import TORCH_TO_SAFETENSORS as TORCH_TO_SAFETENSORS  # re-exported
from ckptfmt.converters.safetensors_writer import OutTensor as OutTensor  # re-exported
from ckptfmt.converters.safetensors_writer import write_file as write_file  # re-exported
from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptDataError,
    ManifestError,
)

INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
#: A header longer than this is refused as absurd (safetensors' own limit is 100 MB).
MAX_HEADER = 100_000_000



# -- parsing -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors header, validated, with its torch dtype and shape."""

    name: str
    st_dtype: str
    dtype: torch.dtype
    shape: tuple[int, ...]          # torch's shape (F4: the last dimension halved)
    begin: int                      # offsets into the byte buffer
    end: int


@dataclass(frozen=True)
class Header:
    path: str
    data_start: int                 # 8 + N: where the byte buffer starts in the file
    size: int                       # the file's size
    tensors: tuple[TensorSpec, ...] # in buffer order
    metadata: dict[str, str] | None


def read_header(path: str) -> Header:
    """Read and validate a safetensors file's header (the tensors' bytes are not read)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CorruptDataError(
                    f"{path}: truncated safetensors file ({size} bytes; the header length alone takes 8)"
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                raise CorruptDataError(
                    f"{path}: header length {n} is absurd (over {MAX_HEADER} bytes): not a safetensors file?"
                )
            if 8 + n > size:
                raise CorruptDataError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes): truncated?"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such safetensors file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder, not a safetensors file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs)
    except _DuplicateName as exc:
        raise CorruptDataError(f"{path}: header names {exc.args[0]!r} twice") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptDataError(f"{path}: header is not valid JSON ({exc}): not a safetensors file?") from None
    if not isinstance(header, dict):
        raise CorruptDataError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + n
    buffer_len = size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CorruptDataError(f"{path}: __metadata__ must map strings to strings")
    specs = [_tensor_spec(path, name, entry, buffer_len) for name, entry in header.items()]
    specs.sort(key=lambda s: (s.begin, s.end))
    _check_tiling(path, specs, data_start, buffer_len)
    return Header(path, data_start, size, tuple(specs), metadata)


def _check_tiling(path: str, specs: list[TensorSpec], data_start: int, buffer_len: int) -> None:
    """Refuse overlapping tensors and bytes no tensor covers, as safetensors does: such bytes
    could hold another file (a zip appended after the data makes a polyglot)."""
    position, previous = 0, None
    for spec in specs:  # sorted by offsets
        if spec.begin < position:
            raise CorruptDataError(
                f"{path}: tensor {spec.name!r} (bytes {spec.begin}-{spec.end}) overlaps "
                f"tensor {previous.name!r} (bytes {previous.begin}-{previous.end})"
            )
        if spec.begin > position:
            raise _not_covered(path, data_start, position, spec.begin, _gap(previous, spec))
        position, previous = spec.end, spec
    if position < buffer_len:
        raise _not_covered(path, data_start, position, buffer_len, _gap(previous, None))


def _not_covered(path: str, data_start: int, begin: int, end: int, where: str) -> CorruptDataError:
    """safetensors' "file not fully covered", naming the bytes in the file and in the buffer."""
    return CorruptDataError(
        f"{path}: file not fully covered: {end - begin} byte(s) {where} belong to no tensor "
        f"(file offsets [{data_start + begin}, {data_start + end}), data offsets [{begin}, {end}))"
    )


def _gap(before: TensorSpec | None, after: TensorSpec | None) -> str:
    """Where uncovered bytes lie, by the tensors around them."""
    if before is None:
        return "after the header" if after is None else f"before the first tensor, {after.name!r},"
    if after is None:
        return f"after the last tensor, {before.name!r},"
    return f"between tensors {before.name!r} and {after.name!r}"


class _DuplicateName(Exception):
    pass


def _unique_pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateName(key)
            seen.add(key)
    return out


def _tensor_spec(path: str, name: str, entry: Any, buffer_len: int) -> TensorSpec:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CorruptDataError(f"{where}: header entry is not an object")
    st_dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(st_dtype, str):
        raise CorruptDataError(f"{where}: missing or non-string dtype")
    if st_dtype in NO_TORCH_DTYPE:
        raise CheckpointError(f"{where}: dtype {st_dtype} has no torch equivalent and cannot be imported")
    if st_dtype not in SAFETENSORS_DTYPES:
        raise CorruptDataError(f"{where}: unknown dtype {st_dtype!r}")
    torch_name, item = SAFETENSORS_DTYPES[st_dtype]
    dtype = getattr(torch, torch_name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: dtype {st_dtype} needs a newer torch than {torch.__version__}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CorruptDataError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CorruptDataError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_len:
        raise CorruptDataError(f"{where}: data_offsets [{begin}, {end}] lie outside the {buffer_len}-byte buffer")
    torch_shape = tuple(shape)
    per = PACKED.get(st_dtype, 1)
    if per > 1:
        if not shape or shape[-1] % per:
            raise CorruptDataError(f"{where}: {st_dtype} shape {shape} needs an even last dimension")
        torch_shape = (*shape[:-1], shape[-1] // per)
    expected = math.prod(torch_shape) * item
    if end - begin != expected:
        raise CorruptDataError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"dtype {st_dtype} and shape {shape} need {expected}"
        )
    return TensorSpec(name, st_dtype, dtype, torch_shape, begin, end)


def map_tensors(header: Header) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a copy-on-write memory map of the file (in buffer order)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointError(f"{header.path}: reading safetensors on a big-endian machine is not supported")
    out: dict[str, torch.Tensor] = {}
    if not header.tensors:
        return out
    try:
        with open(header.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != header.size:
                raise CorruptDataError(f"{header.path}: file changed size while being read")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise CheckpointError(f"{header.path}: cannot map: {exc}") from exc
    for spec in header.tensors:
        count = spec.end - spec.begin
        if count == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        offset = header.data_start + spec.begin
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=offset)
        if offset % spec.dtype.itemsize:  # only hand-made files are unaligned: copy those
            raw = raw.clone()
        out[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
    return out


# -- import --------------------------------------------------------------------------------------------------


def _find_index(path: str) -> str | None:
    if os.path.isdir(path):
        candidate = os.path.join(path, INDEX_NAME)
        if os.path.isfile(candidate):
            return candidate
        others = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX + ".index.json"))
        return os.path.join(path, others[0]) if len(others) == 1 else None
    return path if path.endswith(".json") else None


def detect(path: str) -> bool:
    """A .safetensors file, an index json, or a folder holding an index or *.safetensors files."""
    path = os.fspath(path)
    try:
        if os.path.isdir(path):
            return _find_index(path) is not None or any(n.endswith(SUFFIX) for n in os.listdir(path))
        if path.endswith((SUFFIX + ".index.json", SUFFIX)):
            return os.path.isfile(path)
        if os.path.isfile(path) and not path.endswith(".json"):
            with open(path, "rb") as f:  # a safetensors file under another name
                head = f.read(9)
            if len(head) == 9 and head[8:9] == b"{":
                (n,) = struct.unpack("<Q", head[:8])
                return 2 <= n <= min(MAX_HEADER, os.path.getsize(path) - 8)
    except OSError:
        return False
    return False


def _read_index(index_path: str) -> tuple[dict[str, str], dict]:
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{index_path}: no such index file") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{index_path}: index is not valid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot read: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (
        isinstance(weight_map, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise ManifestError(f"{index_path}: index has no weight_map of tensor name -> shard file")
    normalized = {}
    for name, shard in weight_map.items():
        parts = shard.replace("\\", "/").split("/")
        if not shard or os.path.isabs(shard) or ".." in parts:
            raise ManifestError(f"{index_path}: tensor {name!r} maps to shard {shard!r} outside the index's folder")
        normalized[name] = posixpath.normpath("/".join(parts))
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ManifestError(f"{index_path}: index metadata is not an object")
    return normalized, meta


def read(path: str) -> Imported:
    """Import a safetensors file, an index json (or its folder), or a folder of *.safetensors files."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or folder")
    notes: list[str] = []
    metadata: dict[str, Any] = {}
    index_path = _find_index(path)
    weight_map: dict[str, str] | None
    if index_path is not None:
        weight_map, folder, headers = _indexed_headers(index_path, metadata, notes)
    else:
        weight_map, folder = None, ""
        if os.path.isdir(path):
            files = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX) and os.path.isfile(os.path.join(path, n)))
            if not files:
                raise CheckpointNotFoundError(f"{path}: no {INDEX_NAME} and no *{SUFFIX} files in this folder")
            headers = [read_header(os.path.join(path, n)) for n in files]
        else:
            headers = [read_header(path)]
    state = _tensors(headers, weight_map, folder, notes)
    _file_metadata(headers, metadata, notes)
    versions = {}
    fmt = (metadata["safetensors_metadata"] or {}).get("format")
    if fmt is not None:
        versions["safetensors_format"] = fmt
    return Imported(state=state, kind="safetensors", step=None, metadata=metadata, rng=None,
                    versions=versions, opaque=[], notes=notes)


def _indexed_headers(index_path: str, metadata: dict[str, Any],
                     notes: list[str]) -> tuple[dict[str, str], str, list[Header]]:
    """An index's weight map, folder and shards' headers, each shard checked to hold what it lists."""
    weight_map, index_meta = _read_index(index_path)
    folder = os.path.dirname(index_path) or "."
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    shards = list(by_shard)
    for shard, names in by_shard.items():
        if not os.path.isfile(os.path.join(folder, shard)):
            raise CheckpointNotFoundError(
                f"{index_path}: shard file {os.path.join(folder, shard)} is missing "
                f"({len(names)} tensor(s), e.g. {names[0]!r})"
            )
    headers = [read_header(os.path.join(folder, shard)) for shard in shards]
    for header, shard in zip(headers, shards):
        present = {s.name for s in header.tensors}
        for name in by_shard[shard]:
            if name not in present:
                raise CorruptDataError(
                    f"{header.path}: tensor {name!r}, listed in {index_path}, is not in this shard"
                )
    metadata["safetensors_index"] = os.path.basename(index_path)
    metadata["safetensors_index_metadata"] = {str(k): v for k, v in index_meta.items()}
    total = index_meta.get("total_size")
    listed_bytes = sum(
        s.end - s.begin for h in headers for s in h.tensors if weight_map.get(s.name) == _rel(folder, h.path)
    )
    if isinstance(total, int) and total != listed_bytes:
        notes.append(f"{index_path}: metadata total_size is {total}, the listed tensors hold {listed_bytes} bytes")
    return weight_map, folder, headers


def _tensors(headers: list[Header], weight_map: dict[str, str] | None, folder: str,
             notes: list[str]) -> dict[str, torch.Tensor]:
    """Every file's tensors, mapped: the index's copy of a name where there is one, in the index's order."""
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for header in headers:
        for name, tensor in map_tensors(header).items():
            if weight_map is not None and weight_map.get(name) != _rel(folder, header.path):
                if name in weight_map:
                    notes.append(f"{header.path}: tensor {name!r} is also in this shard; "
                                 f"the index's copy in {weight_map[name]} is used")
                    continue
                notes.append(f"{header.path}: tensor {name!r} is not in the index; imported anyway")
            if name in state:
                raise CorruptDataError(f"{header.path}: tensor {name!r} is also in {origin[name]}")
            state[name] = tensor
            origin[name] = header.path
    if weight_map is not None:  # the index's order (the model's, in files written by transformers)
        state = {name: state[name] for name in weight_map if name in state} | {
            name: t for name, t in state.items() if name not in weight_map
        }
    return state


def _file_metadata(headers: list[Header], metadata: dict[str, Any], notes: list[str]) -> None:
    """The files' ``__metadata__`` into ``metadata``: what they share, and each shard's where they differ."""
    metas = [h.metadata for h in headers]
    distinct = [m for i, m in enumerate(metas) if m is not None and m not in metas[:i]]
    if len(distinct) <= 1:  # None: no file has a __metadata__ (an export then writes none either)
        metadata["safetensors_metadata"] = dict(distinct[0]) if distinct else None
    else:
        metadata["safetensors_metadata"] = {
            k: v for k, v in distinct[0].items() if all(m.get(k) == v for m in distinct)
        }
        metadata["safetensors_shard_metadata"] = {os.path.basename(h.path): dict(h.metadata or {}) for h in headers}
        notes.append("the shards' __metadata__ differ: each is kept under safetensors_shard_metadata")
    metadata["safetensors_files"] = [os.path.basename(h.path) for h in headers]


def _rel(folder: str, path: str) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")
