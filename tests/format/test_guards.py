"""Guards between writer and reader: the writer never commits what a reader refuses,
one damaged checkpoint never blocks a repository, and shard layouts are checked exactly."""

from __future__ import annotations

import json
import warnings

import msgpack
import pytest
import torch
import zstandard

import ckptfmt
from ckptfmt.errors import CorruptDataError, InvalidNameError, ManifestError, UnsupportedValueError
from ckptfmt.format import codecs, layout
from ckptfmt.format.limits import MAX_KEY_BYTES
from ckptfmt.format.manifest import Manifest


@pytest.mark.parametrize("state, message", [
    (torch.ones(3), "root of the state"),
    ({"k" * (MAX_KEY_BYTES + 1): torch.ones(1)}, "longer than"),
    ({("a", torch.ones(1)): 1}, "dict keys"),
    ({"s": "\ud800"}, "not valid Unicode"),
])
def test_writer_refuses_what_readers_would_refuse(tmp_path, state, message):
    with pytest.raises(UnsupportedValueError, match=message):
        ckptfmt.save(state, tmp_path / "repo" / "c")
    assert not (tmp_path / "repo" / "c" / layout.COMMIT_NAME).exists()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"chunk_size": 100}, ValueError, r"^chunk_size must be between 4096 and 4294967296 bytes$"),
    ({"step_times": [object()]}, UnsupportedValueError, r"^step_times must hold plain values .*'object'"),
    ({"parallelism": {"dp": object()}}, UnsupportedValueError, r"^parallelism must hold plain values .*'object'"),
    ({"compression": "lz4"}, ValueError,
     r"^unknown compression 'lz4': use one of None, 'none', 'zstd', 'shuffle-zstd', 'float-zstd', 'delta-zstd', "
     r"'auto'$"),
], ids=["chunk_size", "step_times", "parallelism", "compression"])
def test_bad_arguments_fail_before_anything_is_written(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "c", **kwargs)
    assert type(info.value) is error
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("name", ["Chunks", "CHUNKS", "CkptFmt.json"])
def test_reserved_names_are_case_insensitive(tmp_path, name):
    with pytest.raises(InvalidNameError):
        ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / name)


def test_a_damaged_latest_checkpoint_does_not_block_saves_or_loads(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(2)}, repo / "a")
    ckptfmt.save({"w": torch.zeros(2)}, repo / "b")
    (repo / "b" / layout.COMMIT_NAME).write_text("{not json")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert torch.equal(ckptfmt.load(repo)["w"], torch.ones(2))  # latest *valid* checkpoint
        ckptfmt.save({"w": torch.full((2,), 2.0)}, repo / "c")
        assert torch.equal(ckptfmt.load(repo)["w"], torch.full((2,), 2.0))
    report = ckptfmt.verify(repo)
    assert not report.ok and [p.checkpoint for p in report.problems] == ["b"]


def test_a_commit_record_disagreeing_with_its_manifest_is_refused(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(2)}, repo / "a", step=5)
    commit = repo / "a" / layout.COMMIT_NAME
    doc = json.loads(commit.read_text())
    doc["step"] = 6
    commit.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="differ from the commit record"):
        ckptfmt.load(repo / "a")


def test_zstd_chunk_with_trailing_bytes_is_corrupt():
    data = b"x" * 1000
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(data)
    assert bytes(codecs.decode("zstd", frame, len(data), "c")) == data
    with pytest.raises(CorruptDataError, match="one complete zstd frame"):
        codecs.decode("zstd", frame + b"junk", len(data), "c")


def _sharded_manifest(boxes: list[tuple[tuple, tuple]], shape: tuple) -> bytes:
    """A manifest of one float32 tensor made of the given (offsets, shape) boxes, all from one chunk."""
    sizes = [4 * int(torch.Size(box).numel()) for _, box in boxes]
    chunk_size = max(sizes)
    shards = [{"offsets": list(o), "shape": list(b), "rank": i, "pieces": [[0, 0, n]] if n else []}
              for i, ((o, b), n) in enumerate(zip(boxes, sizes))]
    doc = {
        "format": "ckptfmt-manifest", "version": [1, 0], "name": "c", "step": None, "created_ns": 1, "parent": None,
        "chunks": [{"hash": "0" * 64, "codec": "none", "size": chunk_size, "stored_size": chunk_size}],
        "tensors": [{"key": "t", "dtype": "float32", "shape": list(shape), "shards": shards}],
        "state": msgpack.packb({}), "user": msgpack.packb({}),
    }
    return msgpack.packb(doc, use_bin_type=True)


def test_many_shards_forming_a_grid_are_accepted():
    boxes = [((r, c), (1, 2)) for r in range(20) for c in range(0, 40, 2)]  # 400 shards
    manifest = Manifest.from_bytes(_sharded_manifest(boxes, (20, 40)), "grid")
    assert len(manifest.tensors[0].shards) == 400


def test_many_shards_with_a_hole_and_an_overlap_are_refused():
    boxes = [((r, 0), (1, 1)) for r in range(300)]
    boxes[5] = ((4, 0), (1, 1))  # row 4 twice, row 5 missing: same volume
    with pytest.raises(ManifestError, match="grid"):
        Manifest.from_bytes(_sharded_manifest(boxes, (300, 1)), "holes")


def test_few_shards_overlapping_are_refused():
    boxes = [((0, 0), (2, 2)), ((1, 1), (2, 2)), ((0, 2), (1, 1)), ((3, 0), (1, 3))]
    with pytest.raises(ManifestError):
        Manifest.from_bytes(_sharded_manifest(boxes, (4, 3)), "overlap")
