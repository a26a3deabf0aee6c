"""Read PyTorch DCP (``torch.distributed.checkpoint``) folders without running their pickles.

A DCP folder written by ``FileSystemWriter`` holds:

- ``.metadata``: a pickle of ``torch.distributed.checkpoint.metadata.Metadata`` with
  ``state_dict_metadata`` (flattened key -> ``TensorStorageMetadata(properties, size,
  chunks=[ChunkStorageMetadata(offsets, sizes)])`` or ``BytesStorageMetadata()``),
  ``planner_data`` (flattened key -> the original path tuple, when the planner flattened a
  nested state: ``"optim.state.0.lr" -> ("optim", "state", "0", "lr")``) and
  ``storage_data`` (``MetadataIndex(fqn, offset)`` -> ``_StorageInfo(relative_path,
  offset, length[, transform_descriptors])``).
- ``*.distcp`` files (``__RANK_N.distcp``): each item stored at (offset, length). With the
  default torch_save serialization a tensor chunk is a whole ``torch.save`` stream of that
  chunk, and a bytes item is the ``io.BytesIO`` the planner wrote (``torch.save`` of the object).

``.metadata`` goes through ``converters.pickles.RestrictedUnpickler`` with its allow-list
unchanged: the DCP classes are not imported or called; they come back as recorded nodes
(class name, BUILD state) and ``read_metadata`` rebuilds them here as plain dataclasses,
accepting only the exact classes and field shapes listed in ``_DCP_CLASSES``. Every item is
read through ``torch_format.load_object`` (the same restricted reader, CRC-checked) over
the mapped file, so tensors are views of the files, not copies.

A tensor with one chunk covering it becomes a plain tensor; a tensor in several chunks
becomes ``ckptfmt.Sharded`` with one ``ckptfmt.Shard`` per chunk (its offsets, and the rank
taken from the ``__RANK_N.distcp`` file name, else 0), so the checkpoint keeps the shards.
The nested state is rebuilt from ``planner_data`` (an int path element indexes a list).
Storage transforms (compression extensions) and the safetensors serialization are refused.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

import ckptfmt
from ckptfmt.converters.importer import Imported, note_opaque_and_step
from ckptfmt.converters.pickles import (
    MAX_PICKLE_BYTES,
    BudgetReader,
    Node,
    PickleError,
    RestrictedUnpickler,
    to_value_tree,
)
from ckptfmt.converters.torch_format import load_object
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.format.values import format_key

METADATA_NAME = ".metadata"
SUFFIX = ".distcp"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
#: The DCP classes ``.metadata`` may name (as recorded nodes, never imported), by (module, qualname).
_DCP_CLASSES = {
    "Metadata": (_MD, "Metadata"),
    "TensorStorageMetadata": (_MD, "TensorStorageMetadata"),
    "BytesStorageMetadata": (_MD, "BytesStorageMetadata"),
    "ChunkStorageMetadata": (_MD, "ChunkStorageMetadata"),
    "TensorProperties": (_MD, "TensorProperties"),
    "MetadataIndex": (_MD, "MetadataIndex"),
    "StorageMeta": (_MD, "StorageMeta"),
    "_StorageInfo": (_FS, "_StorageInfo"),
}
_RANK_FILE = re.compile(r"__(\d+)_\d+" + re.escape(SUFFIX) + r"$")


# --------------------------------------------------------------------------- plain metadata


@dataclass(frozen=True)
class Chunk:
    """One chunk of a tensor: where it starts in the global tensor and its shape."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    requires_grad: bool = False


@dataclass(frozen=True)
class BytesMeta:
    pass


