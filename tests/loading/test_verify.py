"""verify(): intact data passes; every kind of damage is found, named, and refused by readers."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fsspec.callbacks import Callback

import ckptfmt
from ckptfmt import CheckpointError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import layout
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import ANY_SIZE, assert_same, tensor_chunk_keys


def big(seed: int, n: int = 80_000) -> torch.Tensor:
    """320 KB of float32: over the packing limit, so it has a chunk of its own."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def two_checkpoints(repo_url):
    """Two checkpoints sharing one chunk (the bytes of ``shared``) three times over."""
    shared = big(1)
    first = {
        "w": shared,
        "w_copy": shared.clone(),
        "other": big(2),
        "small": {"a": torch.ones(4), "b": torch.arange(3)},
    }
    second = {"x": shared.clone(), "v": big(3)}
    ckptfmt.save(first, f"{repo_url}/first", chunk_size=1 << 20)
    ckptfmt.save(second, f"{repo_url}/second", chunk_size=1 << 20)
    return repo_url, first, second


def chunk_of(repo_url: str, name: str, key: str) -> tuple[str, str]:
    """(storage key, hash) of the single chunk holding tensor ``key``."""
    with ckptfmt.open(f"{repo_url}/{name}") as reader:
        (chunk_key,) = tensor_chunk_keys(reader, key)
        entry = reader.tensor_info(key)
        return chunk_key, reader.manifest.chunks[entry.shards[0].pieces[0].chunk].hash


def flip_byte(repo_url: str, key: str, position: int = 1234) -> None:
    storage = open_storage(repo_url)
    data = bytearray(storage.read(key, max_size=ANY_SIZE))
    data[position % len(data)] ^= 0x40
    storage.write(key, bytes(data))


def test_intact_repository_is_ok(two_checkpoints):
    repo_url, first, second = two_checkpoints
    report = ckptfmt.verify(repo_url)
    assert report.ok, report.problems
    assert report.checkpoints == ["first", "second"]
    manifests = [Repository.open(repo_url).manifest(n) for n in ("first", "second")]
    distinct = {(c.hash, c.codec): c.size for m in manifests for c in m.chunks}
    assert report.chunks_checked == len(distinct) == 4  # shared (stored once), other, the small pack, v
    assert report.bytes_checked == sum(distinct.values())
    assert report.damaged_tensors == []

    single = ckptfmt.verify(f"{repo_url}/second")
    assert single.ok and single.checkpoints == ["second"] and single.chunks_checked == 2


def test_flipped_byte_names_the_chunk_and_every_tensor_using_it(two_checkpoints):
    repo_url, first, second = two_checkpoints
    key, digest = chunk_of(repo_url, "first", "w")
    assert chunk_of(repo_url, "second", "x") == (key, digest)
    flip_byte(repo_url, key)

    report = ckptfmt.verify(repo_url)
    assert not report.ok
    assert sorted((p.kind, p.checkpoint, p.chunk, p.tensors) for p in report.problems) == [
        ("corrupt-chunk", "first", digest, ("w", "w_copy")),
        ("corrupt-chunk", "second", digest, ("x",)),
    ]
    assert all(key in p.message for p in report.problems)
    assert report.damaged_tensors == ["first:w", "first:w_copy", "second:x"]

    # Readers refuse the damaged tensor, naming the file, and still serve the others.
    with ckptfmt.open(f"{repo_url}/first") as reader:
        with pytest.raises(CorruptDataError, match="hash mismatch") as info:
            reader.get_tensor("w")
        assert open_storage(repo_url).describe(key) in str(info.value)
        assert torch.equal(reader.get_tensor("other"), first["other"])
    with pytest.raises(CorruptDataError) as info:
        ckptfmt.load(f"{repo_url}/second")
    assert isinstance(info.value, CheckpointError) and key in str(info.value)


def test_damaged_pack_names_all_its_tensors(two_checkpoints):
    repo_url, first, _ = two_checkpoints
    key, digest = chunk_of(repo_url, "first", "small/a")
    assert chunk_of(repo_url, "first", "small/b")[0] == key
    flip_byte(repo_url, key, position=0)
    report = ckptfmt.verify(f"{repo_url}/first")
    assert [(p.kind, p.chunk, p.tensors) for p in report.problems] == [
        ("corrupt-chunk", digest, ("small/a", "small/b"))
    ]


def test_missing_chunk(two_checkpoints):
    repo_url, first, second = two_checkpoints
    key, digest = chunk_of(repo_url, "second", "v")
    open_storage(repo_url).delete(key)
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.checkpoint, p.chunk, p.tensors) for p in report.problems] == [
        ("missing-chunk", "second", digest, ("v",))
    ]
    with pytest.raises(CheckpointNotFoundError, match="chunk is missing") as info:
        ckptfmt.load(f"{repo_url}/second")
    assert key in str(info.value)
    assert_same(first, ckptfmt.load(f"{repo_url}/first"))  # the other checkpoint is intact


def test_truncated_chunk(two_checkpoints):
    repo_url, first, _ = two_checkpoints
    key, digest = chunk_of(repo_url, "first", "other")
    storage = open_storage(repo_url)
    storage.write(key, storage.read(key, max_size=ANY_SIZE)[:-100])
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.chunk, p.tensors) for p in report.problems] == [("corrupt-chunk", digest, ("other",))]
    with ckptfmt.open(f"{repo_url}/first") as reader:
        with pytest.raises(CorruptDataError) as info:
            reader.get_tensor("other")
        assert key in str(info.value)


