"""The tensor table in columns (spec 6.12, format 1.12): the same entries as the row form, every rule
refused by name, and fields of newer minors ignored."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import struct

import msgpack
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.errors import ManifestError
from ckptfmt.format.dtypes import ITEMSIZES
from ckptfmt.format.manifest import Manifest
from ckptfmt.kernels import keys as key_checks
from tests.support.spec_reader import shard_maps, tensor_rows
from tests.support.tensor_values import assert_stats_close


def _state() -> dict:
    """Every kind of entry: plain, parameter, numpy, empty, 0-dim, tied, sharded, cut into several pieces,
    statistics of every set, non-finite values, an integer extreme binary64 does not hold."""
    weight = torch.randn(3, 4)
    return {
        "w": weight, "tied": weight, "p": torch.nn.Parameter(torch.ones(5)), "n": np.arange(6, dtype=np.int32),
        "empty": torch.empty(0, 7), "scalar": torch.tensor(2.5), "flags": torch.tensor([True, False]),
        "odd": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.0]),
        "u16": torch.tensor([1, 2], dtype=torch.uint16), "c": torch.ones(2, dtype=torch.complex64),
        "huge": torch.tensor([2**62, -(2**62)], dtype=torch.int64), "bf": torch.randn(8).to(torch.bfloat16),
        "big": torch.randn(70_000), "sharded": ckptfmt.Sharded((4,), [ckptfmt.Shard((0,), torch.ones(2), 0),
                                                                      ckptfmt.Shard((2,), torch.zeros(2), 3)]),
        "ranked": ckptfmt.Sharded((3,), [ckptfmt.Shard((0,), torch.ones(3), 7)]),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[bytes, dict]:
    repo = tmp_path_factory.mktemp("columns") / "repo"
    ckptfmt.save(_state(), f"{repo}/a", chunk_size=2**16)
    commit = json.loads((repo / "a" / "COMMIT").read_bytes())
    data = (repo / "a" / f"manifest-{commit['manifest']}.msgpack").read_bytes()
    return data, msgpack.unpackb(data, raw=False, strict_map_key=False)


def test_the_columns_hold_the_entries_the_row_form_holds(saved):
    data, doc = saved
    columns = doc["tensors"]
    assert isinstance(columns, dict) and doc["version"] >= [1, 12]
    manifest = Manifest.from_bytes(data, "columns")
    rows_bytes = dataclasses.replace(manifest, version=(1, 11)).to_bytes()  # a 1.11 writer: one map per entry
    assert isinstance(msgpack.unpackb(rows_bytes, raw=False, strict_map_key=False)["tensors"], list)
    assert Manifest.from_bytes(rows_bytes, "rows").tensors == manifest.tensors
    assert manifest.to_bytes() == data  # read and written again: the same bytes
    assert Manifest.check(data, "m") is None
    # What the columns could not hold is in rows, whole: tied (same_as), several pieces, the integer
    # extremes beyond 2^53; the NaN-free float set with infinities stays in the columns, and (1.14) the
    # shard grid of whole-cell pieces in ``grids``, its item of rows nil.
    in_rows = {row["key"] for row in columns["rows"] if row is not None}
    assert in_rows == {"tied", "big", "huge"}
    row_at = np.frombuffer(columns["row_at"], dtype=f"<u{len(columns['row_at']) // len(columns['rows'])}")
    assert [columns["key"][at] for at, row in zip(row_at, columns["rows"]) if row is None] == ["sharded"]
    assert set(columns["grids"]) == {"cells", "cuts", "ranks", "chunk", "offset"}
    by_key = {entry.key: entry for entry in manifest.tensors}
    assert by_key["odd"].stats == {"count": 5, "min": -0.0, "max": 1.0, "mean": 0.5, "l2": 1.0, "absmax": 1.0,
                                   "nan": 1, "posinf": 1, "neginf": 1, "zeros": 1}
    assert str(by_key["odd"].stats["min"]) == "-0.0"
    assert by_key["flags"].stats == {"count": 2, "min": 0, "max": 1, "zeros": 1}
    assert type(by_key["flags"].stats["min"]) is int
    assert by_key["u16"].stats == by_key["c"].stats == {"count": 2}
    assert by_key["empty"].shards[0].pieces == () and by_key["empty"].stats["min"] is None
    assert by_key["ranked"].shards[0].rank == 7 and by_key["p"].kind == "parameter" and by_key["p"].requires_grad
    assert by_key["n"].kind == "numpy" and by_key["scalar"].shape == ()
    # The independent reader (tests/support/spec_reader.py) rebuilds the same maps from the columns (a
    # grid's bins in the width of the columns it was cut from: compared as its shards' maps).
    def shards_as_maps(rows: list[dict]) -> list[dict]:
        return [{**row, "shards": shard_maps(row["shards"], row["shape"], ITEMSIZES[row["dtype"]])} for row in rows]
    assert shards_as_maps(tensor_rows(columns)) == \
        shards_as_maps(msgpack.unpackb(rows_bytes, raw=False, strict_map_key=False)["tensors"])


def test_a_checkpoint_in_columns_loads_as_saved(tmp_path):
    state = _state()
    ckptfmt.save(state, f"{tmp_path}/repo/a")
    loaded = ckptfmt.load(f"{tmp_path}/repo/a")
    assert loaded["tied"] is loaded["w"] and isinstance(loaded["p"], torch.nn.Parameter)
    for key in ("w", "empty", "scalar", "flags", "u16", "huge", "bf", "big"):
        assert torch.equal(loaded[key], state[key]) and loaded[key].dtype == state[key].dtype, key
    assert np.array_equal(loaded["n"], state["n"])
    assert torch.equal(loaded["sharded"], torch.tensor([1.0, 1, 0, 0]))


def _set(name: str, value):
    return lambda t: t.__setitem__(name, value)


def _cell(name: str, index: int, value: int, width: int = 1):
    """Set cell ``index`` of column ``name`` (of ``width``-byte ints) to ``value``."""
    def change(t):
        raw = bytearray(t[name])
        raw[index * width:(index + 1) * width] = value.to_bytes(width, "little")
        t[name] = bytes(raw)
    return change


def _stat(name: str, index: int, value: float):
    def change(t):
        raw = bytearray(t["stats"][name])
        raw[8 * index:8 * index + 8] = struct.pack("<d", value)
        t["stats"][name] = bytes(raw)
    return change


def _key_index(t, key: str) -> int:
    return t["key"].index(key)


#: mutation -> the words its error names
REFUSED = {
    "key not strings": (_set("key", [1]), "'key' must be an array of strings"),
    "dtypes twice": (lambda t: t["dtypes"].append(t["dtypes"][0]), "distinct strings"),
    "unknown dtype": (lambda t: t["dtypes"].__setitem__(0, "qint8"), "qint8"),
    "dtype past dtypes": (lambda t: _cell("dtype", 0, 200)(t), "'dtype' holds values outside"),
    "column of another length": (lambda t: t.update(chunk=t["chunk"][:-1]), "'chunk' of"),
    "column not a bin": (_set("offset", [0]), "'offset' must be a bin"),
    "missing dims": (lambda t: t.pop("dims"), "'dims' must be a bin"),
    "ndim over 64": (lambda t: _cell("ndim", 0, 65)(t), "'ndim' holds values outside"),
    "kind 3": (lambda t: t.update(kind=bytes(len(t["key"]) - 1) + b"\x03"), "'kind' holds values outside"),
    "requires_grad 2": (lambda t: t.update(requires_grad=b"\x02" + bytes(len(t["key"]) - 1)),
                        "'requires_grad' holds values outside"),
    "chunk past the table": (lambda t: _cell("chunk", 0, 250)(t), "'chunk' holds values outside"),
    "piece past its chunk": (lambda t: t.update(offset=struct.pack(
        f"<{len(t['key'])}I", *(2**20 if key == "w" else 0 for key in t["key"]))), "runs past chunk"),
    "empty key": (lambda t: t["key"].__setitem__(0, ""), "invalid key"),
    "key over 4096 bytes": (lambda t: t["key"].__setitem__(0, "é" * 2049), "invalid key"),
    "two keys the same": (lambda t: t["key"].__setitem__(_key_index(t, "p"), "w"), "share one key: 'w'"),
    "a key the same as a row's": (lambda t: t["key"].__setitem__(0, t["rows"][0]["key"]), "share one key"),
    "same_as of a column entry of another kind": (  # tied's row names w, a column entry: made a parameter
        lambda t: t.update(kind=bytes(1 if key == "w" else k for key, k in zip(t["key"], t["kind"]))),
        "same_as names a different tensor"),
    "same_as with requires_grad where the first has none": (
        lambda t: next(row for row in t["rows"] if "same_as" in row).update(requires_grad=True),
        "same_as names a different tensor"),
    "rows without row_at": (lambda t: t.pop("row_at"), "together"),
    "row_at not increasing": (lambda t: t.update(row_at=t["row_at"][::-1]), "increasing order"),
    "a row's cell not 0": (lambda t: t["key"].__setitem__(t["row_at"][0], "x"), "zero in every column"),
    "a row that is not an entry": (lambda t: t["rows"].__setitem__(0, 5), "not a map"),
    "integer set on float32": (lambda t: _cell("set", _key_index(t, "w"), 2)(t["stats"]),
                               "statistics set 2 is not one spec 6.10 allows for float32"),
    "float set on int32": (lambda t: _cell("set", _key_index(t, "n"), 1)(t["stats"]), "allows for int32"),
    "count over the elements": (lambda t: _cell("zeros", _key_index(t, "w"), 13)(t["stats"]),
                                "count is over its elements"),
    "integer set's mean": (lambda t: _stat("mean", _key_index(t, "flags"), 1.0)(t), "does not have"),
    "count set's min": (lambda t: _stat("min", _key_index(t, "c"), 1.0)(t), "does not have"),
    "integer set's nan count": (lambda t: _cell("nan", _key_index(t, "flags"), 1)(t["stats"]), "does not have"),
    "a row's statistics cell": (lambda t: _stat("l2", _key_index(t, ""), 2.0)(t), "does not have"),
    "integer min not an integer": (lambda t: _stat("min", _key_index(t, "flags"), 0.5)(t), "not an integer"),
    "stats without a column": (lambda t: t["stats"].pop("l2"), "'l2' must be a bin"),
    "stats not a map": (_set("stats", [1]), "'stats' must be a map"),
    "shape over the limit": (lambda t: t.update(ndim=b"\x40" + t["ndim"][1:],
                                                dims=b"\xff" * 64 + t["dims"][t["ndim"][0]:]), "its shape"),
}


@pytest.mark.parametrize("mutation", sorted(REFUSED))
def test_every_rule_of_the_columns_is_refused_by_name(saved, mutation):
    _, doc = saved
    change, words = REFUSED[mutation]
    bad = copy.deepcopy(doc)
    change(bad["tensors"])
    data = msgpack.packb(bad, use_bin_type=True)
    with pytest.raises(ManifestError) as caught:
        Manifest.from_bytes(data, "m")
    assert words in str(caught.value) and str(caught.value).startswith("m: "), str(caught.value)
    with pytest.raises(ManifestError, match=re.escape(str(caught.value))):  # a save's own check: the same
        Manifest.check(data, "m")


@pytest.mark.parametrize("mutation", ["key not strings", "empty key", "key over 4096 bytes", "two keys the same",
                                      "a key the same as a row's"])
def test_the_key_rules_are_refused_alike_by_the_python_key_checks(saved, mutation, monkeypatch):
    """Where the C key checks are not built, Python's give the same refusal (ckptfmt/kernels/keys.py)."""
    _, doc = saved
    change, words = REFUSED[mutation]
    bad = copy.deepcopy(doc)
    change(bad["tensors"])
    data = msgpack.packb(bad, use_bin_type=True)
    messages = []
    for native in (key_checks._native, None):
        monkeypatch.setattr(key_checks, "_native", native)
        with pytest.raises(ManifestError, match=re.escape(words)) as caught:
            Manifest.from_bytes(data, "m")
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_a_shape_with_a_zero_is_empty_whatever_its_other_dimensions(saved):
    _, doc = saved
    good = copy.deepcopy(doc)
    columns = good["tensors"]
    index = columns["key"].index("empty")  # float32, shape [0, 7]; its own dims start after the others'
    ndims = list(columns["ndim"])
    start = sum(ndims[:index])
    dims = np.frombuffer(columns["dims"], dtype=f"<u{len(columns['dims']) // sum(ndims)}").astype("<u8")
    dims[start + 1] = 2**62  # [0, 2^62]: no elements, so within every limit
    columns["dims"] = dims.tobytes()
    entry = next(t for t in Manifest.from_bytes(msgpack.packb(good, use_bin_type=True), "m").tensors
                 if t.key == "empty")
    assert entry.shape == (0, 2**62) and entry.nbytes == 0


