"""The manifest: one checkpoint's tensors, chunks, state tree and run metadata, in msgpack.

``Manifest.to_bytes`` writes it; ``Manifest.from_bytes`` is the only way a reader
gets one, and validates everything a hostile or damaged file could lie about
(types, limits, hashes, shapes against byte counts) before anything is allocated.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any

import msgpack

from ckptfmt._collector import collector_paused
from ckptfmt.errors import CheckpointError, ManifestError, quoted
from ckptfmt.format.chunk_table import Chunk, parse_table, table_doc
from ckptfmt.format.codecs import is_delta, is_float
from ckptfmt.format.dtypes import ITEMSIZES as _ITEMSIZES
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.features import check_declared, check_requires, first_version, version_fields, version_text
from ckptfmt.format.limits import (
    MAX_DIMS,
    MAX_KEY_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_NESTING,
    MAX_PIECES,
    MAX_SHARDS,
    MAX_SHARDS_PER_TENSOR,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    all_ints,
    check_int,
    check_name,
)
from ckptfmt.format.placement import Placement
from ckptfmt.format.rng_states import python_words
from ckptfmt.format.shards import (
    MAX_RANK,
    Piece,
    ShardEntry,
    ShardGrid,
    grid_of,
    grid_to_dict,
    parse_grid,
    parse_usual_grids,
)
from ckptfmt.format.tensor_columns import parse_columns, to_columns
from ckptfmt.format.tensor_entry import TENSOR_KINDS, TensorEntry, TensorTable, as_table, check_table, likeness
from ckptfmt.format.tensor_stats import FLOAT_FIELDS, stat_sets
from ckptfmt.format.tiling import check_tiling
from ckptfmt.format.unpacking import unpack_manifest
from ckptfmt.format.version import FORMAT_VERSION, check_version

MANIFEST_FORMAT = "ckptfmt-manifest"
#: The first version whose writers hold the tensor table in columns (spec 6.12).
_COLUMNS_FROM = (1, 12)
#: The first version whose writers hold the chunk table in columns (spec 6.13).
_CHUNK_COLUMNS_FROM = (1, 13)
#: The first version whose writers hold shard grids in the tensor columns (spec 6.12).
_GRID_COLUMNS_FROM = (1, 14)
#: Shard grids (1.6, spec 6.11): a tensor's shards as a map, lists of maps before.
_GRIDS_FROM = (1, 6)
#: Python generator states as one bin (spec 9.1), arrays of ints before: written from 1.14 though 1.13 has
#: the form, because the commit that brought format 1.13 (db32f5c) restores only the ints (the bin came
#: with d9323e9, still 1.13), and every 1.13 reader restores the ints.
_RNG_WORDS_FROM = (1, 14)


@dataclass
class Manifest:
    """Everything about one checkpoint except the tensor bytes themselves."""

    name: str
    step: int | None
    created_ns: int
    parent: str | None
    chunks: list[Chunk]
    #: The tensor table; entries in any sequence are held as a ``TensorTable`` (built lazily when read).
    tensors: TensorTable
    state: bytes
    user: bytes
    rng: list[dict] = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    #: The checkpoint's totals (spec 9.5, the manifest's ``stats`` map): tensor and chunk counts and bytes.
    totals: dict = field(default_factory=dict)
    #: Where an imported checkpoint came from (source kind, path, versions, import timing).
    provenance: dict | None = None
    #: A collective save's comparison of replicated tensors (spec 9.7): ``{"checked", "divergent"}``.
    replicas: dict | None = None
    #: Which node holds which chunks, in a node-scoped repository (spec 9.8); None elsewhere.
    placement: Placement | None = None
    version: tuple[int, int] = FORMAT_VERSION
    #: Required features (spec 13.2): as read, those the manifest declares. A writer declares those the
    #: written fields show, and of these the ones its state's bytes use (per-rank values).
    requires: frozenset[str] = frozenset()
    #: Fields this reader does not know (from a newer minor version), kept as read.
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = as_table(self.tensors)

    @property
    def stats(self) -> dict:
        """Deprecated name of ``totals``: ``stats`` means a tensor's statistics everywhere else."""
        warnings.warn("Manifest.stats is renamed totals", DeprecationWarning, stacklevel=2)
        return self.totals

    def to_dict(self) -> dict:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": list(self.version),
            "name": self.name,
            "step": self.step,
            "created_ns": self.created_ns,
            "parent": self.parent,
            "chunks": table_doc(self.chunks, columns=self.version >= _CHUNK_COLUMNS_FROM),
            "tensors": to_columns(self.tensors, _tensor_to_dict, grids=self.version >= _GRID_COLUMNS_FROM)
            if self.version >= _COLUMNS_FROM
            else [_tensor_to_dict(t, grids=self.version >= _GRIDS_FROM) for t in self.tensors],
            "state": self.state,
            "user": self.user,
            "rng": self.rng if self.version >= _RNG_WORDS_FROM else [_python_ints(entry) for entry in self.rng],
            "environment": self.environment,
            "topology": self.topology,
            "timing": self.timing,
            "stats": self.totals,
        }
        if self.provenance is not None:
            doc["provenance"] = self.provenance
        if self.replicas is not None:
            doc["replicas"] = self.replicas
        if self.placement is not None:
            doc["placement"] = self.placement.to_record()
        used = features_of(doc) | (self.requires & _STATE_FEATURES)
        too_new = sorted(name for name in used if first_version(name) > self.version)
        if too_new:  # the writer chose forms for this version: this is a bug, never a file for a reader to meet
            raise ValueError(f"a manifest of format {version_text(self.version)} cannot use {', '.join(too_new)}")
        head = {"format": MANIFEST_FORMAT, **version_fields(self.version, used)}  # 'requires' read first
        return {**self.extra, **head, **doc}

    def to_bytes(self) -> bytes:
        with collector_paused():  # a dict per tensor and shard: no cycles to find
            return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, where: str, *, skip: frozenset[str] = frozenset()) -> Manifest:
        """Parse and validate a manifest; every problem raises ManifestError naming ``where``.

        ``skip``: optional top-level fields the caller does not need, passed over
        without building their values (they read as their defaults). Analytics
        skips ``rng``, 80% of a many-rank manifest's parse time. A tensor table in
        columns is checked whole here; its entries are built when read.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: manifest of {len(data)} bytes is over the {MAX_MANIFEST_BYTES} limit")
        if not skip <= OPTIONAL_FIELDS:
            raise ValueError(f"only optional fields can be skipped ({', '.join(sorted(OPTIONAL_FIELDS))})")
        with collector_paused():
            try:
                doc = unpack_manifest(data, skip)
            except CheckpointError as exc:
                raise type(exc)(f"{where}: {exc}") from None
            except Exception as exc:
                raise ManifestError(f"{where}: not a valid msgpack manifest ({exc})") from None
            try:
                return _parse(doc)
            except CheckpointError as exc:
                raise type(exc)(f"{where}: {exc}") from None
            except RecursionError:  # a safety net: nesting is bounded where values are parsed
                raise ManifestError(f"{where}: malformed manifest (nested too deeply)") from None
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
                raise ManifestError(f"{where}: malformed manifest ({exc})") from None

    @classmethod
    def check(cls, data: bytes, where: str) -> None:
        """Validate a manifest as ``from_bytes`` does, keeping nothing: a save checks its own manifest
        before it commits it."""
        cls.from_bytes(data, where)


#: Top-level fields ``from_bytes`` may skip (wire names): optional, and nothing else in the manifest refers
#: to them. A reader of the chunk and tensor tables, parent and user values alone skips them all.
OPTIONAL_FIELDS = frozenset({"rng", "environment", "topology", "timing", "stats", "provenance", "replicas",
                             "placement"})


def optional_fields_except(*needed: str) -> frozenset[str]:
    """What a reader that needs only ``needed`` of the optional fields skips."""
    unknown = set(needed) - OPTIONAL_FIELDS
    if unknown:
        raise ValueError(f"not optional manifest fields: {', '.join(sorted(unknown))}")
    return OPTIONAL_FIELDS - frozenset(needed)


def _tensor_to_dict(t: TensorEntry, grids: bool = True) -> dict:
    """An entry as a map (spec 6.4); its shards as a grid map where they form one and ``grids`` (1.6)."""
    width = itemsize(t.dtype)
    grid = None if not grids else t.shards if isinstance(t.shards, ShardGrid) else grid_of(t.shape, t.shards)
    doc = {
        "key": t.key,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "kind": t.kind,
        "requires_grad": t.requires_grad,
        "shards": grid_to_dict(grid, width) if grid is not None else [
            {
                "offsets": list(s.offsets),
                "shape": list(s.shape),
                "rank": s.rank,
                "pieces": [[p.chunk, p.offset, p.length] for p in s.pieces],
            }
            for s in t.shards
        ],
    }
    if t.same_as is not None:
        doc["same_as"] = t.same_as
    if t.stats is not None:
        doc["stats"] = dict(t.stats)  # a save's may be a row of its pack's columns (``StatsRow``)
    return doc


# -- parsing and validation ---------------------------------------------------

def _get(doc: dict, key: str, kind: type | tuple, *, optional: bool = False, default: Any = None) -> Any:
    if key not in doc:
        if optional:
            return default
        raise ManifestError(f"missing field {key!r}")
    value = doc[key]
    if value is None and optional:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"field {key!r} has type {type(value).__name__}")
    return value


_KNOWN_FIELDS = frozenset(
    "format version name step created_ns parent chunks tensors state user rng environment topology timing stats "
    "provenance replicas placement requires".split()
)


class _Sizes(list):
    """The chunk table's decoded sizes, as a list, and as an array for shard grids (made once, if needed)."""

    @functools.cached_property
    def array(self) -> Any:
        """The sizes as an int64 numpy array (shard grids only: numpy is imported then)."""
        import numpy as np

        return np.array(self, dtype=np.int64)


