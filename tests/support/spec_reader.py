"""A second implementation of the format, written from spec/FORMAT.md alone (msgpack, blake3, zstandard; no
ckptfmt code): ``SpecReader`` reads a checkpoint, ``write_by_spec`` writes one by hand, ``json_image`` is the
JSON image of msgpack data (FORMAT.md section 15). The spec tests check ckptfmt against it, both ways."""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import struct
from pathlib import Path

import blake3
import msgpack
import numpy as np
import zstandard


def json_image(value):
    """msgpack-decoded Python data -> its JSON image (bin as {"$bin": base64}, ...)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return {"$float": "nan"}
        if math.isinf(value):
            return {"$float": "inf" if value > 0 else "-inf"}
        return value
    if isinstance(value, bytes):
        return {"$bin": base64.b64encode(value).decode("ascii")}
    if isinstance(value, msgpack.ExtType):
        return {"$ext": value.code, "$data": base64.b64encode(value.data).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [json_image(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: json_image(v) for k, v in value.items()}
        return {"$map": [[json_image(k), json_image(v)] for k, v in value.items()]}
    raise TypeError(f"not msgpack data: {type(value)}")


def blake3_hex(data) -> str:
    return blake3.blake3(data).hexdigest()


def unshuffle(data: bytes, width: int) -> bytes:
    """FORMAT.md 5.3: y[j*n + i] -> x[i*N + j] for the whole elements; the tail unchanged."""
    whole = len(data) - len(data) % width
    n = whole // width
    out = bytearray(len(data))
    for j in range(width):
        out[j:whole:width] = data[j * n : (j + 1) * n]
    out[whole:] = data[whole:]
    return bytes(out)


def shuffle(data: bytes, width: int) -> bytes:
    whole = len(data) - len(data) % width
    return b"".join(data[j:whole:width] for j in range(width)) + data[whole:]


_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
             "complex128": 16, "complex32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
             "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1,
             "bits2x4": 1, "bits4x2": 1}
#: FORMAT.md 5.3: the codecs and the element width N each shuffles by (1: no shuffle).
_WIDTHS = {"none": 1, "zstd": 1, "shuffle2-zstd": 2, "shuffle4-zstd": 4, "shuffle8-zstd": 8,
           "delta1-zstd": 1, "delta2-zstd": 2, "delta4-zstd": 4, "delta8-zstd": 8,
           "float2-zstd": 2, "float4-zstd": 4, "float8-zstd": 8,
           "floatdelta2-zstd": 2, "floatdelta4-zstd": 4, "floatdelta8-zstd": 8}


def is_delta(codec: str) -> bool:
    """FORMAT.md 5.5: the delta codecs (1.5's deltaN-zstd, 1.11's floatdeltaN-zstd) are stored against a base."""
    return codec.startswith(("delta", "floatdelta"))


def float_decode(stored: bytes, size: int, width: int) -> bytes:
    """FORMAT.md 5.3, the float codecs: N uint64 plane lengths, the N planes (raw where a plane's length
    is n, else one zstd frame of n bytes), the tail; planes unshuffled, each element rotated right by 1."""
    n, tail = divmod(size, width)
    lengths = [int.from_bytes(stored[8 * j : 8 * j + 8], "little") for j in range(width)]
    assert len(stored) >= 8 * width and all(length <= n for length in lengths)
    assert 8 * width + sum(lengths) + tail == len(stored), "the lengths account for every stored byte"
    planes, offset = [], 8 * width
    for length in lengths:
        piece = stored[offset : offset + length]
        offset += length
        if length < n:
            assert zstandard.frame_content_size(piece) == n, "a plane's frame declares n bytes"
            piece = zstandard.ZstdDecompressor().decompress(piece, max_output_size=n)
        assert len(piece) == n
        planes.append(piece)
    rotated = np.frombuffer(unshuffle(b"".join(planes), width), dtype=f"<u{width}")
    values = (rotated >> 1) | (rotated << (8 * width - 1))  # bits shifted out of the N bytes are dropped
    return values.astype(f"<u{width}").tobytes() + stored[offset:]

#: FORMAT.md 5.5: bases a delta chunk may be decoded through.
_MAX_DELTA_DEPTH = 16


def chunk_key(digest: str, codec: str, base_digest: str | None = None) -> str:
    """FORMAT.md 4.1: a chunk's key, relative to REPO; a delta chunk's names its base chunk's hash."""
    assert (base_digest is not None) == is_delta(codec), "a base exactly for the delta codecs"
    suffix = "" if codec == "none" else f".{codec}" if base_digest is None else f".{codec}.{base_digest}"
    return f"chunks/{digest[:2]}/{digest}{suffix}"


_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_HEX64 = re.compile("[0-9a-f]{64}")


def check_name(name) -> str:
    """FORMAT.md 4.2: a checkpoint name, before it builds any key."""
    assert isinstance(name, str) and 1 <= len(name) <= 128 and name[0].isalnum() and name.isascii()
    assert set(name) <= _NAME_CHARS and name.lower() not in ("chunks", "ckptfmt.json")
    return name


#: FORMAT.md 13.2: the required features this reader implements (all of format 2.0's).
FEATURES = frozenset({"per-rank-values", "delta-codecs", "shard-grids", "node-placement", "float-codecs",
                      "tensor-columns", "chunk-columns", "rng-words", "grid-columns"})


def _readable(doc: dict) -> bool:
    """FORMAT.md 13: major 1 (no ``requires``), or major 2 requiring only features this reader implements."""
    major = doc["version"][0]
    return major == 1 or major == 2 and len(set(doc["requires"])) == len(doc["requires"]) \
        and set(doc["requires"]) <= FEATURES