def test_fields_a_newer_minor_adds_are_ignored(saved):
    data, doc = saved
    newer = copy.deepcopy(doc)
    newer["version"] = [1, 99]
    newer["tensors"]["future_column"] = b"\x01" * len(doc["tensors"]["key"])
    newer["tensors"]["stats"]["p99"] = b"\x00" * 8 * len(doc["tensors"]["key"])
    read = Manifest.from_bytes(msgpack.packb(newer, use_bin_type=True), "newer")
    assert read.tensors == Manifest.from_bytes(data, "m").tensors


def _rows_read(data: bytes) -> list:
    """The tensor table of ``data`` written again as 1.11's rows and read: entries built as parsed."""
    manifest = Manifest.from_bytes(data, "m")
    rows = Manifest.from_bytes(dataclasses.replace(manifest, version=(1, 11)).to_bytes(), "rows")
    return list(rows.tensors)


def test_entries_built_by_blocks_are_those_built_all_at_once(saved, monkeypatch):
    data, _ = saved
    expected = _rows_read(data)
    table = Manifest.from_bytes(data, "m").tensors
    assert len(table) == len(expected) == 15 and table.keys() == [entry.key for entry in expected]
    monkeypatch.setattr(type(table), "BLOCK", 4)
    # Read by index, from the last (negative indexes too): each block of 4 built alone, from cells and rows.
    alone = [table[index - len(expected)] for index in reversed(range(len(expected)))][::-1]
    assert alone == expected and table._built is None and sorted(table._blocks) == [0, 1, 2, 3]
    assert [type(entry.stats) for entry in alone] == [type(entry.stats) for entry in expected]
    assert list(table) == expected and table._built is not None
    with pytest.raises(IndexError):
        Manifest.from_bytes(data, "m").tensors[len(expected)]
    assert Manifest.from_bytes(data, "m").tensors[1:3] == expected[1:3]


