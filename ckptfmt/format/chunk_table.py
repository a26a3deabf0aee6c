"""The chunk table (spec 6.3): one row per stored chunk, as one map per row or (format 1.13, spec 6.13)
as columns.

A checkpoint saved by 1,024 ranks lists tens of thousands of chunks. As maps,
each row costs some 100 bytes (its hash as 64 hex characters, four field names)
and a decoded map apiece, checked key by key; in columns a row costs its 32 hash
bytes and a few bytes per size, and a reader checks the table with a handful of
numpy operations. Both forms give the same ``Chunk`` rows.
"""

from __future__ import annotations

import re
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple

from ckptfmt.errors import ManifestError
from ckptfmt.format import layout
from ckptfmt.format.codecs import CODECS, NONE, check_codec, is_delta
from ckptfmt.format.limits import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_DELTA_DEPTH, all_ints, check_hash, check_int
from ckptfmt.format.shards import column, pack_column

#: Bytes of a BLAKE3 hash: a row's cell in the ``hash`` column.
HASH_BYTES = 32


class Chunk(NamedTuple):
    """One content-addressed chunk: BLAKE3 of its decoded bytes, codec and sizes; a delta chunk's
    base is the row of the chunk it is stored against (spec 5.5, format 1.5)."""

    hash: str
    codec: str
    size: int
    stored_size: int
    base: int | None = None


def stored_key(chunks: list[Chunk] | tuple[Chunk, ...], chunk: Chunk) -> str:
    """The key ``chunk`` of table ``chunks`` is stored under (a delta's names its base's hash)."""
    return layout.chunk_key(chunk.hash, chunk.codec, None if chunk.base is None else chunks[chunk.base].hash)


def delta_depth(chunks: list[Chunk] | tuple[Chunk, ...], index: int) -> int:
    """How many bases chunk ``index`` is decoded through (0: stored whole)."""
    depth = 0
    while (base := chunks[index].base) is not None:
        depth, index = depth + 1, base
        if depth > MAX_DELTA_DEPTH:
            break
    return depth


# -- writing ----------------------------------------------------------------------------------------

def table_doc(chunks: list[Chunk], *, columns: bool) -> list[dict] | dict:
    """The chunk table as the manifest holds it: one map per row, or (``columns``) a map of columns."""
    if not columns:
        return [{"hash": c.hash, "codec": c.codec, "size": c.size, "stored_size": c.stored_size,
                 **({} if c.base is None else {"base": c.base})} for c in chunks]
    import numpy as np

    codecs: dict[str, int] = {}
    numbers = [codecs.setdefault(c.codec, len(codecs)) for c in chunks]
    doc: dict[str, Any] = {
        "hash": bytes.fromhex("".join(c.hash for c in chunks)), "codecs": list(codecs),
        "codec": pack_column(np.array(numbers, dtype=np.int64)),
        "size": pack_column(np.array([c.size for c in chunks], dtype=np.int64)),
        "stored_size": pack_column(np.array([c.stored_size for c in chunks], dtype=np.int64)),
    }
    if any(c.base is not None for c in chunks):
        doc["base"] = pack_column(np.array([0 if c.base is None else c.base + 1 for c in chunks], dtype=np.int64))
    return doc


# -- reading ----------------------------------------------------------------------------------------

def parse_table(raw: Any) -> list[Chunk]:
    """The chunk table ``raw`` of either form, every rule of spec 6.3 (and 6.13) checked."""
    if type(raw) is dict:
        return _parse_columns(raw)
    if type(raw) is not list:
        raise ManifestError("chunks must be an array of rows or a map of columns")
    if len(raw) > MAX_CHUNKS:
        raise ManifestError("too many chunks or tensors")
    chunks = _plain_rows(raw)
    if chunks is None:  # delta rows, or something wrong: row by row, each problem named
        chunks = [_parse_row(c, i) for i, c in enumerate(raw)]
        _check_rows(chunks)
    return chunks


def _parse_columns(doc: dict) -> list[Chunk]:
    """Spec 6.13's columns, checked whole (codecs, ranges, ``none`` sizes, bases), then the rules every
    table keeps (one row per stored object, one size per hash, bases) as for rows."""
    import numpy as np

    hashes = doc.get("hash")
    if type(hashes) is not bytes or len(hashes) % HASH_BYTES:
        raise ManifestError(f"chunk columns: 'hash' must be a bin of {HASH_BYTES} bytes a row")
    count = len(hashes) // HASH_BYTES
    if count > MAX_CHUNKS:
        raise ManifestError("too many chunks or tensors")
    names = doc.get("codecs")
    if type(names) is not list or len(set(map(type, names)) - {str}) or len(set(names)) != len(names):
        raise ManifestError("chunk columns: 'codecs' must be an array of distinct strings")
    for name in names:
        check_codec(name)
    col = partial(column, count=count, what="chunk columns", table="chunk")
    codec = col(doc.get("codec"), "codec", high=max(len(names) - 1, 0))
    if count and not names:
        raise ManifestError("chunk columns: 'codecs' is empty")
    size = col(doc.get("size"), "size", high=MAX_CHUNK_BYTES).astype(np.int64)
    stored = col(doc.get("stored_size"), "stored_size", high=MAX_CHUNK_BYTES).astype(np.int64)
    base = col(doc["base"], "base", high=count).astype(np.int64) if "base" in doc else np.zeros(count, np.int64)
    uncompressed = np.array([name == NONE for name in names] or [False])[codec]
    wrong = np.flatnonzero(uncompressed & (stored != size))
    if len(wrong):
        row = int(wrong[0])
        raise ManifestError(f"chunk {row}: uncompressed but stored_size {stored[row]} differs from size {size[row]}")
    delta = np.array([is_delta(name) for name in names] or [False])[codec]
    wrong = np.flatnonzero(delta != (base > 0))
    if len(wrong):
        row = int(wrong[0])
        name = names[codec[row]]
        raise ManifestError(f"chunk {row}: a {name} chunk has no base" if not delta[row] else
                            f"chunk {row}: a {name} chunk needs a base")
    text = hashes.hex()
    chunks = list(map(_new_chunk, zip([text[i:i + 2 * HASH_BYTES] for i in range(0, len(text), 2 * HASH_BYTES)],
                                      map(names.__getitem__, codec.tolist()), size.tolist(), stored.tolist(),
                                      [None if b == 0 else b - 1 for b in base.tolist()] if delta.any()
                                      else repeat(None))))
    if delta.any() or not _distinct(chunks):
        _check_rows(chunks)
    return chunks