class SpecReader:
    """Reads one checkpoint as FORMAT.md section 12 describes; no ckptfmt code."""

    def __init__(self, repo: Path, name: str, *, objects: dict[str, bytes] | None = None):
        """``objects``: bytes to read in place of stored objects, by key (rebuilt ones, FORMAT.md 5.6)."""
        check_name(name)
        self.repo = repo
        self.objects = dict(objects or {})
        marker = json.loads((repo / "ckptfmt.json").read_bytes())
        assert marker["format"] == "ckptfmt-repository" and _readable(marker)
        commit = json.loads(self.stored(f"{name}/COMMIT", limit=64 * 2**10))
        assert commit["format"] == "ckptfmt-commit" and _readable(commit)
        assert commit["name"] == name
        assert _HEX64.fullmatch(commit["manifest"])
        data = self.stored(f"{name}/manifest-{commit['manifest']}.msgpack", size=commit["manifest_size"])
        assert blake3_hex(data) == commit["manifest"]
        self.manifest = unpack(data)
        assert self.manifest["format"] == "ckptfmt-manifest" and _readable(self.manifest)
        if self.manifest["version"][0] >= 2:
            assert features_used(self.manifest) <= set(self.manifest["requires"]), "a feature used, not declared"
        assert self.manifest["name"] == name
        self.chunks = chunk_rows(self.manifest["chunks"])
        self.tensors = tensor_rows(self.manifest["tensors"])
        self._decoded: dict[int, bytes] = {}
        self.chunks_read = 0

    def chunk(self, index: int, depth: int = 0) -> bytes:
        """Chunk row ``index``'s decoded, verified bytes (FORMAT.md 5.4; a delta chunk's through its base, 5.5)."""
        if index in self._decoded:
            return self._decoded[index]
        row = self.chunks[index]
        digest, codec = row["hash"], row["codec"]
        assert codec in _WIDTHS, f"unknown chunk codec {codec}"
        base = None
        if is_delta(codec):
            base = row["base"]
            assert type(base) is int and base != index and self.chunks[base]["size"] == row["size"]
            assert depth < _MAX_DELTA_DEPTH, "at most 16 bases deep"
        else:
            assert "base" not in row, "a base only for the delta codecs"
        stored = self.stored(chunk_key(digest, codec, None if base is None else self.chunks[base]["hash"]),
                             size=row["stored_size"])
        if codec == "none":
            data = stored
        elif codec.startswith("float"):
            data = float_decode(stored, row["size"], _WIDTHS[codec])
            if base is not None:
                data = xor(data, self.chunk(base, depth + 1))
        else:
            assert zstandard.frame_content_size(stored) == row["size"], "frame declares its content size"
            data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=row["size"])
            data = unshuffle(data, _WIDTHS[codec])
            if base is not None:
                data = xor(data, self.chunk(base, depth + 1))
        assert len(data) == row["size"]
        assert blake3_hex(data) == digest, f"chunk {index} is corrupt"
        self.chunks_read += 1
        self._decoded[index] = data
        return data

    def stored(self, key: str, *, size: int | None = None, limit: int | None = None) -> bytes:
        """Object ``key``'s bytes (its stand-in of ``objects`` first), its size checked before it is read:
        exactly ``size``, at most ``limit``."""
        path = self.repo / key
        found = len(self.objects[key]) if key in self.objects else path.stat().st_size
        assert size is None or found == size, "stored size checked before reading"
        assert limit is None or found <= limit
        data = self.objects[key] if key in self.objects else path.read_bytes()
        assert size is None or len(data) == size
        return data

    def tensor_bytes(self, key: str) -> tuple[dict, bytes]:
        entries = [t for t in self.tensors if t["key"] == key]
        assert len(entries) == 1, "keys are unique"
        entry = entries[0]
        if entry.get("same_as") is not None:
            entry = self.tensors[entry["same_as"]]
        shape, width = entry["shape"], _ITEMSIZE[entry["dtype"]]
        numel = math.prod(shape)
        out = bytearray(numel * width)
        covered = 0
        shards = shard_maps(entry["shards"], shape, width)
        if isinstance(entry["shards"], list):
            _check_no_overlap([s for s in shards if math.prod(s["shape"])])
        for shard in shards:
            offsets, box = shard["offsets"], shard["shape"]
            assert len(offsets) == len(box) == len(shape)
            assert all(o + n <= d for o, n, d in zip(offsets, box, shape))
            parts = []
            for chunk_index, offset, length in shard["pieces"]:
                assert offset + length <= self.chunks[chunk_index]["size"]
                parts.append(self.chunk(chunk_index)[offset : offset + length])
            data = b"".join(parts)
            assert len(data) == math.prod(box) * width
            covered += math.prod(box)
            _place(out, shape, width, offsets, box, data)
        assert covered == numel
        return entry, bytes(out)

    def value_tree(self):
        """The manifest's ``state`` decoded as msgpack, extensions left as they are (their JSON image is
        ``{"$ext", "$data"}``), once every tensor reference in it, however nested, is checked (FORMAT.md 7.2)."""
        tree = msgpack.unpackb(self.manifest["state"], raw=False, strict_map_key=False)
        _check_references(tree, len(self.tensors))
        return tree