@dataclass(frozen=True)
class StorageInfo:
    """Where an item's bytes are: ``relative_path`` inside the folder, (offset, length)."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class DcpMetadata:
    """``.metadata`` as plain data."""

    entries: dict[str, TensorMeta | BytesMeta]
    #: (fqn, chunk offsets or None for bytes items) -> where its bytes are
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo]
    planner_data: dict[str, tuple] = field(default_factory=dict)
    version: str | None = None


def _bad(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: not a DCP metadata file this importer understands ({what})")


def _fields(node: Any, cls: str, where: str) -> Any:
    """The BUILD state of a recorded ``cls()`` node (cls.__new__(cls) then BUILD), checked."""
    if not isinstance(node, Node) or node.name != _DCP_CLASSES[cls]:
        got = ".".join(node.name) if isinstance(node, Node) else type(node).__name__
        raise _bad(where, f"expected {cls}, found {got}")
    if node.kind != "newobj" or node.args or node.kwargs or any(op[0] != "build" for op in node.ops) \
            or len(node.ops) > 1:
        raise _bad(where, f"{cls} recorded in an unexpected way")
    return node.ops[0][1] if node.ops else {}


def _dict_fields(node: Any, cls: str, where: str, required: tuple[str, ...]) -> dict:
    state = _fields(node, cls, where)
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise _bad(where, f"{cls} state is not a dict of fields")
    missing = [name for name in required if name not in state]
    if missing:
        raise _bad(where, f"{cls} lacks {', '.join(missing)}")
    return state


def _ints(value: Any, what: str, where: str, *, optional: bool = False) -> tuple[int, ...] | None:
    if value is None and optional:
        return None
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _bad(where, f"{what} is not a tuple of non-negative ints")
    return tuple(value)


def _properties(node: Any, where: str) -> tuple[torch.dtype, bool]:
    state = _fields(node, "TensorProperties", where)
    if type(state) is tuple and state:  # __getstate__: (dtype, layout, requires_grad, memory_format, pin_memory)
        dtype, layout = state[0], state[1] if len(state) > 1 else None
        requires_grad = state[2] if len(state) > 2 else False
    elif type(state) is dict:
        dtype, layout, requires_grad = state.get("dtype"), state.get("layout"), state.get("requires_grad", False)
    else:
        raise _bad(where, "TensorProperties state is malformed")
    if not isinstance(dtype, torch.dtype):
        raise _bad(where, f"tensor dtype {dtype!r} is not a torch dtype")
    # the layout is recorded as the call torch.serialization._get_layout("torch.strided")
    strided = isinstance(layout, Node) and layout.name == ("torch.serialization", "_get_layout") \
        and layout.args == ("torch.strided",) and not layout.ops
    if layout is not None and not strided:
        raise CheckpointError(f"{where}: a tensor with a layout other than torch.strided cannot be imported")
    return dtype, requires_grad is True


def read_metadata(folder: str) -> DcpMetadata:
    """Parse ``FOLDER/.metadata`` (restricted: nothing in it is imported or run) into plain data."""
    where = os.path.join(folder, METADATA_NAME)
    root = _unpickled(where)
    top = _dict_fields(root, "Metadata", where, ("state_dict_metadata",))
    entries = _entries(top, where)
    storage = _storage_index(top, where)
    planner_data = _planner_data(top)
    version = top.get("version")
    return DcpMetadata(entries, storage, planner_data, version if type(version) is str else None)


def _unpickled(where: str) -> Any:
    """The ``.metadata`` file at ``where``, unpickled under the restrictions (its classes as nodes)."""
    try:
        with open(where, "rb") as f:
            data = f.read(MAX_PICKLE_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where}: no such file: not a complete DCP checkpoint "
                                      "(the .metadata file is written last)") from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read ({exc})") from exc
    if len(data) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{where}: over {MAX_PICKLE_BYTES} bytes")
    try:
        root = RestrictedUnpickler(BudgetReader(data), torch_files=load_object).load_checked()
    except PickleError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return root


def _entries(top: dict, where: str) -> dict[str, TensorMeta | BytesMeta]:
    """``state_dict_metadata``: each key's tensor (dtype, size, chunks) or bytes entry, checked."""
    sdm = top["state_dict_metadata"]
    if type(sdm) is not dict:
        raise _bad(where, "state_dict_metadata is not a dict")
    entries: dict[str, TensorMeta | BytesMeta] = {}
    for fqn, node in sdm.items():
        if type(fqn) is not str:
            raise _bad(where, f"key {fqn!r} is not a string")
        if isinstance(node, Node) and node.name == _DCP_CLASSES["BytesStorageMetadata"]:
            _fields(node, "BytesStorageMetadata", where)
            entries[fqn] = BytesMeta()
            continue
        state = _dict_fields(node, "TensorStorageMetadata", where, ("properties", "size", "chunks"))
        dtype, requires_grad = _properties(state["properties"], where)
        size = _ints(state["size"], f"{fqn}: size", where)
        if type(state["chunks"]) is not list:
            raise _bad(where, f"{fqn}: chunks is not a list")
        chunks = []
        for chunk_node in state["chunks"]:
            chunk = _dict_fields(chunk_node, "ChunkStorageMetadata", where, ("offsets", "sizes"))
            offsets = _ints(chunk["offsets"], f"{fqn}: chunk offsets", where)
            sizes = _ints(chunk["sizes"], f"{fqn}: chunk sizes", where)
            if len(offsets) != len(size) or len(sizes) != len(size) \
                    or any(o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise CheckpointError(f"{where}: {fqn}: chunk at {list(offsets)} of shape {list(sizes)} "
                                      f"lies outside the tensor's shape {list(size)}")
            chunks.append(Chunk(offsets, sizes))
        entries[fqn] = TensorMeta(dtype, size, tuple(chunks), requires_grad)
    return entries


def _storage_index(top: dict, where: str) -> dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    """``storage_data``: where each item's bytes are (file inside the folder, offset, length, transforms)."""
    storage_data = top.get("storage_data")
    if type(storage_data) is not dict:
        raise _bad(where, "storage_data is missing (not written by FileSystemWriter?)")
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    for index_node, info_node in storage_data.items():
        index = _dict_fields(index_node, "MetadataIndex", where, ("fqn",))
        if type(index["fqn"]) is not str:
            raise _bad(where, "MetadataIndex.fqn is not a string")
        offset = _ints(index.get("offset"), "MetadataIndex.offset", where, optional=True)
        info = _dict_fields(info_node, "_StorageInfo", where, ("relative_path", "offset", "length"))
        path, begin, length = info["relative_path"], info["offset"], info["length"]
        if type(path) is not str or type(begin) is not int or type(length) is not int or begin < 0 or length < 0:
            raise _bad(where, f"storage info of {index['fqn']!r} is malformed")
        if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise CheckpointError(f"{where}: storage file {path!r} is outside the checkpoint folder")
        transforms = info.get("transform_descriptors") or ()
        if not isinstance(transforms, (list, tuple)) or not all(type(t) is str for t in transforms):
            raise _bad(where, "transform_descriptors is malformed")
        storage[(index["fqn"], offset)] = StorageInfo(path, begin, length, tuple(transforms))
    return storage


def _planner_data(top: dict) -> dict[str, tuple]:
    """``planner_data``: each key's path in the nested state dict, where well formed."""
    planner = top.get("planner_data")
    planner_data: dict[str, tuple] = {}
    if type(planner) is dict:
        for fqn, path in planner.items():
            if type(fqn) is str and type(path) in (tuple, list) and path \
                    and all(type(p) in (str, int) for p in path):
                planner_data[fqn] = tuple(path)
    return planner_data


def _folder(path: str) -> str:
    if os.path.basename(path) == METADATA_NAME and os.path.isfile(path):
        return os.path.dirname(path) or "."
    return path


def detect(path: str) -> bool:
    """True for a folder holding ``.metadata`` or ``*.distcp`` files (or the ``.metadata`` file itself)."""
    folder = _folder(os.fspath(path))
    if not os.path.isdir(folder):
        return False
    if os.path.isfile(os.path.join(folder, METADATA_NAME)):
        return True
    try:
        return any(name.endswith(SUFFIX) for name in os.listdir(folder))
    except OSError:
        return False


class _Files:
    """The folder's .distcp files, memory-mapped copy-on-write on first use."""

    def __init__(self, folder: str):
        self.folder = folder
        self.maps: dict[str, memoryview] = {}

    def item(self, info: StorageInfo, what: str) -> memoryview:
        where = os.path.join(self.folder, info.relative_path)
        if info.transforms:
            raise CheckpointError(f"{where}: {what} is stored through transforms "
                                  f"({', '.join(info.transforms)}), which this importer does not support")
        if info.relative_path not in self.maps:
            try:
                with open(where, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    self.maps[info.relative_path] = memoryview(
                        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b"")
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{where}: no such file (the .metadata names it for {what})") from None
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{where}: cannot read ({exc})") from None
        view = self.maps[info.relative_path]
        end = info.offset + info.length
        if end > len(view):
            raise CheckpointError(f"{where}: truncated: {what} needs bytes {info.offset}..{end}, "
                                  f"the file has {len(view)}")
        return view[info.offset:end]  # writable (copy-on-write): load_object builds its tensors over it


def _load_item(files: _Files, info: StorageInfo, what: str, notes: set) -> tuple[Any, str]:
    where = os.path.join(files.folder, info.relative_path)
    data = files.item(info, what)
    label = f"{where} ({what} at {info.offset})"
    if bytes(data[:4]) != b"PK\x03\x04":
        raise CheckpointError(f"{label}: not a torch.save stream (safetensors serialization is not supported)")
    try:
        return load_object(data, label, notes=notes), label
    except PickleError as exc:
        raise CheckpointError(f"{label}: {exc}") from None


def _rank(relative_path: str) -> int:
    found = _RANK_FILE.search(relative_path)
    return int(found.group(1)) if found else 0


def _tensor(files: _Files, fqn: str, meta: TensorMeta, md: DcpMetadata, where: str, notes: set) -> Any:
    pieces = []
    for chunk in meta.chunks:
        info = md.storage.get((fqn, chunk.offsets))
        if info is None:
            raise CheckpointError(f"{where}: {fqn}: no storage entry for the chunk at {list(chunk.offsets)}")
        obj, label = _load_item(files, info, f"{fqn} chunk {list(chunk.offsets)}", notes)
        tensor = to_value_tree(obj, label, notes).value
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{label}: holds a {type(tensor).__name__}, not a tensor")
        if tensor.dtype != meta.dtype or tuple(tensor.shape) != chunk.sizes:
            raise CheckpointError(f"{label}: holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, "
                                  f"the .metadata says {meta.dtype} of shape {list(chunk.sizes)}")
        tensor = tensor.detach()
        if meta.requires_grad:
            tensor.requires_grad_(True)
        pieces.append((chunk, tensor, _rank(info.relative_path)))
    if len(pieces) == 1 and pieces[0][0].sizes == meta.size and not any(pieces[0][0].offsets):
        return pieces[0][1]
    if not pieces:
        if any(meta.size) and 0 not in meta.size:
            raise CheckpointError(f"{where}: {fqn}: no chunks recorded for a tensor of shape {list(meta.size)}")
        return torch.empty(meta.size, dtype=meta.dtype)
    return ckptfmt.Sharded(meta.size, [ckptfmt.Shard(chunk.offsets, tensor.contiguous(), rank)
                                       for chunk, tensor, rank in pieces])


def _place(root: dict, path: tuple, value: Any, where: str) -> None:
    """Set ``value`` at ``path`` (as DCP's unflatten does: an int element indexes a list)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if type(key) is not int:
                raise CheckpointError(f"{where}: path {list(path)} indexes a list with {key!r}")
            if key >= len(node):
                node.extend([None] * (key + 1 - len(node)))
        elif not isinstance(node, dict):
            raise CheckpointError(f"{where}: path {list(path)} goes through a {type(node).__name__}")
        if last:
            node[key] = value
            return
        nxt = node[key] if (isinstance(node, list) or key in node) else None
        if nxt is None:
            nxt = [] if type(path[i + 1]) is int else {}
            node[key] = nxt
        node = nxt


def read(path: str) -> Imported:
    """Read a DCP folder as an import (raises CheckpointError naming the file)."""
    folder = _folder(os.fspath(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a folder: a DCP checkpoint is a folder with .metadata and *.distcp")
    md = read_metadata(folder)
    where = os.path.join(folder, METADATA_NAME)
    files = _Files(folder)
    notes: set[str] = set()
    opaque: list[str] = []
    state: dict = {}
    tensors = sharded = 0
    for fqn, meta in md.entries.items():
        item_path = md.planner_data.get(fqn, (fqn,))
        if isinstance(meta, TensorMeta):
            value = _tensor(files, fqn, meta, md, where, notes)
            tensors += 1
            sharded += isinstance(value, ckptfmt.Sharded)
        else:
            info = md.storage.get((fqn, None))
            if info is None:
                raise CheckpointError(f"{where}: {fqn}: no storage entry for this bytes item")
            obj, label = _load_item(files, info, fqn, notes)
            converted = to_value_tree(obj, label, notes)
            value = converted.value
            prefix = format_key(item_path)
            opaque.extend(prefix if p == "<root>" else f"{prefix}/{p}" for p in converted.opaque)
        _place(state, item_path, value, where)
    versions = {"dcp": "FileSystemWriter"}
    if md.version:
        versions["dcp metadata version"] = md.version
    imported = Imported(state=state, kind="dcp", versions=versions, opaque=opaque, notes=sorted(notes))
    files_used = sorted({info.relative_path for info in md.storage.values()})
    imported.notes.append(f"{len(md.entries)} item(s) from {len(files_used)} .distcp file(s): "
                          f"{tensors} tensor(s), {sharded} kept as shards")
    if not md.planner_data:
        imported.notes.append("the .metadata has no planner_data: flattened keys kept as they are")
    note_opaque_and_step(imported, opaque)
    return imported


__all__ = ["BytesMeta", "Chunk", "DcpMetadata", "StorageInfo", "TensorMeta", "detect", "read", "read_metadata"]