_HEX = re.compile(r"[0-9a-f]*")
_new_chunk = partial(tuple.__new__, Chunk)
_PLAIN_FIELDS = frozenset({"hash", "codec", "size", "stored_size"})


def _plain_rows(raw: list) -> list[Chunk] | None:
    """A table of valid rows without deltas, checked a column at a time (a many-rank save has tens of
    thousands of rows); None for anything else, which the row-by-row parse then names."""
    if not set(map(type, raw)) <= {dict} or not all(map(_PLAIN_FIELDS.issuperset, raw)):
        return None
    hashes, codecs = [row.get("hash") for row in raw], [row.get("codec") for row in raw]
    sizes, stored = [row.get("size") for row in raw], [row.get("stored_size") for row in raw]
    if not (set(map(type, hashes)) <= {str} and set(map(len, hashes)) <= {64} and _HEX.fullmatch("".join(hashes))
            and set(map(type, codecs)) <= {str} and set(codecs) <= CODECS and not any(map(is_delta, set(codecs)))
            and all_ints(sizes, 0, MAX_CHUNK_BYTES) and all_ints(stored, 0, MAX_CHUNK_BYTES)):
        return None
    if NONE in codecs and any(c == NONE and a != b for c, a, b in zip(codecs, sizes, stored)):
        return None
    chunks = list(map(_new_chunk, zip(hashes, codecs, sizes, stored, repeat(None))))
    return chunks if _distinct(chunks) else None


def _distinct(chunks: list[Chunk]) -> bool:
    """Whether rows without bases list each (hash, codec) once and give each hash one size."""
    hashes = {c.hash for c in chunks}
    return len(hashes) == len(chunks) or (len({(c.hash, c.codec) for c in chunks}) == len(chunks)
                                          and len({(c.hash, c.size) for c in chunks}) == len(hashes))


def _parse_row(doc: Any, index: int) -> Chunk:
    if not isinstance(doc, dict):
        raise ManifestError(f"chunk {index} is not a map")
    size = check_int(doc.get("size"), f"chunk {index} size", 0, MAX_CHUNK_BYTES)
    stored = check_int(doc.get("stored_size"), f"chunk {index} stored_size", 0, MAX_CHUNK_BYTES)
    codec = check_codec(doc.get("codec"))
    if codec == NONE and stored != size:
        raise ManifestError(f"chunk {index}: uncompressed but stored_size {stored} differs from size {size}")
    base = None
    if is_delta(codec):
        base = check_int(doc.get("base"), f"chunk {index} base", 0, MAX_CHUNKS)
    elif doc.get("base") is not None:
        raise ManifestError(f"chunk {index}: a {codec} chunk has no base")
    return Chunk(check_hash(doc.get("hash")), codec, size, stored, base)


def _check_rows(chunks: list[Chunk]) -> None:
    """One row per stored key, rows of one hash agree on its decoded size (they are the same bytes), and
    every delta's base is another row of that size, at most MAX_DELTA_DEPTH bases deep (no cycle)."""
    for index, chunk in enumerate(chunks):
        if chunk.base is None:
            continue
        if chunk.base >= len(chunks) or chunk.base == index:
            raise ManifestError(f"chunk {index}: base {chunk.base} is not another row of the table")
        if chunks[chunk.base].size != chunk.size:
            raise ManifestError(f"chunk {index}: {chunk.size} bytes, its base chunk {chunk.base} has "
                                f"{chunks[chunk.base].size}")
        if delta_depth(chunks, index) > MAX_DELTA_DEPTH:
            raise ManifestError(f"chunk {index}: more than {MAX_DELTA_DEPTH} bases deep, or bases in a cycle")
    if len({stored_key(chunks, c) for c in chunks}) != len(chunks):
        raise ManifestError("the chunk table lists a chunk twice")
    sizes: dict[str, int] = {}
    for chunk in chunks:
        if sizes.setdefault(chunk.hash, chunk.size) != chunk.size:
            raise ManifestError(f"chunk {chunk.hash[:16]}...: rows of one hash but sizes differ")