def _check_references(value, tensors: int) -> None:
    """FORMAT.md 7.2: extension 1 holds an index below the table's length; 2, 4, 5, 6 and 13 hold trees."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, msgpack.ExtType):
            if item.code == 1:
                index = unpack(item.data)
                assert type(index) is int and 0 <= index < tensors, f"tensor reference {index} out of range"
            elif item.code in (2, 4, 5, 6, 13):
                stack.append(msgpack.unpackb(item.data, raw=False, strict_map_key=False))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())


def _check_no_overlap(shards: list[dict]) -> None:
    """FORMAT.md 6.5: no two shards of non-zero volume of a list of shards overlap."""
    for a, b in itertools.combinations(shards, 2):
        assert not all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in
                       zip(a["offsets"], a["shape"], b["offsets"], b["shape"])), "shards overlap"


def features_used(manifest: dict) -> set[str]:
    """FORMAT.md 13.2: the features a manifest's table forms and codecs use (those this reader can see)."""
    used = set()
    tensors, chunks = manifest["tensors"], manifest["chunks"]
    if isinstance(tensors, dict):
        used.add("tensor-columns")
        if "grids" in tensors:
            used |= {"grid-columns", "shard-grids"}
        rows = [row for row in tensors.get("rows", []) if row is not None]
    else:
        rows = tensors
    if any(isinstance(row.get("shards"), dict) for row in rows):
        used.add("shard-grids")
    if isinstance(chunks, dict):
        used.add("chunk-columns")
        codecs = set(chunks["codecs"])
    else:
        codecs = {row["codec"] for row in chunks}
    if any(is_delta(codec) for codec in codecs):
        used.add("delta-codecs")
    if any(codec.startswith("float") for codec in codecs):
        used.add("float-codecs")
    return used


def xor(data: bytes, base: bytes) -> bytes:
    """FORMAT.md 5.5: byte by byte."""
    assert len(data) == len(base)
    return (int.from_bytes(data, "little") ^ int.from_bytes(base, "little")).to_bytes(len(data), "little")


def shard_maps(shards, shape: list[int], width: int) -> list[dict]:
    """A tensor's shards as the maps of FORMAT.md 6.5, from either form: the list itself, or a shard
    grid's cells (FORMAT.md 6.11), each with offsets, shape, rank and pieces."""
    if isinstance(shards, list):
        return shards
    cuts = [_column(column, count + 1) for column, count in zip(shards["cuts"], shards["cells"], strict=True)]
    assert [(c[0], c[-1]) for c in cuts] == [(0, extent) for extent in shape] and len(cuts) == len(shape)
    assert all(a <= b for c in cuts for a, b in zip(c, c[1:]))
    assert ("counts" in shards) == ("length" in shards), "length present exactly when counts is"
    intervals = [list(zip(c, c[1:])) for c in cuts]
    cells = list(itertools.product(*intervals))  # C order: the last dimension varies fastest
    counts = _column(shards["counts"], len(cells)) if "counts" in shards else [
        1 if math.prod(end - start for start, end in cell) else 0 for cell in cells]
    chunk, offset = _column(shards["chunk"], sum(counts)), _column(shards["offset"], sum(counts))
    if "length" in shards:
        length = _column(shards["length"], sum(counts))
    else:
        length = [math.prod(end - start for start, end in cell) * width for cell in cells if
                  math.prod(end - start for start, end in cell)]
    ranks = _column(shards["ranks"], len(cells)) if "ranks" in shards else [0] * len(cells)
    maps, row = [], 0
    for cell, count, rank in zip(cells, counts, ranks):
        pieces = [[chunk[i], offset[i], length[i]] for i in range(row, row + count)]
        maps.append({"offsets": [start for start, _ in cell], "shape": [end - start for start, end in cell],
                     "rank": rank, "pieces": pieces})
        row += count
    return maps


#: FORMAT.md 6.12: the statistics sets by their number in the ``set`` column, and the kinds by theirs.
_SETS = {1: ("count", "min", "max", "mean", "l2", "absmax", "nan", "posinf", "neginf", "zeros"),
         2: ("count", "min", "max", "zeros"), 3: ("count",)}
_KINDS = ("tensor", "parameter", "numpy")


def chunk_rows(chunks) -> list[dict]:
    """The chunk table as the maps of FORMAT.md 6.3, from either form: the array itself, or (6.13) the
    columns, each row rebuilt as the map it stands for."""
    if isinstance(chunks, list):
        return chunks
    hashes = chunks["hash"]
    assert len(hashes) % 32 == 0
    count = len(hashes) // 32
    codec, size, stored = (_column(chunks[name], count) for name in ("codec", "size", "stored_size"))
    base = _column(chunks["base"], count) if "base" in chunks else [0] * count
    rows = []
    for i in range(count):
        row = {"hash": hashes[32 * i : 32 * (i + 1)].hex(), "codec": chunks["codecs"][codec[i]], "size": size[i],
               "stored_size": stored[i]}
        if base[i]:
            row["base"] = base[i] - 1
        rows.append(row)
    return rows