def test_a_table_read_by_index_is_built_whole_after_a_few_blocks(saved, monkeypatch):
    data, _ = saved
    table = Manifest.from_bytes(data, "m").tensors
    monkeypatch.setattr(type(table), "BLOCK", 2)
    monkeypatch.setattr(type(table), "BLOCKS", 3)
    assert [table[i] for i in (0, 2, 5)] == [_rows_read(data)[i] for i in (0, 2, 5)] and table._built is None
    assert table[9] == _rows_read(data)[9] and table._built is not None
    monkeypatch.undo()
    small = Manifest.from_bytes(data, "m").tensors  # a table of one block is built whole at its first read
    assert small[3] == _rows_read(data)[3] and small._built is not None


def test_threads_reading_one_table_read_the_same_entries(saved):
    from concurrent.futures import ThreadPoolExecutor

    data, _ = saved
    expected = _rows_read(data)
    for _ in range(20):
        table = Manifest.from_bytes(data, "m").tensors
        with ThreadPoolExecutor(4) as pool:
            reads = list(pool.map(lambda turn: list(table) if turn % 2 else [table[i] for i in range(len(table))],
                                  range(8)))
        assert all(read == expected for read in reads)


def test_a_manifest_made_with_a_list_holds_a_table_equal_to_it(saved):
    data, _ = saved
    manifest = Manifest.from_bytes(data, "m")
    entries = list(manifest.tensors)
    made = dataclasses.replace(manifest, tensors=entries)
    assert made.tensors == entries and entries == made.tensors and made.tensors is not entries
    assert made.tensors != entries[:-1] and made.to_bytes() == data


