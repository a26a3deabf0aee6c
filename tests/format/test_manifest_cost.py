"""Manifests that would cost far more to check or read than their size: the work stays bounded.

Zero-length pieces are refused (spec 6.5); pieces and shards per manifest are
capped (spec 14); shard layouts are checked without comparing every pair; a
chunk is read and decoded once per tensor however many pieces use it; a chunk
row claiming 0 bytes never turns into an unbounded read.
"""

from __future__ import annotations

import re
import time

import msgpack
import numpy as np
import pytest
import torch
import zstandard

import ckptfmt
from ckptfmt import ManifestError
from ckptfmt.format import codecs, layout, unpacking
from ckptfmt.format import manifest as manifest_module
from ckptfmt.format.manifest import MANIFEST_FORMAT, Manifest
from ckptfmt.format.tiling import check_tiling
from ckptfmt.storage.factory import open_storage
from ckptfmt.tools.diff import diff
from tests.support.helpers import assert_same, rewrite_manifest

HASH = "ab" * 32


def manifest_bytes(chunks: list[dict], tensors: list[dict]) -> bytes:
    return msgpack.packb({
        "format": MANIFEST_FORMAT, "version": [1, 15], "name": "m", "step": 1, "created_ns": 1,
        "parent": None, "chunks": chunks, "tensors": tensors, "state": b"\x80", "user": b"\x80",
    }, use_bin_type=True)


def test_zero_length_pieces_are_refused():
    """Millions of them once cost seconds and ~850 MB for a 12 MB manifest; one is enough to refuse it now."""
    chunks = [{"hash": HASH, "codec": "none", "size": 8, "stored_size": 8}]
    data = manifest_bytes(chunks, [{"key": "e", "dtype": "uint8", "shape": [0], "shards": [
        {"offsets": [0], "shape": [0], "pieces": [[0, 0, 0]] * 1000}]}])
    with pytest.raises(ManifestError, match="lengths integers >= 1"):
        Manifest.from_bytes(data, "m")


@pytest.mark.parametrize("limit", ["MAX_PIECES", "MAX_SHARDS"])
def test_pieces_and_shards_per_manifest_are_capped(monkeypatch, limit):
    monkeypatch.setattr(manifest_module, limit, 10)
    chunks = [{"hash": HASH, "codec": "none", "size": 4, "stored_size": 4}]
    tensors = [{"key": f"t{i}", "dtype": "float32", "shape": [1], "shards": [
        {"offsets": [0], "shape": [1], "pieces": [[0, 0, 4]]}]} for i in range(6)]
    Manifest.from_bytes(manifest_bytes(chunks, tensors[:5]), "m")  # 5 shards, 5 pieces: within the cap
    over = tensors + [{**t, "key": f"u{i}"} for i, t in enumerate(tensors)]
    with pytest.raises(ManifestError, match=f"more than 10 {limit.removeprefix('MAX_').lower()} in one manifest"):
        Manifest.from_bytes(manifest_bytes(chunks, over), "m")


def brick_wall(dims: int = 64, rows: int = 16, columns: int = 16, width: int = 1000):
    """Rows of boxes in the last two of ``dims`` dimensions, each row's cuts shifted: a tiling, not a grid."""
    shape = (1,) * (dims - 2) + (rows, columns * width)
    boxes = []
    for r in range(rows):
        cuts = [0] + [c * width + (r * 37) % width for c in range(1, columns)] + [columns * width]
        for start, end in zip(cuts, cuts[1:]):
            offsets = (0,) * (dims - 2) + (r, start)
            boxes.append(manifest_module.ShardEntry(offsets, (1,) * (dims - 2) + (1, end - start), 0, ()))
    return shape, boxes


def test_non_grid_layouts_are_checked_without_comparing_every_pair():
    """256 shards in 64 dimensions: pair by pair in Python this took ~0.16 s a tensor (minutes for a
    256 MiB manifest). The bound below is ~7x the old cost for 20 tensors and ~7x the new one."""
    shape, boxes = brick_wall()
    started = time.process_time()  # CPU time: tests running beside this one do not count
    for _ in range(20):
        check_tiling("t", shape, boxes)
    assert time.process_time() - started < 1.5


def widen(box, by: int, move: int = 0):
    """``box`` with its last dimension longer by ``by`` and its start moved by ``move``."""
    return box._replace(offsets=box.offsets[:-1] + (box.offsets[-1] + move,),
                        shape=box.shape[:-1] + (box.shape[-1] + by,))