def test_oversized_chunk(two_checkpoints):
    repo_url, _, _ = two_checkpoints
    key, digest = chunk_of(repo_url, "second", "v")
    storage = open_storage(repo_url)
    storage.write(key, storage.read(key, max_size=ANY_SIZE) + b"extra")
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.chunk) for p in report.problems] == [("corrupt-chunk", digest)]
    with pytest.raises(CorruptDataError):
        ckptfmt.open(f"{repo_url}/second").get_tensor("v")


def manifest_key(repo_url: str, name: str) -> str:
    record = Repository.open(repo_url).commit(name)
    return layout.manifest_key(name, record.manifest_hash)


def test_corrupt_manifest_is_a_bad_checkpoint(two_checkpoints):
    repo_url, first, second = two_checkpoints
    key = manifest_key(repo_url, "first")
    flip_byte(repo_url, key, position=100)  # same size, so only the hash in COMMIT catches it
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.checkpoint) for p in report.problems] == [("bad-checkpoint", "first")]
    assert key in report.problems[0].message
    assert report.chunks_checked == 2  # second's chunks are still checked
    for call in (lambda: ckptfmt.load(f"{repo_url}/first"), lambda: ckptfmt.open(f"{repo_url}/first")):
        with pytest.raises(CorruptDataError, match="hash mismatch") as info:
            call()
        assert key in str(info.value)
    assert_same(second, ckptfmt.load(f"{repo_url}/second"))


def test_missing_or_truncated_manifest(two_checkpoints):
    repo_url, _, _ = two_checkpoints
    storage = open_storage(repo_url)
    first_key, second_key = manifest_key(repo_url, "first"), manifest_key(repo_url, "second")
    storage.delete(first_key)
    storage.write(second_key, storage.read(second_key, max_size=ANY_SIZE)[:50])
    report = ckptfmt.verify(repo_url)
    assert sorted((p.kind, p.checkpoint) for p in report.problems) == [
        ("bad-checkpoint", "first"), ("bad-checkpoint", "second")]
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptfmt.load(f"{repo_url}/first")
    assert first_key in str(info.value)
    with pytest.raises(CorruptDataError) as info:
        ckptfmt.load(f"{repo_url}/second")
    assert second_key in str(info.value)


def test_corrupt_commit_record(two_checkpoints):
    repo_url, _, _ = two_checkpoints
    storage = open_storage(repo_url)
    commit = layout.commit_key("second")
    storage.write(commit, b"{not json")
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.checkpoint) for p in report.problems] == [("bad-checkpoint", "second")]
    assert commit in report.problems[0].message
    with pytest.raises(ckptfmt.ManifestError, match="COMMIT"):
        ckptfmt.load(f"{repo_url}/second")

    # A commit record that names another checkpoint's manifest is refused too.
    doc = json.loads(storage.read(layout.commit_key("first"), max_size=ANY_SIZE))
    storage.write(commit, json.dumps(doc).encode())
    with pytest.raises(ckptfmt.ManifestError, match="names checkpoint 'first'"):
        ckptfmt.load(f"{repo_url}/second")


def test_corrupt_compressed_chunk(repo_url):
    state = {"w": torch.arange(200_000, dtype=torch.int32)}
    ckptfmt.save(state, f"{repo_url}/z", compression="zstd")
    (key,) = tensor_chunk_keys(ckptfmt.open(f"{repo_url}/z"), "w")
    assert key.endswith(".zstd")
    flip_byte(repo_url, key, position=200)
    report = ckptfmt.verify(repo_url)
    assert [(p.kind, p.tensors) for p in report.problems] == [("corrupt-chunk", ("w",))]
    with pytest.raises(CorruptDataError) as info:
        ckptfmt.load(f"{repo_url}/z")
    assert key in str(info.value)


def test_progress_callback_and_cancel(two_checkpoints):
    repo_url, _, _ = two_checkpoints

    recorder = Callback()
    report = ckptfmt.verify(repo_url, callback=recorder)
    assert report.ok
    assert recorder.size == report.bytes_checked
    assert recorder.value == report.bytes_checked

    cancel = threading.Event()
    cancel.set()
    cancelled = ckptfmt.verify(repo_url, cancel=cancel)
    assert cancelled.cancelled and not cancelled.ok
    assert cancelled.chunks_checked == 0


def test_cancel_mid_run_skips_the_chunks_not_started(two_checkpoints):
    repo_url, _, _ = two_checkpoints
    cancel = threading.Event()

    class CancelAfterOneChunk(Callback):
        def relative_update(self, inc=1):
            cancel.set()
    report = ckptfmt.verify(repo_url, callback=CancelAfterOneChunk(), cancel=cancel, workers=1)
    assert report.cancelled and not report.ok and report.chunks_checked == 1


def test_a_checkpoint_url_naming_no_checkpoint_is_an_error_not_damage(two_checkpoints):
    repo_url, _, _ = two_checkpoints
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        ckptfmt.verify(f"{repo_url}/typo")


def test_verify_of_something_that_is_not_a_repository(root_url):
    open_storage(root_url).write("plain/file", b"x")
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.verify(f"{root_url}/plain")
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.verify(f"{root_url}/nothing-here")