class _Budget:
    """Pieces and shards left for the rest of the manifest (spec 14), so that work stays bounded."""

    def __init__(self) -> None:
        self.pieces = MAX_PIECES
        self.shards = MAX_SHARDS

    def take(self, shards: int, pieces: int) -> None:
        self.shards -= shards
        self.pieces -= pieces
        if self.shards < 0:
            raise ManifestError(f"more than {MAX_SHARDS} shards in one manifest")
        if self.pieces < 0:
            raise ManifestError(f"more than {MAX_PIECES} pieces in one manifest")


def _parse(doc: Any) -> Manifest:
    """The manifest ``doc`` holds, checked whole."""
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a map")
    if doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"not a ckptfmt manifest (format field {quoted(doc.get('format'))})")
    version = check_version(doc.get("version"), "manifest")
    requires = check_requires(doc, version, "manifest")
    raw_chunks = _get(doc, "chunks", (list, dict))
    raw_tensors = _get(doc, "tensors", (list, dict))
    if len(raw_tensors) > MAX_TENSORS:
        raise ManifestError("too many chunks or tensors")
    chunks = parse_table(raw_chunks)
    sizes = _Sizes(c.size for c in chunks)
    budget = _Budget()
    if type(raw_tensors) is list:
        entries = _parse_tensors(raw_tensors, sizes, budget)
        check_table([t.key for t in entries], entries, lambda index: likeness(entries[index]))
        tensors = TensorTable(entries)
    else:
        tensors = parse_columns(raw_tensors, sizes.array, budget, partial(_parse_rows, sizes=sizes, budget=budget))
    parent = _get(doc, "parent", str, optional=True)
    rng = _get(doc, "rng", list, optional=True, default=[])
    if not all(isinstance(r, dict) for r in rng):
        raise ManifestError("rng entries must be maps")
    extra = {k: v for k, v in doc.items() if k not in _KNOWN_FIELDS}
    for name in ("rng", "environment", "topology", "timing", "stats", "provenance", "replicas", "placement"):
        _check_nesting(doc.get(name), name)
    placement = _get(doc, "placement", dict, optional=True)
    _check_nesting(extra, "unknown fields")
    manifest = Manifest(
        name=check_name(_get(doc, "name", str)),
        step=_get(doc, "step", int, optional=True),
        created_ns=check_int(_get(doc, "created_ns", int), "created_ns"),
        parent=check_name(parent) if parent is not None else None,
        chunks=chunks,
        tensors=tensors,
        state=_get(doc, "state", bytes),
        user=_get(doc, "user", bytes),
        rng=rng,
        environment=_get(doc, "environment", dict, optional=True, default={}),
        topology=_get(doc, "topology", dict, optional=True, default={}),
        timing=_get(doc, "timing", dict, optional=True, default={}),
        totals=_get(doc, "stats", dict, optional=True, default={}),
        provenance=_get(doc, "provenance", dict, optional=True),
        replicas=_get(doc, "replicas", dict, optional=True),
        placement=None if placement is None else Placement.from_record(placement, len(chunks)),
        version=version,
        requires=requires,
        extra=extra,
    )
    check_declared(features_of(doc), requires, version, "manifest")  # after the fields' own checks: theirs say more
    return manifest