def test_overlaps_are_still_found_in_non_grid_layouts():
    shape, boxes = brick_wall()
    # The second box grows into the third, which shrinks at its end: same volume, one overlap, one gap.
    with pytest.raises(ManifestError, match="overlap"):
        check_tiling("t", shape, [boxes[0], widen(boxes[1], 1), widen(boxes[2], -1), *boxes[3:]])
    # The same cut moved by one element is still a tiling.
    check_tiling("t", shape, [boxes[0], widen(boxes[1], 1), widen(boxes[2], -1, move=1), *boxes[3:]])
    # Beyond 256 shards only grids are allowed.
    with pytest.raises(ManifestError, match="do not form a grid"):
        check_tiling("t", (17, 16000), brick_wall(dims=2, rows=17)[1])


# -- reads that the manifest's claims must not multiply ------------------------------------------------

def test_a_compressed_chunk_is_decoded_once_per_tensor(tmp_path, monkeypatch):
    """A 64 MiB tensor of zeros in 16 MiB zstd chunks: four pieces of one chunk; sharded, four shards of it."""
    zeros = torch.zeros(16 * 2**20)
    sharded = ckptfmt.Sharded((4 * 2**20 * 4,), [ckptfmt.Shard((i * 4 * 2**20,), torch.zeros(4 * 2**20), i)
                                                 for i in range(4)])
    state = {"zeros": zeros, "sharded": sharded}
    url = ckptfmt.save(state, tmp_path / "repo" / "a", compression="zstd", chunk_size=16 * 2**20)
    decoded = []
    real_decode = codecs.decode
    monkeypatch.setattr(codecs, "decode", lambda *args: decoded.append(args[-1]) or real_decode(*args))
    with ckptfmt.open(url, mmap=False) as ckpt:
        assert len({p.chunk for p in ckpt.tensor_info("zeros").shards[0].pieces}) == 1
        assert torch.equal(ckpt.get_tensor("zeros"), zeros)
        assert len(decoded) == 1
        assert torch.equal(ckpt.get_tensor("sharded"), torch.zeros(16 * 2**20))
        assert len(decoded) == 2


def test_sharded_tensors_assemble_from_shared_chunks(tmp_path):
    """Shards whose pieces share chunks (and come in any order) still land in place."""
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)
    shards = [ckptfmt.Shard((r, c), full[r : r + 128, c : c + 128].clone(), 0) for r in (128, 0) for c in (0, 128)]
    state = {"t": ckptfmt.Sharded((256, 256), shards), "again": ckptfmt.Sharded((256, 256), shards[::-1])}
    url = ckptfmt.save(state, tmp_path / "repo" / "a", chunk_size=4096)
    loaded = ckptfmt.load(url, mmap=False)
    assert_same({"t": full, "again": full}, loaded)


def test_a_chunk_row_of_zero_bytes_is_refused_by_its_size(repo_url):
    """A row claiming 0 bytes, named after an 8 MB object: refused on its size (see also the storage tests)."""
    url = ckptfmt.save({"w": torch.ones(10)}, f"{repo_url}/a")
    storage = open_storage(repo_url)
    storage.write(layout.chunk_key(HASH, "none"), b"x" * 8_000_000)
    rewrite_manifest(storage, "a", lambda doc: doc["chunks"].append(
        {"hash": HASH, "codec": "none", "size": 0, "stored_size": 0}))
    report = ckptfmt.verify(url)
    assert [p.kind for p in report.problems] == ["corrupt-chunk"]
    assert re.search(r"8000000 bytes(, over the limit of 0| stored, manifest says 0)", report.problems[0].message)


def test_chunk_rows_are_distinct_and_agree_on_sizes():
    row = {"hash": HASH, "codec": "none", "size": 4, "stored_size": 4}
    tensor = {"key": "t", "dtype": "float32", "shape": [1], "shards": [{"offsets": [0], "shape": [1],
                                                                       "pieces": [[0, 0, 4]]}]}
    with pytest.raises(ManifestError, match="twice"):
        Manifest.from_bytes(manifest_bytes([row, row], [tensor]), "m")
    other_codec = {**row, "codec": "zstd", "size": 8, "stored_size": 3}
    with pytest.raises(ManifestError, match="sizes differ"):
        Manifest.from_bytes(manifest_bytes([row, other_codec], [tensor]), "m")
    Manifest.from_bytes(manifest_bytes([row, {**other_codec, "size": 4}], [tensor]), "m")


def test_rewritten_manifests_stay_readable(repo_url):
    """The helper that rewrites a committed manifest (used above) keeps a valid checkpoint valid."""
    state = {"w": torch.arange(10.0)}
    url = ckptfmt.save(state, f"{repo_url}/a")
    rewrite_manifest(open_storage(repo_url), "a", lambda doc: None)
    assert_same(state, ckptfmt.load(url))
    assert ckptfmt.verify(url).ok