def tensor_rows(tensors) -> list[dict]:
    """The tensor table as the maps of FORMAT.md 6.4, from either form: the array itself, or (6.12) the
    columns, each entry rebuilt as the map it stands for."""
    if isinstance(tensors, list):
        return tensors
    count = len(tensors["key"])
    column = {name: _column(tensors[name], count) if name in tensors else [0] * count
              for name in ("dtype", "ndim", "kind", "requires_grad", "rank", "chunk", "offset")}
    dims = _column(tensors["dims"], sum(column["ndim"]))
    stats = tensors.get("stats")
    if stats is not None:
        sets = _column(stats["set"], count)
        floats = {name: struct.unpack(f"<{count}d", stats[name]) for name in ("min", "max", "mean", "l2", "absmax")}
        counts = {name: _column(stats[name], count) for name in ("nan", "posinf", "neginf", "zeros")}
    rows, start = [], 0
    for i in range(count):
        shape = dims[start:start + column["ndim"][i]]
        start += column["ndim"][i]
        dtype = tensors["dtypes"][column["dtype"][i]] if tensors["dtypes"] else None
        nbytes = math.prod(shape) * _ITEMSIZE[dtype] if dtype else 0
        row = {"key": tensors["key"][i], "dtype": dtype, "shape": shape, "kind": _KINDS[column["kind"][i]],
               "requires_grad": bool(column["requires_grad"][i]),
               "shards": [{"offsets": [0] * len(shape), "shape": shape, "rank": column["rank"][i],
                           "pieces": [[column["chunk"][i], column["offset"][i], nbytes]] if nbytes else []}]}
        if stats is not None and sets[i]:
            values = {"count": math.prod(shape), **{name: floats[name][i] for name in floats},
                      **{name: counts[name][i] for name in counts}}
            row["stats"] = {name: None if values[name] != values[name] else
                            int(values[name]) if sets[i] == 2 and name in ("min", "max") else values[name]
                            for name in _SETS[sets[i]]}
        rows.append(row)
    gridded = []
    for index, row in zip(_column(tensors["row_at"], len(tensors["rows"])) if "rows" in tensors else [],
                          tensors.get("rows", [])):
        if row is None:  # 1.14: its shards are the next grid of the 'grids' columns
            gridded.append(rows[index])
        else:
            rows[index] = row
    assert ("grids" in tensors) == bool(gridded)
    if gridded:
        _grids_from_columns(tensors["grids"], gridded)
    return rows


def _grids_from_columns(grids: dict, entries: list[dict]) -> None:
    """FORMAT.md 6.12 (1.14): give ``entries`` (those whose item of ``rows`` is nil, in order) their
    shards: the next grid of the ``grids`` columns each, as the map of 6.11 it stands for (its columns
    the next slices of those of ``grids``; one piece of a whole cell for each cell holding elements)."""
    cells = iter(_column(grids["cells"], sum(len(entry["shape"]) for entry in entries)))
    per_entry = [[next(cells) for _ in entry["shape"]] for entry in entries]
    counts = {"cuts": sum(count + 1 for counts in per_entry for count in counts),
              "ranks": sum(math.prod(counts) for counts in per_entry)}
    cuts = _column(grids["cuts"], counts["cuts"])
    solid, at = [], 0  # each grid's cells that hold elements: a piece each
    for entry_counts in per_entry:
        nonempty = 1
        for count in entry_counts:
            nonempty *= sum(1 for a, b in zip(cuts[at:at + count + 1], cuts[at + 1:at + count + 1]) if b > a)
            at += count + 1
        solid.append(nonempty)
    counts["chunk"] = counts["offset"] = sum(solid)
    sliced = {name: _slices(grids[name], counts[name]) for name in ("cuts", "ranks", "chunk", "offset")
              if name in grids}
    for entry, entry_counts, pieces in zip(entries, per_entry, solid):
        grid = {"cells": entry_counts, "cuts": [sliced["cuts"](count + 1) for count in entry_counts],
                "chunk": sliced["chunk"](pieces), "offset": sliced["offset"](pieces)}
        if "ranks" in sliced:
            grid["ranks"] = sliced["ranks"](math.prod(entry_counts))
        entry["shards"] = grid


def _slices(data: bytes, count: int):
    """What cuts a column of ``count`` values into bins of the next ``n`` values, one call each."""
    width = len(data) // count if count else 1
    assert len(data) == width * count and width in (1, 2, 4, 8)
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        at += n
        return data[(at - n) * width:at * width]
    return take


def _column(data: bytes, count: int) -> list[int]:
    """A grid column: ``count`` unsigned little-endian ints of one width, 1, 2, 4 or 8 bytes."""
    if count == 0:
        assert data == b""
        return []
    width, rest = divmod(len(data), count)
    assert rest == 0 and width in (1, 2, 4, 8)
    return [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]


def _place(out: bytearray, shape, width, offsets, box, data: bytes) -> None:
    """Copy a shard's C-order bytes into the global tensor's C-order buffer (FORMAT.md 6.5)."""
    if not shape:
        out[:] = data
        return
    if math.prod(box) == 0:
        return
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    row = box[-1] * width
    for i, idx in enumerate(itertools.product(*(range(n) for n in box[:-1]))):
        # element (offsets + (idx, 0)) of the global tensor; the last dimension's stride is 1
        start = (sum((offsets[k] + idx[k]) * strides[k] for k in range(len(idx))) + offsets[-1]) * width
        out[start : start + row] = data[i * row : (i + 1) * row]


def tree_hook(code: int, data: bytes):
    """Just enough of FORMAT.md section 7 for the test: tensor refs, tuples, big ints, sets."""
    if code == 1:
        return ("<tensor>", unpack(data))
    if code == 2:
        return tuple(msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=tree_hook))
    if code == 3:
        return int(data.decode("ascii"))
    return ("<ext>", code)