def _python_ints(entry: Any) -> Any:
    """An rng entry whose Python generator state is an array of ints (before 1.13: spec 9.1)."""
    python = entry.get("python") if isinstance(entry, dict) else None
    if not isinstance(python, dict) or not isinstance(python.get("state"), bytes):
        return entry
    return {**entry, "python": {**python, "state": list(python_words(python["state"]))}}


#: The features a manifest's ``state`` bytes may use, which ``features_of`` cannot see.
_STATE_FEATURES = frozenset({"per-rank-values"})


def features_of(doc: dict) -> set[str]:
    """The required features (spec 13.2) that a manifest document's forms use: table forms, codecs, shard
    grids, placement, generator states. (Per-rank values are in ``state``'s bytes: the writer declares them.)"""
    used = set()
    chunks, tensors = doc.get("chunks"), doc.get("tensors")
    if isinstance(chunks, dict):
        used.add("chunk-columns")
        codecs = chunks.get("codecs") or []
    else:
        codecs = {row.get("codec") for row in chunks or () if isinstance(row, dict)}
    for codec in codecs:
        if isinstance(codec, str) and is_float(codec):
            used.add("float-codecs")
        if isinstance(codec, str) and is_delta(codec):
            used.add("delta-codecs")
    if isinstance(tensors, dict):
        used.add("tensor-columns")
        if tensors.get("grids") is not None:
            used.update(("grid-columns", "shard-grids"))
        rows = tensors.get("rows") or ()
    else:
        rows = tensors or ()
    if any(isinstance(row, dict) and isinstance(row.get("shards"), dict) for row in rows):
        used.add("shard-grids")
    if doc.get("placement") is not None:
        used.add("node-placement")
    if any(isinstance(entry, dict) and isinstance(entry.get("python"), dict)
           and isinstance(entry["python"].get("state"), bytes) for entry in doc.get("rng") or ()):
        used.add("rng-words")
    return used


