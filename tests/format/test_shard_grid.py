"""Shard grids (spec 6.11, format 1.6): a tensor's shards as the cells of a grid in packed columns.

Grid layouts round-trip through a real save (rows, columns, blocks, an empty
cell, cells cut into several pieces) and read back whole or box by box; layouts
that are not grids keep one map per shard; hostile grids are refused with the
tensor and the rule named, before anything is allocated; a parsed grid holds
columns, not an object per shard, and a box read builds only the shards it
overlaps.
"""

from __future__ import annotations

import dataclasses
import math
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import ManifestError
from ckptfmt.format import manifest as manifest_module
from ckptfmt.format import shards as shards_module
from ckptfmt.format.manifest import MANIFEST_FORMAT, Chunk, Manifest, TensorEntry
from ckptfmt.format.shards import Piece, ShardEntry, ShardGrid
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import rewrite_manifest
from tests.support.spec_reader import tensor_rows


def blocks(full: torch.Tensor, row_cuts: list[int], column_cuts: list[int]) -> ckptfmt.Sharded:
    """``full`` cut at ``row_cuts`` x ``column_cuts``, each block owned by a rank of its own, in shuffled order."""
    shards = []
    for i, (r0, r1) in enumerate(zip(row_cuts, row_cuts[1:])):
        for j, (c0, c1) in enumerate(zip(column_cuts, column_cuts[1:])):
            shards.append(ckptfmt.Shard((r0, c0), full[r0:r1, c0:c1].clone(), rank=100 + i * 10 + j))
    order = np.random.default_rng(3).permutation(len(shards))
    return ckptfmt.Sharded(tuple(full.shape), [shards[k] for k in order])


def raw_entry(repo, name: str, key: str) -> dict:
    """The tensor's entry as a map, its grid as the map of spec 6.11: the manifest written as 1.13 (1.14
    puts a grid of whole-cell pieces in the tensor columns: ``test_grid_columns.py``)."""
    with ckptfmt.open(f"{repo}/{name}") as checkpoint:
        data = dataclasses.replace(checkpoint.manifest, version=(1, 13)).to_bytes()
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return next(t for t in tensor_rows(doc["tensors"]) if t["key"] == key)


