"""replicate() and ``ckptfmt sync``: checkpoints copied between repositories on every backend.

What must hold: the copy is the same checkpoint (same manifest hash, commit record
and bytes), only the chunks the destination lacks are written, damage in the
source is reported and never copied, the commit comes last (a killed run leaves
nothing committed and a re-run copies only the rest), and every chunk written is
read back and checked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import zstandard
from fsspec.callbacks import Callback

import ckptfmt
from ckptfmt import CheckpointExistsError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import layout
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.repository.repository import Repository, marker_bytes
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import ANY_SIZE, assert_same, make_root, sync_cli


def state(seed: int, n: int = 200_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),  # 800 KB: chunks of chunk_size
        "h": torch.randn(n // 2, generator=g).to(torch.bfloat16),
        "bias": torch.randn(100, generator=g),  # packed
        "step": seed,
    }


def two_checkpoints(src: str) -> tuple[dict, dict]:
    """Checkpoints 'a' and 'b' of ``src``: 'b' changes one tensor and compresses; returns both states."""
    a = state(1)
    ckptfmt.save(a, f"{src}/a", step=1, chunk_size=64 * 1024)
    b = {**a, "h": a["h"] + 1, "step": 2}
    ckptfmt.save(b, f"{src}/b", step=2, chunk_size=64 * 1024, compression="shuffle-zstd")
    return a, b


def stored_objects(url: str, name: str) -> tuple[bytes, bytes]:
    """A checkpoint's commit record and manifest, as stored."""
    storage = open_storage(url)
    record = Repository(storage).commit(name)
    return (storage.read(layout.commit_key(name), max_size=ANY_SIZE),
            storage.read(layout.manifest_key(name, record.manifest_hash), max_size=ANY_SIZE))


def chunk_files(url: str) -> dict[str, int]:
    """The chunks stored in repository ``url`` (temporary files left out)."""
    found = open_storage(url).find(layout.CHUNKS_DIR)
    return {key: size for key, size in found.items() if not key.rsplit("/", 1)[-1].startswith(".")}


def a_chunk(url: str, name: str):
    """The key of the first tensor chunk of checkpoint ``name``, and its row."""
    repo = Repository.open(url)
    chunk = next(c for c in repo.manifest(name).chunks if c.size == 64 * 1024)
    return layout.chunk_key(chunk.hash, chunk.codec), chunk


@pytest.mark.parametrize("kinds", [("local", "s3"), ("s3", "local"), ("local", "local"), ("local", "memory")],
                         ids=lambda k: "-to-".join(k))
def test_copies_the_same_checkpoints(kinds, request, tmp_path):
    src = make_root(kinds[0], request, tmp_path) + "/src"
    dst = make_root(kinds[1], request, tmp_path) + "/dst"
    a, b = two_checkpoints(src)

    report = replicate(src, dst)

    assert report.copied == ("a", "b") and report.present == ()
    assert report.chunks_copied == len(chunk_files(dst)) == len(chunk_files(src))
    assert report.bytes_copied == sum(chunk_files(dst).values()) + sum(len(stored_objects(src, n)[1]) for n in "ab")
    for name in "ab":
        assert stored_objects(dst, name) == stored_objects(src, name)  # same commit record, same manifest
    assert ckptfmt.verify(dst).ok
    assert_same(a, ckptfmt.load(f"{dst}/a"))
    assert_same(b, ckptfmt.load(dst))

    again = replicate(src, dst)
    assert again.copied == () and again.present == ("a", "b")
    assert (again.chunks_copied, again.bytes_copied) == (0, 0)


def test_copies_only_the_chunks_the_destination_lacks(tmp_path, s3_bucket):
    src, dst = tmp_path / "src", f"{s3_bucket}/tier2"
    a = state(1, n=1_000_000)
    ckptfmt.save(a, src / "a", chunk_size=256 * 1024)
    first = replicate(src, dst)
    b = {**a, "bias": a["bias"] * 2}
    ckptfmt.save(b, src / "b", chunk_size=256 * 1024)

    # Repository objects work as well as URLs.
    report = replicate(Repository.open(src), Repository.open(dst), "b")

    record = Repository.open(src).commit("b")
    manifest_bytes = record.manifest_size
    assert report.copied == ("b",)
    assert report.chunks_copied == 1  # the pack holding "bias"
    assert report.bytes_copied == record.totals["new_bytes"] + manifest_bytes
    assert report.chunks_skipped == record.totals["chunk_count"] - 1
    assert report.bytes_copied < first.bytes_copied / 50
    assert_same(b, ckptfmt.load(f"{dst}/b"))