_CONTAINERS = frozenset({dict, list})


def _check_nesting(value: Any, what: str) -> None:
    """Metadata nests at most MAX_METADATA_NESTING maps and arrays deep (every reader renders it).

    msgpack gives exact dicts and lists, so an array of numbers (an RNG state)
    is passed over by one scan of its element types in C.
    """
    stack = [(value, 0)] if type(value) in _CONTAINERS else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if type(node) is dict else node
        if depth == MAX_METADATA_NESTING:
            raise ManifestError(f"{what} nested deeper than {MAX_METADATA_NESTING} levels")
        if not _CONTAINERS.isdisjoint(map(type, children)):
            stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)


# The checks below run once per shard and per piece of a manifest that may hold
# millions: they work on whole lists with builtins (map, min, max, sum) rather
# than element by element in Python, so a hostile manifest costs what its bytes cost.

_INT = {int}
_new_piece = partial(tuple.__new__, Piece)


def _parse_dims(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS or not all_ints(value):
        raise ManifestError(f"{what} must be a list of at most {MAX_DIMS} integers in [0, 2**63-1]")
    return tuple(value)


def _parse_tensors(raw: list, sizes: _Sizes, budget: _Budget) -> list[TensorEntry]:
    """The tensor table: rows of the usual form (one shard covering the tensor, one piece; ``_usual_row``)
    checked by one short function each, every other row (and any row that fails those checks, so that
    the error names its fault) by the full parse."""
    usual = [_usual_row(doc, sizes) for doc in raw]
    count = len(usual) - usual.count(None)
    budget.take(count, count)
    others = iter(_parse_rows([(index, doc) for index, (doc, entry) in enumerate(zip(raw, usual)) if entry is None],
                              sizes, budget))
    return [entry if entry is not None else next(others) for entry in usual]


def _parse_rows(rows: list[tuple[int, Any]], sizes: _Sizes, budget: _Budget) -> list[TensorEntry]:
    """The tensor entries ``rows`` (index, map) in full, their shard grids of the usual form checked
    together first (``parse_usual_grids``)."""
    grids = _usual_grids(rows, sizes, budget)
    return [_parse_tensor(doc, index, sizes, budget, grids.get(index)) for index, doc in rows]


def _usual_grids(rows: list[tuple[int, Any]], sizes: _Sizes, budget: _Budget) -> dict[int, ShardGrid]:
    """The shard grids of the usual form among ``rows`` with a valid shape and dtype, by index, checked
    together (``parse_usual_grids``) and taken from the budget; the rest are checked row by row."""
    items, indexes = [], []
    for index, doc in rows:
        if type(doc) is not dict:
            continue
        shards, shape, dtype = doc.get("shards"), doc.get("shape"), doc.get("dtype")
        if (isinstance(shards, dict) and type(shape) is list and len(shape) <= MAX_DIMS and all_ints(shape)
                and type(dtype) is str and dtype in _ITEMSIZES
                and math.prod(shape) * _ITEMSIZES[dtype] <= MAX_TENSOR_BYTES):
            items.append((shards, tuple(shape), _ITEMSIZES[dtype]))
            indexes.append(index)
    if len(items) < 2:  # one grid is checked as quickly alone
        return {}
    room = min(budget.shards, budget.pieces)  # past it, the row-by-row parse refuses the manifest, naming why
    grids = {index: grid for index, grid in zip(indexes, parse_usual_grids(items, sizes.array, room))
             if grid is not None}
    cells = sum(map(len, grids.values()))
    budget.take(cells, cells)
    return grids


_USUAL_TENSOR = frozenset({"key", "dtype", "shape", "kind", "requires_grad", "shards", "stats"})
_USUAL_SHARD = frozenset({"offsets", "shape", "rank", "pieces"})
_USUAL_KEY_CHARS = MAX_KEY_BYTES // 4  # a key of at most this many characters is within the byte limit
_new_tensor = partial(tuple.__new__, TensorEntry)
_new_shard = partial(tuple.__new__, ShardEntry)


def _usual_row(doc: Any, sizes: _Sizes) -> TensorEntry | None:
    """A tensor row as ``ckptfmt.save`` writes most (no ``same_as``, one shard at the origin covering the
    tensor, one piece holding all its bytes), checked as ``_parse_tensor`` checks it; None for any
    other row, or one that fails a check (the full parse then names what is wrong)."""
    if type(doc) is not dict or not _USUAL_TENSOR.issuperset(doc):
        return None
    key, dtype, shape, shards = doc.get("key"), doc.get("dtype"), doc.get("shape"), doc.get("shards")
    if (type(key) is not str or not key or len(key) > _USUAL_KEY_CHARS or type(dtype) is not str
            or type(shape) is not list or len(shape) > MAX_DIMS or type(shards) is not list or len(shards) != 1
            or (shape and not set(map(type, shape)) <= _INT)):
        return None
    width = _ITEMSIZES.get(dtype)
    numel = math.prod(shape)
    if width is None or min(shape, default=0) < 0 or not 0 < numel * width <= MAX_TENSOR_BYTES:
        return None
    kind, requires_grad, shard = doc.get("kind", "tensor"), doc.get("requires_grad", False), shards[0]
    if (kind not in TENSOR_KINDS or type(requires_grad) is not bool or type(shard) is not dict
            or shard.keys() != _USUAL_SHARD):
        return None
    offsets, box, rank, pieces = shard["offsets"], shard["shape"], shard["rank"], shard["pieces"]
    if (type(box) is not list or box != shape or not set(map(type, box)) <= _INT or type(offsets) is not list
            or len(offsets) != len(shape) or any(offsets) or not set(map(type, offsets)) <= _INT
            or type(rank) is not int or not 0 <= rank <= MAX_RANK or type(pieces) is not list or len(pieces) != 1):
        return None
    piece = pieces[0]
    if type(piece) is not list or len(piece) != 3 or not set(map(type, piece)) <= _INT:
        return None
    chunk, offset, length = piece
    if length != numel * width or offset < 0 or not 0 <= chunk < len(sizes) or offset + length > sizes[chunk]:
        return None
    stats = doc.get("stats")
    if "stats" in doc and not _usual_stats(stats, numel, dtype):  # nil too: the full parse refuses it
        return None
    dims = tuple(shape)
    return _new_tensor((key, dtype, dims, (_new_shard(((0,) * len(dims), dims, rank, (_new_piece(piece),))),),
                        kind, requires_grad, None, stats))


def _usual_stats(doc: Any, numel: int, dtype: str) -> bool:
    """Whether ``stats`` holds exactly one set its dtype allows, valid (``_parse_stats``' checks), and no
    name this reader does not know (those are checked for nesting by the full parse)."""
    if type(doc) is not dict or not any(doc.keys() == fields for fields in stat_sets(dtype)):
        return False
    for name in _STAT_COUNTS:
        value = doc.get(name, 0)
        if type(value) is not int or not 0 <= value <= numel:
            return False
    return doc["count"] == numel and all(
        doc[name] is None or type(doc[name]) in _NUMBERS for name in _STAT_VALUES if name in doc)


_NUMBERS = frozenset({int, float})
_STAT_VALUES = ("min", "max", "mean", "l2", "absmax")


def _parse_tensor(doc: Any, index: int, sizes: _Sizes, budget: _Budget, grid: ShardGrid | None = None) -> TensorEntry:
    """A tensor entry (spec 6.4); ``grid``: its shard grid, already checked (``_usual_grids``)."""
    if not isinstance(doc, dict):
        raise ManifestError(f"tensor {index} is not a map")
    key = doc.get("key")
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise ManifestError(f"tensor {index} has an invalid key")
    what = f"tensor {key!r}"
    dtype = doc.get("dtype")
    if not isinstance(dtype, str):
        raise ManifestError(f"{what}: dtype is not a string")
    width = itemsize(dtype)
    shape = _parse_dims(doc.get("shape"), f"{what} shape")
    if math.prod(shape) * width > MAX_TENSOR_BYTES:
        raise ManifestError(f"{what}: shape {list(shape)} is over the size limit")
    kind = doc.get("kind", "tensor")
    if kind not in TENSOR_KINDS:
        raise ManifestError(f"{what}: unknown kind {quoted(kind)}")
    requires_grad = doc.get("requires_grad", False)
    if type(requires_grad) is not bool:
        raise ManifestError(f"{what}: requires_grad is not a bool")
    same_as = doc.get("same_as")
    if same_as is not None:
        check_int(same_as, f"{what} same_as", 0, index - 1 if index else 0)
        if index == 0:
            raise ManifestError(f"{what}: same_as must name an earlier tensor")
    raw_shards = doc.get("shards")
    shards: tuple[ShardEntry, ...] | ShardGrid
    if grid is not None:
        shards = grid
    elif type(raw_shards) is dict:
        shards = parse_grid(raw_shards, what, shape, width, sizes.array, budget)
    elif not isinstance(raw_shards, list) or not raw_shards or len(raw_shards) > MAX_SHARDS_PER_TENSOR:
        raise ManifestError(f"{what}: shards must be a shard grid or a non-empty list of at most "
                            f"{MAX_SHARDS_PER_TENSOR}")
    else:
        budget.take(len(raw_shards), 0)
        shards = tuple(_parse_shard(s, what, shape, width, sizes, budget) for s in raw_shards)
        check_tiling(what, shape, shards)
    stats = _parse_stats(doc["stats"], what, math.prod(shape), dtype) if "stats" in doc else None
    return TensorEntry(key, dtype, shape, shards, kind, requires_grad, same_as, stats)


_STAT_COUNTS = ("count", "nan", "posinf", "neginf", "zeros")


def _parse_stats(doc: Any, what: str, numel: int, dtype: str) -> dict:
    """A tensor's ``stats`` (spec 6.10): a field set its dtype allows, counts within the element
    count, the other fields numbers or nil; names a newer writer adds are kept as read."""
    if _usual_stats(doc, numel, dtype):  # one set exactly, as written: every check below passes (by set ops)
        return doc
    if type(doc) is not dict or not all(type(name) is str for name in doc):
        raise ManifestError(f"{what}: stats must be a map of names to values")
    known = frozenset(name for name in doc if name in FLOAT_FIELDS)
    if known not in stat_sets(dtype):
        raise ManifestError(f"{what}: stats fields {sorted(known)} are none of the sets spec 6.10 defines for {dtype}")
    if doc["count"] != numel:
        raise ManifestError(f"{what}: stats count {quoted(doc['count'])} differs from the {numel} elements")
    for name in known:
        value = doc[name]
        if name in _STAT_COUNTS:
            check_int(value, f"{what}: stats {name}", 0, numel)
        elif value is not None and (type(value) not in (int, float)):
            raise ManifestError(f"{what}: stats {name} must be a number or nil, found {quoted(value)}")
    _check_nesting(doc, f"{what} stats")
    return doc


def _parse_shard(doc: Any, what: str, shape: tuple, width: int, sizes: list[int], budget: _Budget) -> ShardEntry:
    if not isinstance(doc, dict):
        raise ManifestError(f"{what}: shard is not a map")
    offsets = _parse_dims(doc.get("offsets"), f"{what} shard offsets")
    box = _parse_dims(doc.get("shape"), f"{what} shard shape")
    if len(offsets) != len(shape) or len(box) != len(shape):
        raise ManifestError(f"{what}: shard rank differs from the tensor's {len(shape)} dims")
    if any(map(operator.gt, map(operator.add, offsets, box), shape)):
        raise ManifestError(f"{what}: shard at {list(offsets)} of shape {list(box)} lies outside {list(shape)}")
    rank = check_int(doc.get("rank", 0), f"{what} shard rank", 0, MAX_RANK)
    pieces = _parse_pieces(doc.get("pieces"), what, sizes, budget)
    expected = math.prod(box) * width
    total = sum(p.length for p in pieces)
    if total != expected:
        raise ManifestError(f"{what}: shard of shape {list(box)} needs {expected} bytes, pieces hold {total}")
    return ShardEntry(offsets, box, rank, pieces)


def _parse_pieces(raw: Any, what: str, sizes: list[int], budget: _Budget) -> tuple[Piece, ...]:
    """A shard's pieces: [chunk, offset, length] each, length >= 1, within the chunk's decoded bytes."""
    if type(raw) is not list:
        raise ManifestError(f"{what}: shard pieces must be a list")
    budget.take(0, len(raw))
    if not raw:
        return ()
    if len(raw) == 1:  # the usual case, checked without the list machinery below
        piece = raw[0]
        if (type(piece) is list and len(piece) == 3 and all_ints(piece) and piece[2] >= 1
                and piece[0] < len(sizes) and piece[1] + piece[2] <= sizes[piece[0]]):
            return (_new_piece(piece),)
    if set(map(type, raw)) != {list} or set(map(len, raw)) != {3}:
        raise ManifestError(f"{what}: a piece must be [chunk, offset, length]")
    flat = list(chain.from_iterable(raw))
    indexes, offsets, lengths = flat[0::3], flat[1::3], flat[2::3]
    if not all_ints(indexes, 0, len(sizes) - 1):
        raise ManifestError(f"{what}: a piece names a chunk outside the chunk table of {len(sizes)} rows")
    if not all_ints(offsets) or not all_ints(lengths, 1):
        raise ManifestError(f"{what}: piece offsets must be integers >= 0 and lengths integers >= 1")
    ends = map(operator.add, offsets, lengths)
    if any(map(operator.gt, ends, map(sizes.__getitem__, indexes))):
        index, offset, length = next(p for p in raw if p[1] + p[2] > sizes[p[0]])
        raise ManifestError(f"{what}: piece [{offset}, +{length}) runs past chunk {index} ({sizes[index]} bytes)")
    return tuple(map(_new_piece, raw))
