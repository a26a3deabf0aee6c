"""A manifest's msgpack, decoded: at once when small, field by field and tensor by tensor when large.

msgpack decodes a 256 MiB manifest in seconds whatever it holds, so a limit that
the parse checks afterwards cannot bound the time a hostile one costs: 2,000
tensors of 256 shard maps in 64 dimensions (85 MiB) took 5.4 s to decode and
14.5 s to refuse. A large manifest's tensor table is therefore decoded one entry
at a time, counting the dimensions of its shard maps against
``MAX_SHARD_MAP_DIMS`` (spec 14) as it goes: such a manifest is refused an
eighth of the way in. A manifest under ``STREAM_FROM`` cannot exceed that
budget (each dimension takes at least two bytes), and is decoded in one call.
``skip`` passes over top-level fields the caller does not need (analytics: RNG states).
"""

from __future__ import annotations

from typing import Any

import msgpack

from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.limits import MAX_SHARD_MAP_DIMS
from ckptfmt.format.maps import unique_map

#: Manifests of at least this many bytes are decoded a field and a tensor at a time (2 bytes a dimension).
STREAM_FROM = 2 * MAX_SHARD_MAP_DIMS
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def unpack_manifest(data: bytes, skip: frozenset[str] = frozenset()) -> dict:
    """The manifest's top-level map (without the ``skip`` fields' values), every map's keys unique."""
    if not skip and len(data) < STREAM_FROM:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=unique_map)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, object_pairs_hook=unique_map,
                                max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    if data[:1] and data[0] not in _MAP_HEADS:
        raise ManifestError("manifest is not a map")
    budget = _Budget()
    doc = _map(unpacker, lambda key: _skipped(unpacker) if key in skip else (
        _tensor_table(unpacker, data, budget) if key == "tensors" else unpacker.unpack()))
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return doc
    raise ManifestError("extra data after the manifest")


class _Budget:
    """Shard-map dimensions left for the rest of the manifest."""

    def __init__(self) -> None:
        self.left = MAX_SHARD_MAP_DIMS

    def take(self, entry: Any) -> Any:
        """Count ``entry``'s shard maps' dimensions (a row of spec 6.4 as decoded; anything else is the
        parse's to refuse) and give it back."""
        shards = entry.get("shards") if type(entry) is dict else None
        if type(shards) is list:
            self.left -= sum(len(shard["offsets"]) for shard in shards
                             if type(shard) is dict and type(shard.get("offsets")) is list)
            if self.left < 0:
                raise ManifestError(f"shard maps of more than {MAX_SHARD_MAP_DIMS} dimensions in all, after "
                                    f"tensor {quoted(entry.get('key'))} (a layout of that many shards is a shard "
                                    "grid, spec 6.11)")
        return entry


_SKIPPED = object()


def _skipped(unpacker: msgpack.Unpacker) -> object:
    unpacker.skip()
    return _SKIPPED


def _map(unpacker: msgpack.Unpacker, value_of) -> dict:
    """A map read entry by entry, ``value_of(key)`` reading each value (a skipped one is left out)."""
    doc: dict = {}
    seen = set()
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key in seen:
            raise ManifestError(f"map has the key {quoted(key)} twice")
        seen.add(key)
        value = value_of(key)
        if value is not _SKIPPED:
            doc[key] = value
    return doc


def _tensor_table(unpacker: msgpack.Unpacker, data: bytes, budget: _Budget) -> Any:
    """The tensor table: its entries one at a time (an array), or its columns with ``rows`` so (a map)."""
    if data[unpacker.tell()] in _MAP_HEADS:
        return _map(unpacker, lambda key: _entries(unpacker, data, budget) if key == "rows" else unpacker.unpack())
    return _entries(unpacker, data, budget)


def _entries(unpacker: msgpack.Unpacker, data: bytes, budget: _Budget) -> Any:
    """An array of tensor entries decoded one at a time, each counted; any other value whole."""
    if data[unpacker.tell()] not in _ARRAY_HEADS:
        return unpacker.unpack()
    return [budget.take(unpacker.unpack()) for _ in range(unpacker.read_array_header())]
