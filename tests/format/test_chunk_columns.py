"""The chunk table in columns (spec 6.13, format 1.13): the same rows as the row form, for plain,
compressed and delta chunks; every rule refused by name; older manifests read; new fields ignored."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.errors import ManifestError
from ckptfmt.format import chunk_table
from ckptfmt.format.chunk_table import Chunk
from ckptfmt.format.manifest import Manifest
from tests.support.spec_reader import chunk_rows


def _manifest(repo, name: str) -> tuple[bytes, dict]:
    commit = json.loads((repo / name / "COMMIT").read_bytes())
    data = (repo / name / f"manifest-{commit['manifest']}.msgpack").read_bytes()
    return data, msgpack.unpackb(data, raw=False, strict_map_key=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three checkpoints: uncompressed, compressed with several codecs, and a delta save against the second."""
    repo = tmp_path_factory.mktemp("chunk-columns") / "repo"
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 300), "b": torch.randn(70_000).to(torch.bfloat16), "i": torch.arange(5000),
             "small": torch.ones(3)}
    ckptfmt.save(state, f"{repo}/plain", chunk_size=2**16)
    ckptfmt.save(state, f"{repo}/packed", chunk_size=2**16, compression="auto")
    state["w"][0, :10] += 1
    ckptfmt.save(state, f"{repo}/delta", chunk_size=2**16, compression="delta-zstd", parent="packed")
    return repo


@pytest.mark.parametrize("name", ["plain", "packed", "delta"])
def test_the_columns_hold_the_rows_the_row_form_holds(saved, name):
    data, doc = _manifest(saved, name)
    assert isinstance(doc["chunks"], dict) and doc["version"] >= [1, 13]
    manifest = Manifest.from_bytes(data, name)
    rows_bytes = dataclasses.replace(manifest, version=(1, 12)).to_bytes()  # a 1.12 writer: one map per row
    rows = msgpack.unpackb(rows_bytes, raw=False, strict_map_key=False)["chunks"]
    assert isinstance(rows, list) and rows == chunk_rows(doc["chunks"])  # the spec's reading of the columns
    assert Manifest.from_bytes(rows_bytes, "rows").chunks == manifest.chunks
    assert manifest.to_bytes() == data  # read and written again: the same bytes
    codecs = {chunk.codec for chunk in manifest.chunks}
    if name == "delta":
        assert any(chunk.base is not None for chunk in manifest.chunks) and "base" in doc["chunks"]
    else:
        assert "base" not in doc["chunks"] and (codecs == {"none"}) == (name == "plain")
    assert ckptfmt.verify(str(saved)).ok


def test_a_thousand_rows_cost_their_hash_and_a_few_bytes(saved):
    chunks = [Chunk(f"{i:064x}", "none" if i % 3 else "zstd", 2**22, 2**22 if i % 3 else 2**21) for i in range(1000)]
    columns = msgpack.packb(chunk_table.table_doc(chunks, columns=True), use_bin_type=True)
    rows = msgpack.packb(chunk_table.table_doc(chunks, columns=False), use_bin_type=True)
    assert len(columns) < 32 * 1000 + 9 * 1000 + 100 < len(rows) / 2
    assert chunk_table.parse_table(msgpack.unpackb(columns, raw=False)) == chunks


def _columns(**change) -> dict:
    """Three valid rows in columns (a none row, a zstd row, a delta of the first), then ``change``."""
    doc = {"hash": bytes(range(96)), "codecs": ["none", "zstd", "delta4-zstd"], "codec": bytes([0, 1, 2]),
           "size": bytes([16, 16, 16]), "stored_size": bytes([16, 9, 5]), "base": bytes([0, 0, 1])}
    doc.update(change)
    return {name: value for name, value in doc.items() if value is not None}