def test_parent_need_not_be_copied(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _, b = two_checkpoints(src)

    report = replicate(src, dst, ["b"])

    assert report.copied == ("b",)
    assert Repository.open(dst).names() == ["b"] and Repository.open(dst).commit("b").parent == "a"
    assert ckptfmt.verify(dst).ok
    assert_same(b, ckptfmt.load(dst))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_damaged_source_chunk_is_never_copied(damage, tmp_path, s3_bucket):
    src, dst = str(tmp_path / "src"), f"{s3_bucket}/dst"
    two_checkpoints(src)
    key, chunk = a_chunk(src, "a")
    path = tmp_path / "src" / key
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.write_bytes(data if damage == "corrupt" else data[:-1])
    error = CheckpointNotFoundError if damage == "missing" else CorruptDataError

    with pytest.raises(error, match=chunk.hash) as info:
        replicate(src, dst)

    assert f"{src}/{key}" in str(info.value) and "'a' not replicated" in str(info.value)
    assert not Repository.open(dst).names()  # neither 'a' nor its child 'b'
    assert key not in chunk_files(dst)


def test_existing_different_checkpoint_is_an_error(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    ckptfmt.save(state(1), src / "a")
    ckptfmt.save(state(2), dst / "a")

    with pytest.raises(CheckpointExistsError, match="a different checkpoint of that name exists") as info:
        replicate(src, dst)

    assert str(dst / "a") in str(info.value) and str(src / "a") in str(info.value)



@pytest.mark.parametrize("backend", ["local", "s3"])
def test_chunk_stored_under_another_encoding_is_an_error(backend, request, tmp_path):
    """An intact chunk the destination stores with another zstd frame is used as it is by its checkpoints:
    this copy's manifest cannot be, so nothing is overwritten and nothing committed."""
    src, dst = str(tmp_path / "src"), make_root(backend, request, tmp_path) + "/dst"
    two_checkpoints(src)
    chunk = next(c for c in Repository.open(src).manifest("b").chunks if c.codec == "shuffle4-zstd")
    key = layout.chunk_key(chunk.hash, chunk.codec)
    shuffled = zstandard.ZstdDecompressor().decompress((tmp_path / "src" / key).read_bytes())
    other = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(shuffled)
    assert len(other) != chunk.stored_size
    target = Repository.open(dst, create=True)
    target.storage.write(key, other)

    with pytest.raises(CheckpointExistsError, match="stored with another encoding") as info:
        replicate(src, dst)

    assert target.storage.describe(key) in str(info.value)
    assert target.names() == ["a"] and target.storage.read(key, max_size=ANY_SIZE) == other


def test_rival_replication_of_the_same_checkpoint(tmp_path):
    """Another replication committing the same checkpoint while this one copies it: it is present, no error."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    two_checkpoints(src)
    rival = []

    class Rival(Callback):  # at the first chunk this call copies, another call copies all of 'a'
        def call(self, *args, **kwargs):
            if not rival:
                rival.append(replicate(src, dst, "a"))

    report = replicate(src, dst, "a", callback=Rival(), workers=1)

    assert rival[0].copied == ("a",) and report.copied == () and report.present == ("a",)
    assert ckptfmt.verify(dst).ok

def test_local_destination_checks_chunks_no_commit_vouches_for(tmp_path):
    """A chunk left by a killed save may hold other bytes than its name says (spec 11.2): checked, rewritten."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    two_checkpoints(src)
    Repository.open(dst, create=True)
    bad, bad_chunk = a_chunk(src, "a")
    good = next(layout.chunk_key(c.hash, c.codec) for c in Repository.open(src).manifest("a").chunks
                if layout.chunk_key(c.hash, c.codec) != bad)
    for key in (bad, good):
        (tmp_path / "dst" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dst" / key).write_bytes((tmp_path / "src" / key).read_bytes())
    damaged = bytearray((tmp_path / "dst" / bad).read_bytes())
    damaged[0] ^= 0xFF
    (tmp_path / "dst" / bad).write_bytes(damaged)

    report = replicate(src, dst)

    assert report.chunks_copied == len(chunk_files(src)) - 1 and report.chunks_skipped >= 1
    assert ckptfmt.verify(dst).ok


def test_verifies_each_chunk_on_arrival(tmp_path, s3_bucket, s3_proxy):
    """Every chunk written is read back from S3 (GETs through the proxy), unless verify=False."""
    src = tmp_path / "src"
    two_checkpoints(src)
    through = {"client_kwargs": {"endpoint_url": s3_proxy.url}}
    gets = {}
    for verify in (True, False):
        s3_proxy.reset_counts()
        report = replicate(src, f"{s3_bucket}/{verify}", dst_storage_options=through, verify=verify)
        gets[verify] = s3_proxy.requests()["GET"]
    assert gets[True] - gets[False] == report.chunks_copied


class _LossyMemoryStorage(Storage):
    """memory:// storage whose chunk writes land with one byte flipped (a bad disk or a broken proxy)."""

    def write(self, key, data, *, durable=True):
        if key.startswith(layout.CHUNKS_DIR):
            data = bytearray(data)
            data[-1] ^= 1
        super().write(key, data, durable=durable)


def test_damage_on_arrival_is_caught_and_removed(tmp_path, memory_root):
    src = tmp_path / "src"
    two_checkpoints(src)
    real = open_storage(f"{memory_root}/dst")
    target = Repository(_LossyMemoryStorage(real.fs, real.root, real.url))
    target.storage.makedirs("")
    target.storage.create(layout.MARKER_KEY, marker_bytes(FORMAT_VERSION, frozenset()))

    with pytest.raises(CorruptDataError, match="the copy read back differs"):
        replicate(src, target, workers=1)

    assert not target.names() and not chunk_files(real.url)


CHILD = """
import sys, time
from fsspec.callbacks import Callback
from ckptfmt.lifecycle.replicate import replicate

class Slow(Callback):  # a slow link, about 2 ms per chunk, that stalls after 80 chunks: the test kills the copy
    calls = 0

    def call(self, *args, **kwargs):
        self.calls += 1
        time.sleep(0.002 if self.calls < 80 else 600)

replicate(sys.argv[1], sys.argv[2], workers=2, callback=Slow())
print("finished")
"""


@pytest.mark.parametrize("destination", ["local", pytest.param("s3", marks=pytest.mark.exhaustive)])
def test_resumes_after_kill(destination, request, tmp_path):
    src = tmp_path / "src"
    dst = make_root(destination, request, tmp_path) + "/dst"
    saved = {"w": torch.randn(250_000)}  # about 245 chunks of 4 KiB
    ckptfmt.save(saved, src / "a", chunk_size=4096)
    record = Repository.open(src).commit("a")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(src), dst], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(chunk_files(dst)) < 60:
            assert child.poll() is None and time.monotonic() < deadline, "the copy ended before it was killed"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    landed = len(chunk_files(dst))
    assert 60 <= landed < record.totals["chunk_count"]
    assert not Repository.open(dst).names()  # nothing committed: the commit comes last

    report = replicate(src, dst)

    assert report.copied == ("a",)
    assert report.chunks_skipped >= landed
    assert report.chunks_copied + report.chunks_skipped == record.totals["chunk_count"]
    assert report.bytes_copied < record.totals["stored_bytes"] + record.manifest_size
    assert stored_objects(dst, "a") == stored_objects(src, "a")
    assert ckptfmt.verify(dst).ok


def test_survives_s3_faults_or_fails_cleanly(tmp_path, s3_bucket, make_s3_proxy):
    """Under injected S3 faults a run commits complete checkpoints or raises; a clean re-run finishes the copy."""
    src, dst = tmp_path / "src", f"{s3_bucket}/dst"
    two_checkpoints(src)
    proxy = make_s3_proxy(seed=3)
    faulty = {"client_kwargs": {"endpoint_url": proxy.url},
              "config_kwargs": {"connect_timeout": 1, "read_timeout": 0.3}}
    with proxy.faults(0.05):
        try:
            replicate(src, dst, dst_storage_options=faulty)
        except ckptfmt.CheckpointError:
            pass
    assert sum(proxy.injected().values()) > 0
    for name in Repository.open(dst).names():
        assert stored_objects(dst, name) == stored_objects(src, name)

    replicate(src, dst)
    assert ckptfmt.verify(dst).ok and Repository.open(dst).names() == ["a", "b"]


def test_cli_sync(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    two_checkpoints(src)

    code, out, _ = sync_cli(str(src), str(dst), "--name", "a", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["copied"] == ["a"] and data["bytes_copied"] > 0 and data["chunks_copied"] > 0

    code, out, _ = sync_cli(str(src), str(dst), "--no-verify")
    assert code == 0 and "copied 1 checkpoint" in out and "1 already there" in out
    assert ckptfmt.verify(dst).ok

    ckptfmt.save(state(3), src / "c")
    ckptfmt.save(state(4), dst / "c")
    code, out, err = sync_cli(str(src), str(dst))
    assert code == 2 and err.startswith("ckptfmt: error: ") and "a different checkpoint" in err