def test_entries_are_built_with_the_collector_paused_and_keys_are_the_callers(tmp_path):
    """Building 3,000 entries would run the cyclic collector dozens of times (the parse that built them
    before paused it); and the keys a caller gets are its own list, not the table's."""
    import gc

    ckptfmt.save({f"t{i}": torch.full((2,), float(i)) for i in range(3000)}, f"{tmp_path}/repo/a")
    with ckptfmt.open(f"{tmp_path}/repo/a") as reader:
        data = reader.manifest.to_bytes()
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])
    table = Manifest.from_bytes(data, "m").tensors
    keys = table.keys()
    keys[0] = "changed"
    gc.callbacks.append(count)
    try:
        assert table[2500].key == "t2500" and table[0].key == "t0"  # two blocks
        assert len(list(table)) == 3000
    finally:
        gc.callbacks.remove(count)
    assert collections == [] and table.keys()[0] == "t0"


def test_statistics_written_from_a_packs_columns_are_those_its_maps_give(tmp_path, monkeypatch):
    """A save keeps the statistics of a pack's small tensors as rows of the pack's columns, and the writer
    takes their cells from those columns at once: the manifest is the one written from maps (read and
    written again: the same bytes), an integer extreme beyond 2^53 among a pack's rows still puts that
    entry in the rows (and no other), and a tensor holding a NaN (a map among the rows) is written alike."""
    from ckptfmt.format import tensor_columns
    from ckptfmt.tensors.stats import tensor_stats

    generator = torch.Generator().manual_seed(11)
    state = {f"f{index}": torch.randn(3, generator=generator) for index in range(50)}
    state["f7"][1] = float("nan")
    state.update({f"i{index}": torch.tensor([index, -index], dtype=torch.int64) for index in range(20)})
    state["i5"] = torch.tensor([2**60, 3], dtype=torch.int64)
    groups: list[list[type]] = []
    real = tensor_columns._cell_groups
    monkeypatch.setattr(tensor_columns, "_cell_groups", lambda *args: [
        group for group in real(*args) if not groups.append([type(cells) for cells in group[1].values()])])
    repo = tmp_path / "repo"
    ckptfmt.save(state, f"{repo}/a")
    assert [np.ndarray] * 9 in groups and [np.ndarray] * 3 in groups and [list] * 9 in groups  # rows and a map
    commit = json.loads((repo / "a" / "COMMIT").read_bytes())
    data = (repo / "a" / f"manifest-{commit['manifest']}.msgpack").read_bytes()
    manifest = Manifest.from_bytes(data, "m")
    assert manifest.to_bytes() == data
    assert [row["key"] for row in msgpack.unpackb(data, raw=False)["tensors"]["rows"]] == ["i5"]
    for entry in manifest.tensors:
        assert_stats_close(tensor_stats(state[entry.key]), entry.stats, entry.key)


