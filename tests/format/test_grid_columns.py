"""Shard grids in the tensor columns (spec 6.12, format 1.14).

A save of sharded tensors puts every grid of whole-cell pieces into the columns of
``grids`` (its item of ``rows`` nil): the entries read back exactly as the same
manifest's 1.13 form (a grid map in each row) gives them, over layouts cut by
rows, columns and blocks, with empty cells and ranks; a grid of cells cut into
several pieces stays a row; each rule of spec 6.11 broken in the columns is
refused with the tensor named; the budget of shards holds for them.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.errors import ManifestError
from ckptfmt.format import manifest as manifest_module
from ckptfmt.format.manifest import Chunk, Manifest, TensorEntry
from ckptfmt.format.shards import ShardGrid, pack_column
from ckptfmt.format.version import FORMAT_VERSION


def blocks(full: torch.Tensor, row_cuts: list[int], column_cuts: list[int], first_rank: int = 0) -> ckptfmt.Sharded:
    """``full`` cut at ``row_cuts`` x ``column_cuts``, a rank a block."""
    shards = [ckptfmt.Shard((r0, c0), full[r0:r1, c0:c1].clone(), rank=first_rank + i * 10 + j)
              for i, (r0, r1) in enumerate(zip(row_cuts, row_cuts[1:]))
              for j, (c0, c1) in enumerate(zip(column_cuts, column_cuts[1:]))]
    return ckptfmt.Sharded(tuple(full.shape), shards)


def _state() -> dict:
    torch.manual_seed(0)
    full, wide = torch.randn(12, 10), torch.randn(6, 40).to(torch.bfloat16)
    return {
        "rows": blocks(full, [0, 3, 6, 9, 12], [0, 10]),
        "blocks": blocks(full, [0, 5, 12], [0, 2, 9, 10], first_rank=100),
        "empty cells": blocks(full, [0, 6, 12, 12], [0, 10]),  # a rank left with nothing of an uneven split
        "columns": blocks(wide, [0, 6], [0, 13, 26, 40]),
        "plain": torch.arange(6.0),
        "in pieces": blocks(torch.randn(128, 1024), [0, 64, 128], [0, 1024]),  # 256 KiB cells, 100,000 B chunks
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, bytes, dict]:
    url = str(tmp_path_factory.mktemp("grids") / "repo" / "a")
    ckptfmt.save(_state(), url, chunk_size=100_000)
    with ckptfmt.open(url) as reader:
        data = reader.manifest.to_bytes()
    return url, data, msgpack.unpackb(data, raw=False, strict_map_key=False)


def _gridded(columns: dict) -> list[str]:
    at = np.frombuffer(columns["row_at"], dtype=f"<u{len(columns['row_at']) // len(columns['rows'])}")
    return [columns["key"][i] for i, row in zip(at.tolist(), columns["rows"]) if row is None]


def test_grids_go_into_the_columns_and_read_as_the_row_form_gives_them(saved):
    url, data, doc = saved
    columns = doc["tensors"]
    assert doc["version"] == list(FORMAT_VERSION)
    assert _gridded(columns) == ["rows", "blocks", "empty cells", "columns"]  # the order of row_at
    assert [row["key"] for row in columns["rows"] if row is not None] == ["in pieces"]  # counts and lengths
    manifest = Manifest.from_bytes(data, "grids")
    rows = Manifest.from_bytes(dataclasses.replace(manifest, version=(1, 13)).to_bytes(), "1.13")
    assert list(manifest.tensors) == list(rows.tensors)  # every cell: box, rank, pieces
    assert manifest.to_bytes() == data
    grids = {entry.key: entry.shards for entry in manifest.tensors if isinstance(entry.shards, ShardGrid)}
    assert grids["empty cells"].cells == (2, 1)  # the rank left with nothing is not recorded
    assert [shard.rank for shard in grids["blocks"]] == [100, 101, 102, 110, 111, 112]
    state, loaded = _state(), ckptfmt.load(url)
    for key in ("rows", "blocks", "empty cells", "columns", "in pieces"):
        full = torch.zeros(state[key].shape, dtype=state[key].shards[0].tensor.dtype)
        for shard in state[key].shards:
            full[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
        assert torch.equal(loaded[key], full), key
    with ckptfmt.open(url) as reader:
        assert torch.equal(reader.read_box("blocks", (4, 1), (3, 8)), loaded["blocks"][4:7, 1:9])
    assert ckptfmt.verify(url).ok


def test_grids_with_empty_cells_in_any_number_of_dimensions_read_back_as_written():
    """Cells of zero volume (no piece), a grid cut in three dimensions, a 0-dimensional tensor's grid of one
    cell: made by hand (a save leaves empty shards out of its grids), read back cell for cell."""
    holes = ShardGrid([np.array([0, 2, 2, 5]), np.array([0, 3, 7])], np.arange(6), np.array([0, 1, 2, 2, 2, 3, 4]),
                      np.zeros(4, dtype=np.int64), np.array([0, 24, 56, 92]), np.array([24, 32, 36, 48]))
    cube = ShardGrid([np.array([0, 2, 4]), np.array([0, 3, 6]), np.array([0, 1, 2])], np.arange(8) + 40, None,
                     np.zeros(8, dtype=np.int64), 140 + 12 * np.arange(8), np.full(8, 12))
    scalar = ShardGrid([], np.array([9]), None, np.zeros(1, dtype=np.int64), np.array([236]), np.array([8]))
    # Many pieces (their lengths an outer product, not walked per piece): rows of 1 and 3, an empty one.
    rows = np.concatenate(([0], np.cumsum([0 if i == 7 else 1 + 2 * (i % 2) for i in range(100)])))
    columns_cut = np.arange(0, 101, 2)
    solid = np.repeat(np.diff(rows) > 0, 50)
    sizes = np.outer(np.diff(rows), np.diff(columns_cut)).ravel()[solid] * 2
    large = ShardGrid([rows, columns_cut], np.arange(5000) % 7, np.concatenate(([0], np.cumsum(solid))),
                      np.ones(len(sizes), dtype=np.int64), np.cumsum(sizes) - sizes, sizes)
    # No element, yet cut in a dimension (and in two): cells but no piece, before and among the others.
    nothing = ShardGrid([np.array([0, 0]), np.array([0, 2, 4])], np.array([5, 6]), np.zeros(3, dtype=np.int64),
                        *[np.zeros(0, dtype=np.int64)] * 3)
    none_twice = ShardGrid([np.array([0, 1, 2]), np.array([0, 0]), np.array([0, 3, 5])], np.arange(4),
                           np.zeros(5, dtype=np.int64), *[np.zeros(0, dtype=np.int64)] * 3)
    tensors = [TensorEntry("holes", "float32", (5, 7), holes), TensorEntry("cube", "int16", (4, 6, 2), cube),
               TensorEntry("none twice", "int8", (2, 0, 5), none_twice),
               TensorEntry("nothing", "float32", (0, 4), nothing),
               TensorEntry("scalar", "float64", (), scalar), TensorEntry("large", "bfloat16", (197, 100), large)]
    manifest = Manifest("hand", 1, 1, None, [Chunk("ab" * 32, "none", 244, 244),
                                             Chunk("cd" * 32, "none", 39_400, 39_400)], tensors, b"\x80", b"\x80")
    data = manifest.to_bytes()
    columns = msgpack.unpackb(data, raw=False, strict_map_key=False)["tensors"]
    assert columns["rows"] == [None] * 6 and "grids" in columns
    parsed = Manifest.from_bytes(data, "hand")
    assert list(parsed.tensors) == tensors == list(Manifest.from_bytes(
        dataclasses.replace(manifest, version=(1, 13)).to_bytes(), "1.13").tensors)
    assert [len(shard.pieces) for shard in parsed.tensors[0].shards] == [1, 1, 0, 0, 1, 1]
    only = ShardGrid([np.array([0, 0]), np.array([0, 2, 4])], np.array([5, 6]), np.zeros(3, dtype=np.int64),
                     *[np.zeros(0, dtype=np.int64)] * 3)  # every grid of a table with no piece
    alone = Manifest("hand", 1, 1, None, [], [TensorEntry("nothing", "float32", (0, 4), only)], b"\x80", b"\x80")
    assert list(Manifest.from_bytes(alone.to_bytes(), "alone").tensors) == list(alone.tensors)


def test_a_grid_of_no_element_whose_other_extents_multiply_past_int64_reads_back():
    """Shape (0, 2^62, 2^62) in two cells of no volume: valid (spec 6.11), no piece; building its entry
    multiplied the other extents out (2^124) and raised OverflowError outside the parse."""
    empty = ShardGrid([np.array([0, 0, 0]), np.array([0, 2**62]), np.array([0, 2**62])], np.array([3, 4]),
                      np.zeros(3, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                      np.zeros(0, dtype=np.int64))
    manifest = Manifest("hand", 1, 1, None, [], [TensorEntry("none", "uint8", (0, 2**62, 2**62), empty)],
                        b"\x80", b"\x80")
    data = manifest.to_bytes()
    assert msgpack.unpackb(data, raw=False, strict_map_key=False)["tensors"]["rows"] == [None]
    (entry,) = Manifest.from_bytes(data, "hand").tensors
    assert [(shard.shape, shard.rank, shard.pieces) for shard in entry.shards] == \
        [((0, 2**62, 2**62), 3, ()), ((0, 2**62, 2**62), 4, ())]
    rows = dataclasses.replace(manifest, version=(1, 13)).to_bytes()  # its map of spec 6.11: read the same
    assert list(Manifest.from_bytes(rows, "1.13").tensors) == [entry]


def _refused(doc: dict, change, match: str) -> None:
    changed = msgpack.unpackb(msgpack.packb(doc, use_bin_type=True), raw=False, strict_map_key=False)
    change(changed["tensors"])
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(msgpack.packb(changed, use_bin_type=True), "hostile")


def _set(name: str, values: list[int], width: int | None = None):
    def change(columns: dict) -> None:
        array = np.array(values, dtype=np.uint64)
        columns["grids"][name] = pack_column(array) if width is None else array.astype(f"<u{width}").tobytes()
    return change


def _column_of(doc: dict, name: str) -> list[int]:
    raw = doc["tensors"]["grids"][name]
    count = {"cells": 8, "cuts": 25, "ranks": 15, "chunk": 15, "offset": 15}[name]
    return np.frombuffer(raw, dtype=f"<u{len(raw) // count}").tolist()


def test_the_saved_columns_hold_what_the_grids_say(saved):
    _, _, doc = saved  # the sizes the hostile cases below start from
    assert _column_of(doc, "cells") == [4, 1, 2, 3, 2, 1, 1, 3]
    assert _column_of(doc, "cuts")[:7] == [0, 3, 6, 9, 12, 0, 10]


@pytest.mark.parametrize("case", [
    "cuts from 1", "cuts decreasing", "cuts past the extent", "no cell", "too many cells", "rank too large",
    "chunk outside", "piece past its chunk", "a cut missing", "grids missing", "grids without a nil row",
    "a gridded entry with a chunk", "grids not a map", "counts in grids", "a cut of 2^63",
])
def test_a_broken_grid_column_is_refused_naming_the_tensor(saved, case):
    _, _, doc = saved
    cuts, cells = _column_of(doc, "cuts"), _column_of(doc, "cells")
    cases = {
        "cuts from 1": (_set("cuts", [1] + cuts[1:]), r"tensor 'rows': shard grid cuts\[0\] must run from 0"),
        "cuts decreasing": (_set("cuts", cuts[:1] + [7] + cuts[2:]), r"tensor 'rows': .*without decreasing"),
        "cuts past the extent": (_set("cuts", cuts[:6] + [11] + cuts[7:]), r"tensor 'rows': shard grid cuts\[1\]"),
        "no cell": (_set("cells", [0] + cells[1:]), r"grid column 'cells' holds values outside \[1, "),
        "too many cells": (_set("cells", [1000, 1001] + cells[2:]),
                           r"tensor 'rows': shard grid of more than 1000000 cells"),
        "rank too large": (_set("ranks", [2**31] + _column_of(doc, "ranks")[1:], 4),
                           r"grid column 'ranks' holds values outside"),
        "chunk outside": (_set("chunk", [len(doc["tensors"]["key"]) + 10**6] + _column_of(doc, "chunk")[1:]),
                          r"grid column 'chunk' holds values outside"),
        "piece past its chunk": (_set("offset", [2**31] + _column_of(doc, "offset")[1:]),
                                 r"tensor 'rows': piece \[2147483648, \+120\) runs past chunk"),
        "a cut missing": (_set("cuts", cuts[:-1]), r"grid column 'cuts' of \d+ bytes does not hold 25 integers"),
        "grids missing": (lambda columns: columns.pop("grids"), r"'grids' must be present exactly when"),
        "grids without a nil row": (_only_map_rows, r"'grids' must be present exactly when an item of 'rows' is nil"),
        "counts in grids": (lambda columns: columns["grids"].update(counts=b"\x01" * 15, length=b"\x01" * 15),
                            r"'grids' holds no 'counts' or 'length'"),
        "a cut of 2^63": (_set("cuts", [2**63] + cuts[1:], 8), r"grid column 'cuts' holds values outside"),
        "a gridded entry with a chunk": (_chunk_cell_of("blocks"), r"an entry of 'grids' must be zero in 'rank'"),
        "grids not a map": (lambda columns: columns.update(grids=[1]), r"'grids' must be a map of columns"),
    }
    change, match = cases[case]
    _refused(doc, change, match)


def _only_map_rows(columns: dict) -> None:
    """The rows that are maps alone, ``grids`` kept: its entries then read as columns of one piece each."""
    width = len(columns["row_at"]) // len(columns["rows"])
    at = np.frombuffer(columns["row_at"], dtype=f"<u{width}")
    keep = [i for i, row in enumerate(columns["rows"]) if row is not None]
    columns["rows"], columns["row_at"] = [columns["rows"][i] for i in keep], at[keep].tobytes()


def _chunk_cell_of(key: str):
    def change(columns: dict) -> None:
        index = columns["key"].index(key)
        raw = columns["chunk"]
        width = len(raw) // len(columns["key"])
        chunk = np.frombuffer(raw, dtype=f"<u{width}").copy()
        chunk[index] = 1
        columns["chunk"] = chunk.tobytes()
    return change


def test_the_grids_cells_and_pieces_count_against_the_manifest_budget(saved, monkeypatch):
    _, data, _ = saved
    monkeypatch.setattr(manifest_module, "MAX_SHARDS", 10)  # the plain tensor's 1, then the grids' 15 cells
    with pytest.raises(ManifestError, match="more than 10 shards in one manifest"):
        Manifest.from_bytes(data, "budget")
    monkeypatch.setattr(manifest_module, "MAX_SHARDS", 2**24)
    monkeypatch.setattr(manifest_module, "MAX_PIECES", 12)  # the plain tensor's 1, then the grids' 15 pieces
    with pytest.raises(ManifestError, match="more than 12 pieces in one manifest"):
        Manifest.from_bytes(data, "budget")
    monkeypatch.setattr(manifest_module, "MAX_PIECES", 16)  # the grids pass; the row's 6 pieces do not
    with pytest.raises(ManifestError, match="more than 16 pieces in one manifest"):
        Manifest.from_bytes(data, "budget")