def test_metadata_nested_too_deep_is_refused():
    """Every reader renders metadata, most of them recursively: a deep environment must not reach them."""
    deep: dict = {}
    node = deep
    for _ in range(500):
        node["x"] = {}
        node = node["x"]
    doc = msgpack.unpackb(manifest_bytes([], []), raw=False)
    with pytest.raises(ManifestError, match="environment nested deeper than 64"):
        Manifest.from_bytes(msgpack.packb({**doc, "environment": deep}), "m")
    packer = msgpack.Packer()
    deeper = packer.pack_map_header(len(doc) + 1) + b"".join(packer.pack(k) + packer.pack(v) for k, v in doc.items())
    with pytest.raises(ManifestError):  # 5000 arrays: deeper than msgpack's own stack
        Manifest.from_bytes(deeper + packer.pack("environment") + b"\x91" * 5000 + b"\xc0", "m")
    shallow = {"a": [{"b": [1, 2, {"c": None}]}]}
    assert Manifest.from_bytes(msgpack.packb({**doc, "environment": shallow}), "m").environment == shallow


def test_diff_measures_numpy_arrays(tmp_path):
    a = ckptfmt.save({"x": np.arange(6.0)}, tmp_path / "repo" / "a")
    b = ckptfmt.save({"x": np.arange(6.0) * 2}, tmp_path / "repo" / "b")
    (item,) = diff(a, b).tensors
    assert item.status == "changed" and item.max_abs_diff == 5.0


def test_a_zstd_frame_holding_more_than_it_declares_is_refused_at_once():
    """A decompression bomb: 1 GiB of zeros in a frame whose header says 1 MiB. Decoding it once grew
    the output to the whole gigabyte (seconds, and that much memory) before failing."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=2**30)
    frame = b"".join(compressor.compress(bytes(2**20)) for _ in range(1024)) + compressor.flush()
    assert zstandard.frame_content_size(frame) == 2**30
    header = frame[:6]  # magic, frame header descriptor, window descriptor; then the 4-byte content size
    forged = header + (2**20).to_bytes(4, "little") + frame[10:]
    started = time.process_time()
    with pytest.raises(ckptfmt.CorruptDataError, match="not one complete zstd frame"):
        codecs.decode("zstd", forged, 2**20, "bomb")
    assert time.process_time() - started < 0.5


def _many_dimensional_tensors(count: int, dims: int = 64, shards: int = 256) -> list[dict]:
    """Tensors of ``shards`` one-element shard maps along the last of ``dims`` dimensions."""
    one = {"dtype": "uint8", "shape": [1] * (dims - 1) + [shards], "shards": [
        {"offsets": [0] * (dims - 1) + [i], "shape": [1] * dims, "pieces": [[0, 0, 1]]} for i in range(shards)]}
    return [{"key": f"t{i}", **one} for i in range(count)]


def test_a_manifest_of_too_many_shard_map_dimensions_is_refused_while_it_is_decoded():
    """2^22 dimensions of shard maps in all (spec 14): the 257th tensor of 256 shards in 64 dimensions
    goes over, and the table is decoded tensor by tensor, so the refusal comes there, not after msgpack
    decoded the whole (85 MiB of such tensors took 14.5 s to refuse, 5.4 s of it decoding)."""
    chunks = [{"hash": HASH, "codec": "none", "size": 1, "stored_size": 1}]
    data = manifest_bytes(chunks, _many_dimensional_tensors(300))
    assert len(data) > unpacking.STREAM_FROM
    with pytest.raises(ManifestError, match=r"shard maps of more than 4194304 dimensions in all, after tensor "
                                            r"'t256'"):
        Manifest.from_bytes(data, "m")


@pytest.mark.parametrize("form", ["rows", "columns"])
def test_shard_map_dimensions_count_in_both_forms_of_the_tensor_table(monkeypatch, form):
    monkeypatch.setattr(unpacking, "MAX_SHARD_MAP_DIMS", 2 * 2 * 5)  # five tensors of two shards in two dims
    monkeypatch.setattr(unpacking, "STREAM_FROM", 0)
    chunks = [{"hash": HASH, "codec": "none", "size": 4, "stored_size": 4}]
    tensors = _many_dimensional_tensors(6, dims=2, shards=2)

    def table(entries: list[dict]):
        if form == "rows":
            return entries
        return {"key": [""] * len(entries), "dtypes": [], "dtype": bytes(len(entries)), "ndim": bytes(len(entries)),
                "dims": b"", "chunk": bytes(len(entries)), "offset": bytes(len(entries)), "rows": entries,
                "row_at": bytes(range(len(entries)))}
    Manifest.from_bytes(manifest_bytes(chunks, table(tensors[:5])), "m")
    with pytest.raises(ManifestError, match="shard maps of more than 20 dimensions in all, after tensor 't5'"):
        Manifest.from_bytes(manifest_bytes(chunks, table(tensors)), "m")