def test_many_packs_each_with_an_entry_the_columns_cannot_hold_are_written_in_one_pass():
    """Rows of 1,500 statistics columns (a save's packs), each with an int64 extreme binary64 does not
    hold beside an ordinary entry: the extremes go to the rows form, the others to the columns, with
    their own figures. (Each failing pack made the writer start over, once per pack: quadratic, and
    over Python's recursion limit at 1,000 packs.)"""
    from ckptfmt.format.manifest import _tensor_to_dict
    from ckptfmt.format.shards import Piece, ShardEntry
    from ckptfmt.format.tensor_columns import to_columns
    from ckptfmt.format.tensor_entry import TensorEntry
    from ckptfmt.format.tensor_stats import StatsRow

    entries = []
    for pack in range(1500):
        columns = {"count": np.array([2, 2]), "min": np.array([-(2**63), -pack]), "max": np.array([pack, pack]),
                   "zeros": np.array([0, 1])}
        for at in range(2):
            shard = ShardEntry((0,), (2,), 0, (Piece(0, 16 * at, 16),))
            entries.append(TensorEntry(f"t{pack}.{at}", "int64", (2,), (shard,), stats=StatsRow(columns, at)))
    doc = to_columns(entries, _tensor_to_dict, grids=True)
    row_at = np.frombuffer(doc["row_at"], dtype=f"<u{len(doc['row_at']) // 1500}")
    assert row_at.tolist() == list(range(0, 3000, 2))  # every extreme, and nothing else
    assert [row["stats"]["min"] for row in doc["rows"]] == [-(2**63)] * 1500
    sets = np.frombuffer(doc["stats"]["set"], dtype=np.uint8)
    assert sets[1::2].tolist() == [2] * 1500  # the integer set
    assert np.frombuffer(doc["stats"]["min"], "<f8")[1::2].tolist() == [-float(p) for p in range(1500)]