HOSTILE = {
    "hash not a bin": ({"hash": "00" * 96}, "'hash' must be a bin of 32 bytes a row"),
    "hash cut mid-row": ({"hash": bytes(95)}, "'hash' must be a bin of 32 bytes a row"),
    "codecs repeated": ({"codecs": ["none", "none", "delta4-zstd"]}, "'codecs' must be an array of distinct"),
    "codecs not strings": ({"codecs": ["none", 1, "delta4-zstd"]}, "'codecs' must be an array of distinct"),
    "an unknown codec": ({"codecs": ["none", "lz4", "delta4-zstd"]}, "unknown chunk codec 'lz4'"),
    "a codec number past codecs": ({"codec": bytes([0, 1, 3])}, "'codec' holds values outside"),
    "a column of another length": ({"size": bytes([16, 16])}, "'size' of 2 bytes does not hold 3"),
    "a column of 3-byte ints": ({"size": bytes(9)}, "'size' of 9 bytes does not hold 3 integers"),
    "no stored sizes": ({"stored_size": None}, "'stored_size' must be a bin"),
    "a size over 4 GiB": ({"size": np.array([16, 16, 2**33], "<u8").tobytes()}, "'size' holds values outside"),
    "a none row stored smaller": ({"stored_size": bytes([15, 9, 5])}, "chunk 0: uncompressed but stored_size 15"),
    "a delta without a base": ({"base": None}, "chunk 2: a delta4-zstd chunk needs a base"),
    "a base on a whole chunk": ({"base": bytes([0, 1, 1])}, "chunk 1: a zstd chunk has no base"),
    "a base past the table": ({"base": bytes([0, 0, 4])}, "'base' holds values outside"),
    "a chunk its own base": ({"base": bytes([0, 0, 3])}, "chunk 2: base 2 is not another row"),
    "a base of another size": ({"size": bytes([8, 16, 16]), "stored_size": bytes([8, 9, 5])},
                               "chunk 2: 16 bytes, its base chunk 0 has 8"),
    "an object listed twice": ({"hash": bytes(range(32)) * 2 + bytes(32), "codec": bytes([0, 0, 2]),
                                "stored_size": bytes([16, 16, 5])}, "lists a chunk twice"),
    "one hash of two sizes": ({"hash": bytes(range(32)) * 2 + bytes(32), "size": bytes([16, 8, 16]),
                               "stored_size": bytes([16, 9, 5])}, "rows of one hash but sizes differ"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_columns_are_refused_naming_the_rule(case):
    change, message = HOSTILE[case]
    with pytest.raises(ManifestError, match=message):
        chunk_table.parse_table(_columns(**change))


def test_a_cycle_of_bases_is_refused():
    doc = _columns(codec=bytes([2, 1, 2]), base=bytes([3, 0, 1]), stored_size=bytes([5, 9, 5]))
    with pytest.raises(ManifestError, match="bases deep, or bases in a cycle"):
        chunk_table.parse_table(doc)


def test_too_many_rows_are_refused_before_any_is_built(monkeypatch):
    monkeypatch.setattr(chunk_table, "MAX_CHUNKS", 2)
    with pytest.raises(ManifestError, match="too many chunks"):
        chunk_table.parse_table(_columns())


def test_valid_columns_read_as_their_rows_and_new_fields_are_ignored():
    chunks = chunk_table.parse_table(_columns(priority=bytes(3)))
    assert chunks == [Chunk(bytes(range(32)).hex(), "none", 16, 16), Chunk(bytes(range(32, 64)).hex(), "zstd", 16, 9),
                      Chunk(bytes(range(64, 96)).hex(), "delta4-zstd", 16, 5, 0)]
    assert chunk_table.parse_table({"hash": b"", "codecs": [], "codec": b"", "size": b"", "stored_size": b""}) == []


def test_a_damaged_chunk_column_is_one_line_from_the_cli(saved, tmp_path, capsys):
    from ckptfmt.cli import main
    from ckptfmt.storage.factory import open_storage
    from tests.support.helpers import rewrite_manifest

    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(4)}, f"{repo}/a")
    rewrite_manifest(open_storage(str(repo)), "a", lambda doc: doc["chunks"].update(codecs=["lz4"]), rows=False)
    assert main(["show", f"{repo}/a"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown chunk codec 'lz4'" in err