LAYOUTS = {
    "rows": ([0, 3, 6, 9, 12], [0, 10]),
    "columns": ([0, 12], [0, 4, 7, 10]),
    "blocks": ([0, 5, 12], [0, 2, 9, 10]),
    "empty last cell": ([0, 6, 12, 12], [0, 10]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grid_layouts_round_trip_and_read_box_by_box(tmp_path, layout):
    rows, columns = LAYOUTS[layout]
    full = torch.arange(120, dtype=torch.float32).reshape(12, 10)
    ckptfmt.save({"w": blocks(full, rows, columns)}, f"{tmp_path}/repo/a")
    entry = raw_entry(tmp_path / "repo", "a", "w")
    rows = list(dict.fromkeys(rows))  # the empty last row of cells holds nothing: left out
    assert entry["shards"]["cells"] == [len(rows) - 1, len(columns) - 1]
    assert [list(column) for column in entry["shards"]["cuts"]] == [rows, columns]  # one byte each
    assert set(entry["shards"]) == {"cells", "cuts", "ranks", "chunk", "offset"}  # a piece a cell: no counts, lengths

    assert torch.equal(ckptfmt.load(f"{tmp_path}/repo/a")["w"], full)
    with ckptfmt.open(f"{tmp_path}/repo/a") as checkpoint:
        shards = checkpoint.tensor_info("w").shards
        assert isinstance(shards, ShardGrid) and len(shards) == (len(rows) - 1) * (len(columns) - 1)
        cells = [(r0, c0, r1 - r0, c1 - c0) for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(columns, columns[1:])]
        assert [(*s.offsets, *s.shape) for s in shards] == cells  # C order over the grid
        assert [s.rank for s in shards] == [100 + i * 10 + j for i in range(len(rows) - 1)
                                            for j in range(len(columns) - 1)]
        for offsets, shape in [((0, 0), (12, 10)), ((4, 3), (5, 6)), ((11, 9), (1, 1)), ((2, 0), (0, 10))]:
            box = checkpoint.read_box("w", offsets, shape)
            assert torch.equal(box, full[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]])


def test_cells_cut_into_several_pieces_carry_counts_and_lengths(tmp_path):
    full = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 4 shards of 256 KiB
    ckptfmt.save({"w": blocks(full, [0, 64, 128, 192, 256], [0, 1024])}, f"{tmp_path}/repo/a", chunk_size=100_000)
    grid = raw_entry(tmp_path / "repo", "a", "w")["shards"]
    counts = np.frombuffer(grid["counts"], dtype=f"<u{len(grid['counts']) // 4}")
    assert counts.tolist() == [3, 3, 3, 3]  # 262,144 bytes in chunks of 100,000
    assert torch.equal(ckptfmt.load(f"{tmp_path}/repo/a")["w"], full)
    with ckptfmt.open(f"{tmp_path}/repo/a") as checkpoint:
        assert torch.equal(checkpoint.read_box("w", (10, 500), (100, 524)), full[10:110, 500:])
    assert ckptfmt.verify(f"{tmp_path}/repo/a").ok


def test_layouts_that_are_not_grids_keep_one_map_per_shard(tmp_path):
    full = torch.arange(16.0).reshape(4, 4)
    bricks = ckptfmt.Sharded((4, 4), [ckptfmt.Shard((0, 0), full[:2, :3].clone()), ckptfmt.Shard((0, 3), full[:2, 3:]),
                                      ckptfmt.Shard((2, 0), full[2:, :1].clone()), ckptfmt.Shard((2, 1), full[2:, 1:])])
    one_and_empties = ckptfmt.Sharded((4,), [ckptfmt.Shard((0,), full[0]), ckptfmt.Shard((4,), full[0, :0], rank=1),
                                             ckptfmt.Shard((4,), full[0, :0], rank=2)])
    one = ckptfmt.Sharded((4,), [ckptfmt.Shard((0,), full[1], rank=7)])
    ckptfmt.save({"bricks": bricks, "empty": one_and_empties, "one": one}, f"{tmp_path}/repo/a")
    for key in ("bricks", "empty", "one"):
        assert isinstance(raw_entry(tmp_path / "repo", "a", key)["shards"], list), key
    loaded = ckptfmt.load(f"{tmp_path}/repo/a")
    assert torch.equal(loaded["bricks"], full) and torch.equal(loaded["empty"], full[0])


def test_an_uneven_split_is_a_grid_of_the_ranks_that_hold_elements(tmp_path):
    """11 rows on 4 ranks, as DTensor and FSDP split them (3, 3, 3, 2), and 5 rows on 4 (2, 2, 1, 0)."""
    full = torch.arange(44.0).reshape(11, 4)
    ragged = ckptfmt.Sharded((11, 4), [ckptfmt.Shard((3 * r, 0), full[3 * r:3 * r + 3], rank=r) for r in range(4)])
    short = ckptfmt.Sharded((5, 4), [ckptfmt.Shard((min(2 * r, 5), 0), full[2 * r:min(2 * r + 2, 5)], rank=r)
                                     for r in range(4)])
    ckptfmt.save({"ragged": ragged, "short": short}, f"{tmp_path}/repo/a")
    assert raw_entry(tmp_path / "repo", "a", "ragged")["shards"]["cells"] == [4, 1]
    assert raw_entry(tmp_path / "repo", "a", "short")["shards"]["cells"] == [3, 1]  # rank 3 held nothing
    with ckptfmt.open(f"{tmp_path}/repo/a") as checkpoint:
        assert [s.rank for s in checkpoint.tensor_info("short").shards] == [0, 1, 2]
        assert torch.equal(checkpoint.get_tensor("ragged"), full) and torch.equal(checkpoint.get_tensor("short"),
                                                                                    full[:5])


# -- hostile grids -----------------------------------------------------------------

HASH = "ab" * 32


def grid_manifest(grid: dict, shape=(8, 6), chunks: int = 4, size: int = 48, before: int = 0) -> bytes:
    """A manifest whose tensor 'w' has ``grid``, after ``before`` tensors of the spec's example grid."""
    return msgpack.packb({
        "format": MANIFEST_FORMAT, "version": [1, 15], "name": "m", "step": 1, "created_ns": 1,
        "parent": None, "chunks": [{"hash": f"{i:064x}", "codec": "none", "size": size, "stored_size": size}
                                   for i in range(chunks)],
        "tensors": [*({"key": f"good{i}", "dtype": "float32", "shape": [8, 6], "shards": GOOD} for i in range(before)),
                    {"key": "w", "dtype": "float32", "shape": list(shape), "shards": grid}],
        "state": b"\x80", "user": b"\x80",
    }, use_bin_type=True)


#: The spec's example (6.11): a float32 [8, 6] tensor on 4 ranks, two rows each, each in a chunk of its own.
GOOD = {"cells": [4, 1], "cuts": [bytes([0, 2, 4, 6, 8]), bytes([0, 6])], "ranks": bytes([0, 1, 2, 3]),
        "chunk": bytes([0, 1, 2, 3]), "offset": bytes(4)}
#: A float32 [6, 6] tensor whose cell 1 is two pieces, cell 2 empty.
PIECES = {"cuts": [bytes([0, 2, 4, 4, 6]), bytes([0, 6])], "counts": bytes([1, 2, 0, 1]), "chunk": bytes([0, 1, 1, 3]),
          "offset": bytes([0, 0, 24, 0]), "length": bytes([48, 24, 24, 48])}

HOSTILE = {
    "cells for another rank": ({**GOOD, "cells": [4]}, "cells must be 2 integers >= 1"),
    "a dimension of no cell": ({**GOOD, "cells": [4, 0]}, "cells must be 2 integers >= 1"),
    "cells that are floats": ({**GOOD, "cells": [4.0, 1]}, "cells must be 2 integers >= 1"),
    "cuts for another rank": ({**GOOD, "cuts": [bytes([0, 2, 4, 6, 8])]}, "cuts must be a list of 2 bins"),
    "cuts not from 0": ({**GOOD, "cuts": [bytes([1, 2, 4, 6, 8]), bytes([0, 6])]},
                        r"cuts\[0\] must run from 0 to the extent 8 without decreasing"),
    "cuts short of the extent": ({**GOOD, "cuts": [bytes([0, 2, 4, 6, 7]), bytes([0, 6])]}, "to the extent 8"),
    "cuts past the extent": ({**GOOD, "cuts": [bytes([0, 2, 4, 9, 8]), bytes([0, 6])]}, "'cuts.0.' holds values"),
    "cuts decreasing": ({**GOOD, "cuts": [bytes([0, 5, 4, 6, 8]), bytes([0, 6])]}, "without decreasing"),
    # Its cells' bytes, 24 a row, wrap around 2**64 to 48 each: what a product must never be trusted for.
    "a cut past the extent by 2**62": ({**GOOD, "cuts": [np.array([0, 2, 2**62 + 4, 6, 8], "<u8").tobytes(),
                                                         bytes([0, 6])]}, "'cuts.0.' holds values outside"),
    "cuts as a list": ({**GOOD, "cuts": [[0, 2, 4, 6, 8], bytes([0, 6])]}, r"'cuts\[0\]' must be a bin"),
    "cuts for other cells": ({**GOOD, "cuts": [bytes([0, 2, 8]), bytes([0, 6])]}, "'cuts.0.' of 3 bytes does not"),
    "a column of 3-byte ints": ({**GOOD, "offset": bytes(12)}, "does not hold 4 integers of 1, 2, 4 or 8"),
    "a column too short": ({**GOOD, "chunk": bytes(3)}, "'chunk' of 3 bytes does not hold 4"),
    "a column that is a list": ({**GOOD, "chunk": [0, 1, 2, 3]}, "'chunk' must be a bin"),
    "a rank over 2**31-1": ({**GOOD, "ranks": np.array([0, 1, 2, 2**31], "<u4").tobytes()}, "'ranks' holds values"),
    "a chunk row outside the table": ({**GOOD, "chunk": bytes([0, 1, 2, 4])}, "'chunk' holds values outside"),
    "a piece past its chunk": ({**GOOD, "offset": bytes([0, 0, 1, 0])}, r"piece \[1, \+48\) runs past chunk 2"),
    "an offset over 4 GiB": ({**GOOD, "offset": np.array([0, 0, 2**40, 0], "<u8").tobytes()}, "'offset' holds"),
    "lengths without counts": ({**GOOD, "length": bytes([48] * 4)}, "has lengths but no counts"),
    "counts without lengths": ({**GOOD, "counts": bytes([1] * 4)}, "'length' must be a bin"),
    "pieces short of their cell": ({**GOOD, **PIECES, "length": bytes(
        [48, 24, 23, 48])}, "cell 1 needs 48 bytes, its pieces hold 47"),
    "a piece of length 0": ({**GOOD, **PIECES, "counts": bytes([1, 3, 0, 1]),
                             "chunk": bytes([0, 1, 1, 1, 3]), "offset": bytes(5),
                             "length": bytes([48, 24, 24, 0, 48])}, "'length' holds values outside"),
    "a column for the wrong count of cells": ({**GOOD, "cells": [3, 1], "cuts": [bytes([0, 3, 6, 8]), bytes([0, 6])]},
                                              "'ranks' of 4 bytes does not hold 3"),
    "a million cells and one": ({**GOOD, "cells": [1001, 1000]}, "grid of 1001000 cells is over the 1000000 limit"),
    "counts claiming 2**40 pieces": ({**GOOD, **PIECES, "counts": np.array([1, 2**40, 0, 1], "<u8").tobytes()},
                                     "'counts' holds"),
}


def shape_of(grid: dict) -> tuple[int, int]:
    """The shape the case's cuts were made for."""
    return (6, 6) if grid["cuts"][0] == PIECES["cuts"][0] else (8, 6)


def test_the_spec_examples_grid_and_a_grid_of_many_pieces_are_valid():
    manifest = Manifest.from_bytes(grid_manifest(GOOD), "m")
    assert [s.rank for s in manifest.tensors[0].shards] == [0, 1, 2, 3]
    pieced = Manifest.from_bytes(grid_manifest({**GOOD, **PIECES}, shape=(6, 6)), "m")
    assert [s.pieces for s in pieced.tensors[0].shards] == [
        (Piece(0, 0, 48),), (Piece(1, 0, 24), Piece(1, 24, 24)), (), (Piece(3, 0, 48),)]


@pytest.mark.parametrize("before", [0, 2], ids=["alone", "after-two-grids"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_grids_are_refused_naming_the_tensor_and_the_rule(case, before):
    """Alone, or among other grids (which are checked together, every grid at once: the fault must still
    be named as a grid checked alone names it)."""
    grid, message = HOSTILE[case]
    with pytest.raises(ManifestError, match=message) as caught:
        Manifest.from_bytes(grid_manifest(grid, shape=shape_of(grid), before=before), "m")
    assert str(caught.value).startswith("m: tensor 'w': ")


def many_grids() -> tuple[list[tuple[dict, tuple[int, ...], int]], np.ndarray]:
    """Grids of every usual shape as a writer packs them (``grid_to_dict``), with their tensors' shapes and
    widths, and the chunk sizes they lie in: uneven cuts, a 3-D tensor cut in its middle dimension, one
    cut nowhere, ranks past 65,535, chunk rows past 255, offsets past 4 GiB, and several widths."""
    rng = np.random.default_rng(5)
    chunk_sizes = np.full(300, 2**33, dtype=np.int64)
    items = []
    for case in range(40):
        dims = [(64, 6), (10, 7, 3), (33,)][case % 3]
        cut = 1 if len(dims) == 3 else 0
        cells = [1, 2, 5, 64][case % 4] if case % 7 else 1
        inner = sorted(rng.choice(np.arange(1, dims[cut]), size=min(cells, dims[cut]) - 1, replace=False).tolist())
        cuts = [np.array([0, extent], dtype=np.int64) for extent in dims]
        cuts[cut] = np.array([0, *inner, dims[cut]], dtype=np.int64)
        count = len(cuts[cut]) - 1
        width = [2, 4, 8][case % 3]
        length = np.diff(cuts[cut]) * (math.prod(dims) // dims[cut]) * width
        ranks = rng.integers(0, 2**17 if case % 5 == 0 else 200, size=count)
        offset = rng.integers(0, 2**32 + 10 if case % 6 == 0 else 1000, size=count)
        grid = ShardGrid(cuts, ranks, None, rng.integers(0, 300, size=count), offset, length)
        items.append((shards_module.grid_to_dict(grid, width), dims, width))
    return items, chunk_sizes


class NoBudget:
    def take(self, shards: int, pieces: int) -> None:
        pass


def test_usual_grids_checked_together_are_what_each_checked_alone_is():
    items, chunk_sizes = many_grids()
    items.insert(3, ({**GOOD, **PIECES}, (6, 6), 4))  # a grid of several pieces a cell: not of the usual form
    together = shards_module.parse_usual_grids(items, chunk_sizes)
    alone = [shards_module.parse_grid(doc, "t", shape, width, chunk_sizes, NoBudget()) for doc, shape, width in items]
    assert together[3] is None and len(together) == len(alone)
    for mine, theirs in zip(together[:3] + together[4:], alone[:3] + alone[4:]):
        assert mine is not None
        assert mine.cells == theirs.cells and all(np.array_equal(a, b) for a, b in zip(mine.cuts, theirs.cuts))
        for column in ("ranks", "starts", "chunk", "offset", "length"):
            assert np.array_equal(getattr(mine, column), getattr(theirs, column)), column
            assert getattr(mine, column).dtype.kind == getattr(theirs, column).dtype.kind, column
        assert list(mine) == list(theirs)


@pytest.mark.parametrize("fault", ["a piece past its chunk", "a grid of lengths", "cuts short", "a chunk row outside"])
def test_one_grid_not_of_the_usual_form_leaves_every_grid_to_be_checked_alone(fault):
    items, chunk_sizes = many_grids()
    doc, shape, width = items[17]
    if fault == "a piece past its chunk":
        doc = {**doc, "offset": np.full(doc["cells"][0], 2**33 - 1, dtype="<u8").tobytes()}
    elif fault == "a grid of lengths":
        doc = {**doc, "counts": bytes(doc["cells"][0])}
    elif fault == "cuts short":
        cuts = np.frombuffer(doc["cuts"][0], dtype="<u1").copy()
        cuts[-1] -= 1
        doc = {**doc, "cuts": [cuts.tobytes(), *doc["cuts"][1:]]}
    else:
        doc = {**doc, "chunk": np.full(doc["cells"][0], 300, dtype="<u2").tobytes()}
    items[17] = (doc, shape, width)
    found = shards_module.parse_usual_grids(items, chunk_sizes)
    if fault == "a grid of lengths":  # not of the usual form: the others are still checked together
        assert found.index(None) == 17 and found.count(None) == 1
    else:  # a check fails: its batch (here all 40 grids) is left to be checked grid by grid
        assert found.count(None) == len(items)
    assert shards_module.parse_usual_grids(items[:17] + items[18:], chunk_sizes).count(None) == 0


@pytest.mark.parametrize("before", [0, 2], ids=["alone", "after-two-grids"])
def test_a_grid_counts_against_the_shards_and_pieces_of_its_manifest(monkeypatch, before):
    cells = 4 * (before + 1)
    monkeypatch.setattr(manifest_module, "MAX_SHARDS", cells - 1)
    with pytest.raises(ManifestError, match=f"more than {cells - 1} shards in one manifest"):
        Manifest.from_bytes(grid_manifest(GOOD, before=before), "m")
    monkeypatch.setattr(manifest_module, "MAX_SHARDS", cells)
    monkeypatch.setattr(manifest_module, "MAX_PIECES", cells - 1)
    with pytest.raises(ManifestError, match=f"more than {cells - 1} pieces in one manifest"):
        Manifest.from_bytes(grid_manifest(GOOD, before=before), "m")
    monkeypatch.setattr(manifest_module, "MAX_PIECES", cells)
    assert len(Manifest.from_bytes(grid_manifest(GOOD, before=before), "m").tensors) == before + 1


def test_usual_grids_past_the_budget_are_left_to_be_parsed_alone():
    items, chunk_sizes = many_grids()
    cells = [len(shards_module.parse_grid(doc, "t", shape, width, chunk_sizes, NoBudget()))
             for doc, shape, width in items]
    found = shards_module.parse_usual_grids(items, chunk_sizes, most_cells=sum(cells[:10]))
    assert all(grid is not None for grid in found[:10]) and found[10:].count(None) == len(items) - 10


def test_a_damaged_grid_in_a_real_checkpoint_is_one_line_from_the_cli(tmp_path, capsys):
    full = torch.arange(120, dtype=torch.float32).reshape(12, 10)
    ckptfmt.save({"w": blocks(full, [0, 6, 12], [0, 10])}, f"{tmp_path}/repo/a")
    rewrite_manifest(open_storage(str(tmp_path / "repo")), "a",
                     lambda doc: doc["tensors"][0]["shards"].update(cuts=[bytes([0, 7, 12]), bytes([0, 10])]))
    with pytest.raises(ManifestError, match=r"tensor 'w': piece \[256, \+280\) runs past chunk 0"):
        ckptfmt.load(f"{tmp_path}/repo/a")
    from ckptfmt.cli import main
    assert main(["show", f"{tmp_path}/repo/a"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "runs past chunk 0" in err


# -- a grid is columns, not objects --------------------------------------------------

def big_grid(ranks: int) -> Manifest:
    """One bf16 tensor of ``ranks`` x 4 rows of 4096, row-sharded over ``ranks`` ranks, 64 ranks a chunk."""
    chunks = [Chunk(f"{i:064x}", "none", 64 * 4 * 8192, 64 * 4 * 8192) for i in range(ranks // 64)]
    cells = np.arange(ranks, dtype=np.int64)
    grid = ShardGrid([np.arange(0, 4 * ranks + 1, 4, dtype=np.int64), np.array([0, 4096])], cells,
                     np.arange(ranks + 1, dtype=np.int64), cells // 64, (cells % 64) * 32768,
                     np.full(ranks, 32768, dtype=np.int64))
    tensor = TensorEntry("w", "bfloat16", (4 * ranks, 4096), grid)
    return Manifest("big", 1, 1, None, chunks, [tensor], b"\x80", b"\x80")


def test_a_grid_of_a_million_shards_parses_into_columns_not_objects():
    count = 1_000_000  # the most one tensor may have
    data = big_grid(count).to_bytes()
    assert len(data) < count * 17  # a shard's cut 5 bytes, rank 4, chunk 2, offset 4
    tracemalloc.start()
    manifest = Manifest.from_bytes(data, "big")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < count * 80  # a ShardEntry, its tuples and ints would take about 400 bytes each
    shards = manifest.tensors[0].shards
    assert len(shards) == count and shards[-1] == ShardEntry((4 * count - 4, 0), (4, 4096), count - 1,
                                                        (Piece(count // 64 - 1, 63 * 32768, 32768),))


def test_a_box_read_builds_only_the_shards_it_overlaps(monkeypatch):
    grid = big_grid(2**16).tensors[0].shards
    built = []
    real = ShardGrid.__getitem__
    monkeypatch.setattr(ShardGrid, "__getitem__", lambda self, i: built.append(i) or real(self, i))
    from ckptfmt.loading.reader import _overlapping
    found = _overlapping(grid, (4 * 1000 + 2, 17), (9, 100))  # rows 4002-4010: cells 1000, 1001, 1002
    assert [s.offsets for s in found] == [(4000, 0), (4004, 0), (4008, 0)] and built == [1000, 1001, 1002]
    assert shards_module.ShardGrid.overlapping(grid, (0, 0), (0, 4096)).size == 0