def store_chunk(repo: Path, data: bytes, codec: str, base: tuple[int, dict, bytes] | None = None) -> dict:
    """Store ``data`` under ``codec`` and return its chunk row; a delta codec needs its ``base``: the
    base's row number, its row and its decoded bytes (FORMAT.md 5.5)."""
    digest = blake3_hex(data)
    stored = data
    if codec != "none":
        payload = data if base is None else xor(data, base[2])
        stored = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(shuffle(payload, _WIDTHS[codec]))
    path = repo / chunk_key(digest, codec, None if base is None else base[1]["hash"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(stored)
    row = {"hash": digest, "codec": codec, "size": len(data), "stored_size": len(stored)}
    return row if base is None else {**row, "base": base[0]}


def write_by_spec(repo: Path, name: str) -> dict:
    """A 4x6 float32 tensor in two column shards, one split over two chunks; a 0-dim int64."""
    grid = np.arange(24, dtype="<f4").reshape(4, 6)
    left, right = grid[:, :2].tobytes(), grid[:, 2:].tobytes()  # each box in its own C order
    scalar = np.array(-5, dtype="<i8").tobytes()
    # chunk 0 (none): a pack: left at 0, scalar at 64, first 40 bytes of right at 128
    pack = bytearray(128 + 40)
    pack[0 : len(left)] = left
    pack[64:72] = scalar
    pack[128:168] = right[:40]
    rows = [
        store_chunk(repo, bytes(pack), "none"),
        store_chunk(repo, right[40:], "shuffle4-zstd"),
    ]
    manifest = {
        "format": "ckptfmt-manifest",
        "version": [1, 0],
        "name": name,
        "created_ns": 1_700_000_000_000_000_000,
        "chunks": rows,
        "tensors": [
            {"key": "grid", "dtype": "float32", "shape": [4, 6], "shards": [
                {"offsets": [0, 2], "shape": [4, 4], "rank": 1, "pieces": [[0, 128, 40], [1, 0, 24]]},
                {"offsets": [0, 0], "shape": [4, 2], "pieces": [[0, 0, 32]]},
            ]},
            {"key": "n", "dtype": "int64", "shape": [], "shards": [
                {"offsets": [], "shape": [], "pieces": [[0, 64, 8]]},
            ]},
            {"key": "grid_again", "dtype": "float32", "shape": [4, 6], "same_as": 0, "shards": [
                {"offsets": [0, 0], "shape": [4, 6], "pieces": [[0, 0, 32], [0, 128, 40], [1, 0, 24]]},
            ]},
        ],
        "state": msgpack.packb({
            "grid": msgpack.ExtType(1, msgpack.packb(0)),
            "n": msgpack.ExtType(1, msgpack.packb(1)),
            "again": msgpack.ExtType(1, msgpack.packb(2)),
            "t": msgpack.ExtType(2, msgpack.packb([1, 2.5])),
            7: "seven",
        }, use_bin_type=True),
        "user": msgpack.packb({}, use_bin_type=True),
        "a_field_from_a_future_minor": {"ignored": True},
    }
    data = msgpack.packb(manifest, use_bin_type=True)
    digest = blake3_hex(data)
    (repo / name).mkdir(parents=True)
    (repo / name / f"manifest-{digest}.msgpack").write_bytes(data)
    commit = {"format": "ckptfmt-commit", "version": [1, 0], "name": name, "manifest": digest,
              "manifest_size": len(data), "step": None, "created_ns": manifest["created_ns"], "parent": None}
    (repo / name / "COMMIT").write_text(json.dumps(commit))
    return {"grid": grid, "n": -5}


def unpack(data: bytes):
    """msgpack data whose maps have unique keys (FORMAT.md 6.1)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=_unique_map)


def _unique_map(pairs: list) -> dict:
    found = dict(pairs)
    assert len(found) == len(pairs), "a map has a key twice"
    return found


# -- FORMAT.md 5.6: rebuilding from parity ------------------------------------------------------------------

class NotRebuildable(Exception):
    """A stripe lost more than M of its K+M pieces (FORMAT.md 5.6): what it held cannot be rebuilt."""


#: FORMAT.md 5.6: the record's limits (a record at most as large as a manifest, 6.1; sizes up to 4 GiB).
_MAX_RECORD_BYTES = 256 * 2**20
_MAX_OBJECT_BYTES = 4 * 2**30
#: FORMAT.md 4.1: a chunk's key, its codec one of 5.3's and a base's hash exactly for the delta codecs.
_CHUNK_KEY = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})(?:\.([a-z0-9-]+)(?:\.([0-9a-f]{64}))?)?")


def parse_parity_record(data: bytes, name: str) -> dict:
    """FORMAT.md 5.6: checkpoint ``name``'s parity record, every rule of "The record" checked (a broken one
    is refused as a damaged manifest is: AssertionError)."""
    assert len(data) <= _MAX_RECORD_BYTES
    doc = unpack(data)
    assert isinstance(doc, dict) and doc["format"] == "ckptfmt-parity"
    version, requires = doc["version"], doc["requires"]
    assert type(version) is list and len(version) == 2 and all(type(v) is int for v in version)
    assert version[0] == 2 and version[1] >= 1, "records came with 2.1; a newer major is not this code"
    assert type(requires) is list and "parity" in requires and len(set(requires)) == len(requires)
    assert set(requires) <= FEATURES | {"parity"}, "a feature this reader does not know: upgrade"
    assert doc["name"] == check_name(doc["name"]) == name
    assert isinstance(doc["manifest"], str) and _HEX64.fullmatch(doc["manifest"])
    assert doc["code"] == "rs-vandermonde-gf256", "a reader refuses another code"
    k, m = doc["k"], doc["m"]
    assert type(k) is int and type(m) is int and k >= 1 and m >= 1, "K and M ints, at least 1"
    assert k + m <= 256, f"K + M = {k + m}: over 256 (GF(2^8) has 256 distinct x_r)"
    objects, sizes = doc["objects"], doc["sizes"]
    assert type(objects) is list and type(sizes) is list and len(objects) == len(sizes)
    assert len(set(objects)) == len(objects), "each object once"
    for key in objects:
        assert isinstance(key, str)
        if key != f"{name}/manifest-{doc['manifest']}.msgpack":
            found = _CHUNK_KEY.fullmatch(key)
            assert found, f"{key!r} is neither this checkpoint's manifest nor a chunk key"
            codec = found.group(3) or "none"
            assert found.group(3) != "none" and codec in _WIDTHS and (found.group(4) is not None) == is_delta(codec)
    assert all(type(size) is int and 0 <= size <= _MAX_OBJECT_BYTES for size in sizes)
    stripes = doc["stripes"]
    assert type(stripes) is list and stripes, "a non-empty array of stripes"
    covered: list[list[tuple[int, int]]] = [[] for _ in objects]
    for stripe in stripes:
        assert type(stripe) is list and len(stripe) == 3
        length, pieces, parity = stripe
        assert type(length) is int and 1 <= length <= _MAX_OBJECT_BYTES
        assert type(pieces) is list and 1 <= len(pieces) <= k
        for piece in pieces:
            assert type(piece) is list and len(piece) == 3 and all(type(v) is int for v in piece)
            obj, offset, size = piece
            assert 0 <= obj < len(objects) and offset >= 0 and 0 < size <= length
            assert offset + size <= sizes[obj], "a piece within its object"
            covered[obj].append((offset, size))
        assert type(parity) is list and len(parity) == m
        assert all(isinstance(p, str) and _HEX64.fullmatch(p) for p in parity), "M names of 64 hex digits"
    for obj, size in enumerate(sizes):  # the pieces of each object, in order of offset, tile it
        end = 0
        for offset, piece_size in sorted(covered[obj]):
            assert offset == end, f"object {obj}: its pieces overlap or leave a gap"
            end += piece_size
        assert end == size, f"object {obj}: its pieces end at {end}, not at its size"
    return doc


def parity_key(digest: str, place: int) -> str:
    """FORMAT.md 4.1 and 5.6: the key of the parity object at place ``place`` of its stripe."""
    assert _HEX64.fullmatch(digest)
    return f"_parity/{digest[:2]}/{digest}.{place}"


def record_keys(repo: Path, name: str, digest: str | None) -> list[str]:
    """The keys that may hold checkpoint ``name``'s parity record ``digest``: the record in the folder, then
    its copies outside it (those stored; FORMAT.md 5.6 numbers them 1 ... M). ``digest`` None: the commit
    record is gone, and only a copy outside the folder proves a commit: the copies of whichever record
    they hold (one, or this reader cannot tell which)."""
    copies = [p.name for p in sorted((repo / "_parity" / "records" / check_name(name)).glob("parity-*.msgpack"))]
    found = [re.fullmatch(r"parity-([0-9a-f]{64})\.([1-9][0-9]*)\.msgpack", c) for c in copies]
    if digest is None:
        digests = {f.group(1) for f in found if f}
        if not digests:
            raise FileNotFoundError(f"{name}: no commit record, no copy of a parity record outside its folder")
        assert len(digests) == 1, "copies of two records: which one the commit named is unknown"
        (digest,) = digests
        inside = []
    else:
        assert _HEX64.fullmatch(digest)
        inside = [f"{name}/parity-{digest}.msgpack"]
    return inside + [f"_parity/records/{name}/{f.group(0)}" for f in sorted(found, key=lambda f: int(f.group(2)))
                     if f and f.group(1) == digest]


def _gf_tables() -> None:
    import reedsolo
    reedsolo.init_tables(prim=0x11D)  # FORMAT.md 5.6: GF(2^8), x^8 + x^4 + x^3 + x^2 + 1, alpha = 2


def gf_invert(matrix: list[list[int]]) -> list[list[int]]:
    """The inverse of a square matrix over GF(2^8), by Gauss-Jordan elimination (reedsolo's arithmetic)."""
    import reedsolo
    n = len(matrix)
    rows = [list(row) + [int(r == c) for c in range(n)] for r, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col]), None)
        assert pivot is not None, "a singular matrix: these K rows of G are not independent"
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = reedsolo.gf_inverse(rows[col][col])
        rows[col] = [reedsolo.gf_mul(v, scale) for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col]:
                factor = rows[r][col]
                rows[r] = [a ^ reedsolo.gf_mul(factor, b) for a, b in zip(rows[r], rows[col])]
    return [row[n:] for row in rows]


def gf_matmul(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    import reedsolo
    out = []
    for row in a:
        line = []
        for c in range(len(b[0])):
            total = 0
            for t, value in enumerate(row):
                total ^= reedsolo.gf_mul(value, b[t][c])
            line.append(total)
        out.append(line)
    return out


def generator_matrix(k: int, m: int) -> list[list[int]]:
    """FORMAT.md 5.6: G = V * inverse(V_K), V[r][c] = x_r^c with x_0 = 0 (0^0 = 1), x_r = 2^(r-1)."""
    import reedsolo
    _gf_tables()

    def power(x: int, c: int) -> int:  # reedsolo's gf_pow takes 0^c as 1: the spec's 0^0 = 1, 0^c = 0
        return (1 if c == 0 else 0) if x == 0 else reedsolo.gf_pow(x, c)

    xs = [0] + [reedsolo.gf_pow(2, r - 1) for r in range(1, k + m)]
    v = [[power(x, c) for c in range(k)] for x in xs]
    g = gf_matmul(v, gf_invert(v[:k]))
    assert g[:k] == [[int(r == c) for c in range(k)] for r in range(k)], "systematic: the top K rows are I"
    return g


def combine(coefficients: list[int], pieces: list[bytes], length: int) -> bytes:
    """Byte b of the result: the sum over j of coefficients[j] * byte b of pieces[j], in GF(2^8)."""
    import reedsolo
    out = bytearray(length)
    for coefficient, piece in zip(coefficients, pieces):
        if coefficient:
            for b in range(length):
                out[b] ^= reedsolo.gf_mul(coefficient, piece[b])
    return bytes(out)


class ParityRepairer:
    """Rebuilds checkpoint ``name``'s lost or damaged objects from its parity, as FORMAT.md 5.6 says ("Rebuilding"),
    with no ckptfmt code: finds the record (through the commit record, or, where that is gone, a copy outside
    the folder), finds what is lost, solves each stripe that lost pieces from K of the others, checks every
    rebuilt object against its name. Writes nothing: ``rebuild`` returns the bytes, by key."""

    def __init__(self, repo: Path, name: str):
        self.repo, self.name = repo, check_name(name)
        commit_path = repo / name / "COMMIT"
        self.commit = json.loads(commit_path.read_bytes()) if commit_path.exists() else None
        digest = None
        if self.commit is not None:
            assert self.commit["name"] == name and self.commit.get("parity") is not None, "no parity"
            digest = self.commit["parity"]
        self.record_keys = record_keys(repo, name, digest)
        self.digest = digest or self.record_keys[0].split("parity-")[1][:64]
        self.record_bytes = None
        for key in self.record_keys:  # any one good copy serves
            data = self._read(key, limit=_MAX_RECORD_BYTES)
            if data is not None and blake3_hex(data) == self.digest:
                self.record_bytes = data
                break
        assert self.record_bytes is not None, "no copy of the parity record hashes to its name"
        self.record = parse_parity_record(self.record_bytes, name)
        if self.commit is not None:
            assert self.record["manifest"] == self.commit["manifest"], "the record of another manifest"
        self.k, self.m = self.record["k"], self.record["m"]
        self.keys, self.sizes = self.record["objects"], self.record["sizes"]
        self.manifest_key = f"{name}/manifest-{self.record['manifest']}.msgpack"
        assert self.manifest_key in self.keys, "the manifest is among the protected objects"

    def _read(self, key: str, *, size: int | None = None, limit: int | None = None) -> bytes | None:
        """Object ``key``'s bytes; None if it is missing or not of ``size`` bytes (checked before reading)."""
        path = self.repo / key
        if not path.is_file() or size is not None and path.stat().st_size != size:
            return None
        if limit is not None and path.stat().st_size > limit:
            return None
        return path.read_bytes()

    def rebuild(self) -> dict[str, bytes]:
        """Every lost or damaged object the parity covers (the manifest, chunks, parity objects, the record's
        copies, the commit record where a copy outside the folder proves the commit), rebuilt and checked.
        NotRebuildable where a stripe lost more than M pieces; AssertionError where a rebuilt object fails
        its check."""
        out: dict[str, bytes] = {}
        # What is lost: objects missing or of the wrong size; parity objects missing, not of their stripe's
        # length, or not hashing to their names; the manifest when it does not hash to its name.
        self.held = {i: self._read(key, size=size) for i, (key, size) in enumerate(zip(self.keys, self.sizes))}
        self.parity: dict[str, bytes | None] = {}
        for length, _, names in self.record["stripes"]:
            for place, digest in enumerate(names):
                data = self._read(parity_key(digest, place), size=length)
                good = data is not None and blake3_hex(data) == digest
                self.parity[parity_key(digest, place)] = data if good else None
        index = self.keys.index(self.manifest_key)
        manifest = self.held[index]
        if manifest is None or blake3_hex(manifest) != self.record["manifest"]:
            self.held[index] = None
            manifest = self._rebuild_objects([index])[index]  # the manifest first: the chunks' checks need it
            assert blake3_hex(manifest) == self.record["manifest"] and len(manifest) == self.sizes[index]
            out[self.manifest_key] = self.held[index] = manifest
        commit = self.commit
        if commit is None:  # FORMAT.md 5.6: rebuilt from the manifest, the record's hash and size of it
            doc = unpack(manifest)
            commit = {"format": "ckptfmt-commit", "version": doc["version"], "name": self.name,
                      "manifest": self.record["manifest"], "manifest_size": len(manifest), "step": doc.get("step"),
                      "created_ns": doc["created_ns"], "parent": doc.get("parent"), "stats": doc.get("stats"),
                      "parity": self.digest}
            if doc["version"][0] >= 2:
                commit["requires"] = []
            out[f"{self.name}/COMMIT"] = json.dumps(commit, indent=1).encode()
        # The chunks: each decoded and hashed (FORMAT.md 5.4) through a reader of the (rebuilt) manifest.
        reader = SpecReader(self.repo, self.name, objects=out)
        rows = {chunk_key(r["hash"], r["codec"], reader.chunks[r["base"]]["hash"] if "base" in r else None): i
                for i, r in enumerate(reader.chunks)}
        for i, key in enumerate(self.keys):
            if i != index and self.held[i] is not None and not self._chunk_ok(reader, rows, key):
                self.held[i] = None
        lost = [i for i in self.held if self.held[i] is None]
        rebuilt = self._rebuild_objects(lost)
        checker = SpecReader(self.repo, self.name, objects={**out, **{self.keys[i]: d for i, d in rebuilt.items()}})
        for i, data in rebuilt.items():
            assert self._chunk_ok(checker, rows, self.keys[i]), f"rebuilt {self.keys[i]} fails its check"
            out[self.keys[i]] = self.held[i] = data
        # Lost parity objects: their stripes' pieces are all known now; each is checked against its name.
        for length, pieces, names in self.record["stripes"]:
            for i, digest in enumerate(names):
                if self.parity[parity_key(digest, i)] is None:
                    data = self._encode(length, pieces)[i]
                    assert blake3_hex(data) == digest, f"rebuilt parity object {digest} fails its check"
                    out[parity_key(digest, i)] = self.parity[parity_key(digest, i)] = data
        # The record's M+1 copies (the checkpoint is committed, or a copy outside the folder proved it): one
        # good copy serves to restore the others.
        for key in [f"{self.name}/parity-{self.digest}.msgpack"] + [
                f"_parity/records/{self.name}/parity-{self.digest}.{i}.msgpack" for i in range(1, self.m + 1)]:
            if self._read(key) != self.record_bytes:
                out[key] = self.record_bytes
        return out

    def _chunk_ok(self, reader: SpecReader, rows: dict[str, int], key: str) -> bool:
        assert key in rows, f"{key} is not a chunk of the manifest"
        reader._decoded.pop(rows[key], None)
        try:
            reader.chunk(rows[key])
        except Exception:  # any failed check of FORMAT.md 5.4: the chunk is damaged
            return False
        return True

    def _piece(self, pieces: list, j: int, length: int) -> bytes | None:
        """Place j (< K) of a stripe: its j-th piece's bytes zero-padded to ``length``; zeros past its pieces."""
        if j >= len(pieces):
            return bytes(length)
        obj, offset, size = pieces[j]
        data = self.held[obj]
        return None if data is None else data[offset:offset + size] + bytes(length - size)

    def _encode(self, length: int, pieces: list) -> list[bytes]:
        g = generator_matrix(self.k, self.m)
        data = [self._piece(pieces, j, length) for j in range(self.k)]
        return [combine(g[self.k + i], data, length) for i in range(self.m)]

    def _rebuild_objects(self, lost: list[int]) -> dict[int, bytes]:
        """The bytes of objects ``lost`` (held as None), from the stripes that hold their pieces."""
        k, m = self.k, self.m
        g = generator_matrix(k, m)
        assembled = {i: bytearray(self.sizes[i]) for i in lost}
        for length, pieces, names in self.record["stripes"]:
            if not any(obj in assembled for obj, _, _ in pieces):
                continue
            places = [self._piece(pieces, j, length) for j in range(k)] + [
                self.parity[parity_key(d, i)] for i, d in enumerate(names)]
            known = [j for j, data in enumerate(places) if data is not None]
            if len(known) < k:
                raise NotRebuildable(f"a stripe lost {k + m - len(known)} of its pieces; K+M = {k}+{m} rebuilds {m}")
            rows = known[:k]  # any K of the others
            solve = gf_invert([g[j] for j in rows])  # the K pieces of places 0 ... K-1 from those K
            for j, (obj, offset, size) in enumerate(pieces):
                if obj in assembled:
                    coefficients = gf_matmul([g[j]], solve)[0]
                    piece = combine(coefficients, [places[r] for r in rows], length)
                    assembled[obj][offset:offset + size] = piece[:size]
        return {i: bytes(data) for i, data in assembled.items()}


def node_rounds(sizes: list[int], m: int, piece: int) -> list[tuple[int, list[int], list[tuple[int, bytes | None]]]]:
    """FORMAT.md 9.8, "Parity across nodes": every round up to the last with data, as (r, its holders by
    place, its data pieces as (node, (offset, length)) in node order), read from the text alone."""
    n = len(sizes)
    rounds, r = [], 0
    given = [0] * n  # q: the earlier rounds in which each node was not a holder
    while any(given[i] * piece < sizes[i] for i in range(n)):
        holders = [(r + j) % n for j in range(m)]
        data = []
        for i in range(n):
            if i not in holders:
                start = given[i] * piece
                data.append((i, (start, max(0, min(start + piece, sizes[i]) - start))))
                given[i] += 1
        rounds.append((r, holders, data))
        r += 1
    return rounds


def node_parity(streams: list[bytes], m: int, piece: int) -> dict[tuple[int, int], bytes]:
    """(r, j) -> holder j's parity piece of round r (rounds of length 0 have none): G[K+j] applied to the
    round's data pieces, each zero-padded to the round's length."""
    k = len(streams) - m
    g = generator_matrix(k, m)
    out = {}
    for r, _, data in node_rounds([len(s) for s in streams], m, piece):
        length = max(size for _, (_, size) in data)
        if length:
            pieces = [streams[i][start:start + size].ljust(length, b"\0") for i, (start, size) in data]
            for j in range(m):
                out[r, j] = combine(g[k + j], pieces, length)
    return out


def node_rebuild(known: dict[int, bytes], parity: dict[tuple[int, int], bytes], sizes: list[int], m: int,
                 piece: int) -> dict[int, bytes]:
    """The streams of the nodes not in ``known`` (at most M), from the known streams and the parity pieces
    of the holders still there: in each round, K known pieces by code index (data place k: k, parity
    place j: K + j), the rows of G for them inverted, the lost data pieces solved."""
    n, k = len(sizes), len(sizes) - m
    g = generator_matrix(k, m)
    lost = [i for i in range(n) if i not in known]
    rebuilt = {i: bytearray() for i in lost}
    for r, holders, data in node_rounds(sizes, m, piece):
        length = max(size for _, (_, size) in data)
        wanted = [(place, i, size) for place, (i, (_, size)) in enumerate(data) if i in rebuilt and size]
        if not wanted:
            continue
        rows, pieces = [], []
        for place, (i, (start, size)) in enumerate(data):
            if i in known:
                rows.append(place)
                pieces.append(known[i][start:start + size].ljust(length, b"\0"))
        for j, holder in enumerate(holders):
            if holder in known and (r, j) in parity:
                rows.append(k + j)
                pieces.append(parity[r, j])
        if len(rows) < k:
            raise NotRebuildable(f"round {r} keeps {len(rows)} pieces, {k} are needed")
        inverse = gf_invert([g[row] for row in rows[:k]])
        for place, i, size in wanted:
            rebuilt[i] += combine(inverse[place], pieces[:k], length)[:size]
    return {i: bytes(b) for i, b in rebuilt.items()}
