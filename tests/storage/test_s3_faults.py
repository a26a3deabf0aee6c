"""S3 under faults and concurrency: a fault-injecting proxy in front of moto, racing writer processes.

The proxy (tests/support/s3_fault_proxy.py) answers requests with 500s, 503 SlowDowns,
dropped connections, stalls, truncated bodies and flipped bits. What must hold whatever it does:
a save commits a complete checkpoint or raises a CheckpointError and leaves no
commit record; a read returns the saved bytes or raises a CheckpointError; nothing
runs longer than the retry and timeout settings allow.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import fsspec
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointError, CheckpointExistsError, CorruptDataError, StorageError
from ckptfmt.format import layout
from ckptfmt.format.hashing import check_chunk
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.storage import object_store
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.object_store import S3FS_TRIES, ObjectStorage
from tests.support.helpers import ANY_SIZE, assert_same
from tests.support.s3_fault_proxy import RANDOM_KINDS

ROOT = Path(__file__).resolve().parents[2]

#: Short timeouts through the proxy, so that stalls (1 s) cost 0.5 s each; retries stay the library's.
FAST_TIMEOUTS = {"connect_timeout": 1, "read_timeout": 0.3}


def through(proxy, **config) -> dict:
    """storage_options reaching moto through ``proxy``."""
    return {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {**FAST_TIMEOUTS, **config}}


def small_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64 * 1024, generator=g),  # 256 KiB: 4 chunks of 64 KiB
        "v": torch.randint(-1000, 1000, (100_000,), dtype=torch.int16, generator=g),
        "b": torch.randn(300, generator=g),
        "seed": seed,
    }


def commit_exists(repo_url: str, name: str) -> bool:
    """Whether NAME/COMMIT exists, asked straight to moto (no proxy)."""
    return open_storage(repo_url).exists(layout.commit_key(name))


# -- client settings ---------------------------------------------------------------------------

def test_s3_client_defaults_and_overrides(s3_bucket, monkeypatch):
    """s3:// storages get bounded timeouts and retries; the caller's config_kwargs and the AWS
    retry variables win key by key; s3fs's own retry loop is cut to S3FS_TRIES."""
    def settings(options=None):
        storage = open_storage(f"{s3_bucket}/repo", options)
        config = storage.fs.s3.meta.config
        return config.connect_timeout, config.read_timeout, config.retries, storage.fs.retries

    assert settings() == (10, 30, {"mode": "standard", "total_max_attempts": 6}, S3FS_TRIES)
    assert S3FS_TRIES < 5  # s3fs's default, multiplied by botocore's attempts
    mine = {"read_timeout": 5, "retries": {"mode": "adaptive", "total_max_attempts": 3}}
    assert settings({"config_kwargs": mine}) == (10, 5, mine["retries"], S3FS_TRIES)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "9")
    assert settings()[2] == {"mode": "standard", "total_max_attempts": 9}
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    assert settings()[2] == {"mode": "adaptive", "total_max_attempts": 9}


def test_a_users_s3fs_filesystem_keeps_its_own_settings(s3_bucket):
    """fsspec caches filesystems by their options: ckptfmt's retry bound must not reach the s3fs object
    that other code in the process gets for the same options (it was set on that shared object)."""
    import s3fs

    ours = open_storage(f"{s3_bucket}/repo").fs
    theirs = s3fs.S3FileSystem(**ours.storage_options)
    assert theirs is not ours and theirs.retries == s3fs.S3FileSystem.retries == 5
    assert ours.retries == S3FS_TRIES and open_storage(f"{s3_bucket}/other").fs is ours  # ours are cached too


def slowed_deletes(storage, answers: list[str]) -> list[list[str]]:
    """Make the S3 server's DeleteObjects answer its first key with each code of ``answers`` in turn
    (the key kept), as S3 does under load; returns the keys of each request made."""
    requests: list[list[str]] = []
    call_s3 = storage.fs.call_s3

    def answering(method, *args, **kwargs):
        if method != "delete_objects":
            return call_s3(method, *args, **kwargs)
        keys = [o["Key"] for o in kwargs["Delete"]["Objects"]]
        requests.append(keys)
        if not answers:
            return call_s3(method, *args, **kwargs)
        code = answers.pop(0)
        kwargs["Delete"]["Objects"] = [{"Key": k} for k in keys[1:]]
        out = call_s3(method, *args, **kwargs) if keys[1:] else {}
        return {**out, "Errors": [*out.get("Errors", []), {"Key": keys[0], "Code": code, "Message": "try later"}]}

    storage.fs.call_s3 = answering
    return requests


def test_deletes_that_s3_asks_to_slow_down_are_tried_again(s3_bucket):
    storage = open_storage(f"{s3_bucket}/slow", {"skip_instance_cache": True})
    for key in ("a", "b", "c"):
        storage.write(key, b"x")
    requests = slowed_deletes(storage, ["SlowDown", "InternalError"])
    storage.delete_many(["a", "b", "c"])
    assert [len(keys) for keys in requests] == [3, 1, 1]  # the one key S3 kept, until it went
    assert not any(storage.exists(key) for key in ("a", "b", "c"))
    storage.write("d", b"x")
    slowed_deletes(storage, ["SlowDown"] * 10)
    with pytest.raises(StorageError, match=r"slow/d \(tried 4 times\): try later \(SlowDown\)"):
        storage.delete_many(["d"])
    assert storage.exists("d")  # gc must not count it as gone


def test_options_keyed_by_protocol_reach_the_s3_client(s3_bucket):
    """As fsspec.open takes them: {"s3": {...}} is merged in, open()'s own keys are left out."""
    storage = open_storage(f"{s3_bucket}/repo", {"s3": {"anon": True}, "mode": "rb"})
    assert storage.fs.anon is True and "mode" not in storage.fs.storage_options


# -- the commit record's read-back ---------------------------------------------------------------

def test_lost_answer_to_a_successful_commit_put_still_commits(s3_bucket, s3_proxy):
    """The commit PUT lands but its connection drops before the answer; the retry gets 412
    (the key exists: our own record). The save reads the record back, finds its own bytes: committed."""
    url = f"{s3_bucket}/lost"
    options = through(s3_proxy)
    ckptfmt.save({"x": 0}, f"{url}/base", storage_options=options)
    s3_proxy.reset_counts()
    s3_proxy.script("drop", op="PUT", key_suffix="/a/COMMIT", forward=True)
    saved = small_state(1)
    assert ckptfmt.save(saved, f"{url}/a", storage_options=options) == f"{url}/a"
    assert s3_proxy.injected() == Counter({("drop", "PUT"): 1})
    assert s3_proxy.errors == []
    assert_same(saved, ckptfmt.load(f"{url}/a"))
    assert ckptfmt.verify(url).ok


def test_commit_put_failing_after_it_landed_still_commits(s3_bucket, s3_proxy):
    """Every try of the commit PUT loses its answer (the first one landed): the create fails, and
    the read-back finds this save's record, so the save reports the commit that did happen."""
    url = f"{s3_bucket}/landed"
    options = through(s3_proxy, retries={"mode": "standard", "total_max_attempts": 1})
    saved = small_state(2)
    s3_proxy.script("drop", op="PUT", key_suffix="/a/COMMIT", forward=True, times=100)
    ckptfmt.save(saved, f"{url}/a", storage_options=options)
    assert s3_proxy.injected()[("drop", "PUT")] >= 2  # the create really failed, retries included
    assert_same(saved, ckptfmt.load(f"{url}/a"))


def test_commit_put_that_never_landed_fails_cleanly(s3_bucket, s3_proxy):
    url = f"{s3_bucket}/never"
    options = through(s3_proxy, retries={"mode": "standard", "total_max_attempts": 2})
    s3_proxy.script("internal_error", op="PUT", key_suffix="/a/COMMIT", times=100)
    with pytest.raises(StorageError, match="InternalError|internal error"):
        ckptfmt.save(small_state(3), f"{url}/a", storage_options=options)
    assert not commit_exists(url, "a")
    assert Repository.open(url).names() == []


def test_conditional_conflict_409_is_retried(s3_bucket, s3_proxy):
    """AWS answers 409 ConditionalRequestConflict to overlapping conditional writes; the create retries."""
    url = f"{s3_bucket}/conflict"
    s3_proxy.script("conflict", op="PUT", key_suffix="/a/COMMIT", times=2)
    saved = small_state(4)
    ckptfmt.save(saved, f"{url}/a", storage_options=through(s3_proxy))
    assert s3_proxy.injected() == Counter({("conflict", "PUT"): 2})
    assert_same(saved, ckptfmt.load(f"{url}/a"))


def test_conditional_conflict_409_retries_are_bounded(s3_bucket, s3_proxy):
    url = f"{s3_bucket}/conflict"
    s3_proxy.script("conflict", op="PUT", key_suffix="/a/COMMIT", times=1000)
    with pytest.raises(StorageError, match="ConditionalRequestConflict|conflicting"):
        ckptfmt.save(small_state(5), f"{url}/a", storage_options=through(s3_proxy))
    assert s3_proxy.injected()[("conflict", "PUT")] == 5  # five tries, then the error
    assert not commit_exists(url, "a")


class RivalStore:
    """An ObjectStorage on memory:// whose conditional create is ignored and where a rival's record
    lands right after ours (``when="create"``) or during the settle delay (``when="settle"``)."""

    def __init__(self, root: str, when: str):
        self.storage = ObjectStorage(fsspec.filesystem("memory"), root.removeprefix("memory://"), root)
        self.repo = Repository(self.storage)
        self.when = when
        self.rival = CommitRecord("a", "0" * 64, 10, 2, 2, None, {}).to_bytes()
        original_create, original_read = self.storage.create, self.storage.read
        self.reads = 0

        def create(key, data):
            original_create(key, data)
            if when == "create":
                self.storage.write(key, self.rival)

        def read(key, **kwargs):
            data = original_read(key, **kwargs)
            self.reads += 1
            if when == "settle" and self.reads == 1:
                self.storage.write(key, self.rival)
            return data

        self.storage.create, self.storage.read = create, read


@pytest.mark.parametrize("when", ["create", "settle"])
def test_store_ignoring_the_condition_is_noticed(memory_root, when):
    """A rival record replacing ours after our create 'succeeded' (a store that ignores If-None-Match):
    the save must not report success, and says why."""
    store = RivalStore(memory_root, when)
    ours = CommitRecord("a", "1" * 64, 10, 1, 1, None, {})
    with pytest.raises(CheckpointExistsError, match="did not honour the conditional create"):
        store.repo.create_commit(ours)
    assert store.reads == (2 if when == "create" else 3)  # a rival's record is read twice: not a flip in transit
    assert store.storage.read(layout.commit_key("a"), max_size=ANY_SIZE) == store.rival


def test_trusted_stores_skip_the_read_back(tmp_path, memory_root):
    """Local disks (link()) and memory:// keep their plain write-once create: no read-back, hence no
    settle delay (it lies between two read-backs)."""
    for url in (str(tmp_path / "repo"), memory_root):
        repo = Repository.open(url, create=True)
        assert repo.storage.create_settle_s is None
        record = CommitRecord("a", "1" * 64, 10, 1, 1, None, {})
        reads, read = [], repo.storage.read
        repo.storage.read = lambda key, **options: reads.append(key) or read(key, **options)
        repo.create_commit(record)
        assert layout.commit_key("a") not in reads
        with pytest.raises(CheckpointExistsError, match="already exists"):
            repo.create_commit(CommitRecord("a", "2" * 64, 10, 1, 1, None, {}))


# -- reads that fail are errors, not verdicts ------------------------------------------------------

NO_RETRIES = {"mode": "standard", "total_max_attempts": 1}


def test_unreadable_chunk_is_a_storage_error_not_corruption(s3_bucket, s3_proxy):
    """verify() cannot read a chunk (the store keeps failing): it raises, rather than reporting
    an intact chunk as corrupt."""
    url = f"{s3_bucket}/verify"
    ckptfmt.save(small_state(6), f"{url}/a", chunk_size=65536)
    chunk = Repository.open(url).manifest("a").chunks[0]
    s3_proxy.script("internal_error", op="GET", key_suffix=layout.chunk_key(chunk.hash, chunk.codec), times=100)
    with pytest.raises(StorageError, match="internal error"):
        ckptfmt.verify(url, storage_options=through(s3_proxy, retries=NO_RETRIES))
    assert ckptfmt.verify(url).ok


def test_unreadable_commit_record_does_not_change_latest(s3_bucket, s3_proxy):
    """Loading a repository's latest checkpoint while its newest commit record cannot be read:
    an error, not silently the checkpoint before it."""
    url = f"{s3_bucket}/latest"
    ckptfmt.save(small_state(7), f"{url}/a")
    ckptfmt.save(small_state(8), f"{url}/b")
    s3_proxy.script("internal_error", op="GET", key_suffix="/b/COMMIT", times=100)
    with pytest.raises(StorageError, match="internal error"):
        ckptfmt.load(url, storage_options=through(s3_proxy, retries=NO_RETRIES))
    assert_same(small_state(8), ckptfmt.load(url))


# -- reads tried again ----------------------------------------------------------------------------

READS = {
    "load": lambda url, options: ckptfmt.load(url, storage_options=options),
    "get_tensor": lambda url, options: _get_tensor(url, options),
    "verify": lambda url, options: ckptfmt.verify(url, storage_options=options),
}


def _get_tensor(url: str, options: dict) -> torch.Tensor:
    with ckptfmt.open(url, storage_options=options) as reader:
        return reader.get_tensor("w")


def check_read(what: str, result, saved: dict) -> None:
    if what == "load":
        assert_same(saved, result)
    elif what == "get_tensor":
        assert_same(saved["w"], result)
    else:
        assert result.ok and result.checkpoints == ["a"], result.problems


@pytest.mark.parametrize(("kind", "target", "what"), [
    ("flip", "chunk", "load"), ("flip", "chunk", "get_tensor"), ("flip", "chunk", "verify"),
    ("flip", "manifest", "load"), ("flip", "commit record", "get_tensor"), ("flip", "commit record", "verify"),
    ("truncate", "chunk", "verify"), ("truncate", "manifest", "get_tensor"), ("truncate", "commit record", "load"),
    ("cut", "chunk", "get_tensor"), ("cut", "manifest", "verify"), ("drop", "chunk", "load"),
    ("drop", "commit record", "get_tensor"), ("internal_error", "manifest", "load"), ("slow_down", "chunk", "verify"),
])
def test_a_damaged_or_cut_response_is_read_again(s3_bucket, s3_proxy, kind, target, what):
    """One response with a flipped bit, cut short, its connection cut or dropped, or a 5xx answer, with
    botocore's retries off: ckptfmt's own read again gets the stored bytes (each kind of fault the
    exhaustive soak draws at random, directed at each kind of read)."""
    url = f"{s3_bucket}/reread"
    saved = small_state(3)
    ckptfmt.save(saved, f"{url}/a", chunk_size=65536)
    record = Repository.open(url).commit("a")
    chunk = Repository.open(url).manifest("a").chunks[0]
    suffix = {"chunk": layout.chunk_key(chunk.hash, chunk.codec), "commit record": "/a/COMMIT",
              "manifest": layout.manifest_key("a", record.manifest_hash)}[target]
    s3_proxy.script(kind, op="GET", key_suffix=suffix)

    result = READS[what](f"{url}/a", through(s3_proxy, retries=NO_RETRIES))

    check_read(what, result, saved)
    assert s3_proxy.injected() == Counter({(kind, "GET"): 1})


def test_a_read_that_keeps_failing_says_how_many_tries_it_made(s3_bucket, s3_proxy, monkeypatch):
    """Each failing read is tried 5 times, the pauses between doubling from 0.1-0.2 s (recorded, not
    slept: 3-6 s of waiting otherwise)."""
    url = f"{s3_bucket}/tries"
    ckptfmt.save(small_state(4), f"{url}/a", chunk_size=65536)
    chunk = Repository.open(url).manifest("a").chunks[0]
    key = layout.chunk_key(chunk.hash, chunk.codec)
    options = through(s3_proxy, retries=NO_RETRIES)
    pauses: list[float] = []
    monkeypatch.setattr(object_store.time, "sleep", pauses.append)

    s3_proxy.script("truncate", op="GET", key_suffix=key, times=100)
    with pytest.raises(StorageError, match=r"after 5 tries over \d+\.\d s"):
        ckptfmt.load(f"{url}/a", storage_options=options)
    s3_proxy.unscript()
    assert len(pauses) == 4 and all(0.1 * 2**i <= pause <= 0.2 * 2**i for i, pause in enumerate(pauses)), pauses

    # botocore checks a whole object's checksum (a StorageError once its tries are spent); ckptfmt checks
    # the chunk's hash wherever botocore cannot (a ranged read): either way the error counts the tries.
    s3_proxy.script("flip", op="GET", key_suffix=key, times=100)
    with pytest.raises(CheckpointError, match=r"after 5 tries over|read 5 times, different bytes each time"):
        ckptfmt.load(f"{url}/a", storage_options=options)
    s3_proxy.unscript()
    assert ckptfmt.verify(url, storage_options=options).ok


def test_read_tries_are_the_callers_to_bound(s3_bucket, s3_proxy):
    """storage_options' read_tries (ckptfmt's, not fsspec's): 1 gives up at the first bad response."""
    url = f"{s3_bucket}/bounded"
    ckptfmt.save(small_state(7), f"{url}/a", chunk_size=65536)
    chunk = Repository.open(url).manifest("a").chunks[0]
    s3_proxy.script("truncate", op="GET", key_suffix=layout.chunk_key(chunk.hash, chunk.codec), times=2)
    options = {**through(s3_proxy, retries=NO_RETRIES), "read_tries": 1}
    with pytest.raises(StorageError) as failed:
        ckptfmt.load(f"{url}/a", storage_options=options)
    assert "tries" not in str(failed.value)  # one try: nothing to count
    with pytest.raises(ValueError, match="read_tries"):
        open_storage(url, {"read_tries": 0.5})


def test_bytes_that_keep_failing_their_hash_are_named_with_the_reads_made():
    """Where no transport checksum catches a flip, the chunk's hash does, and five different wrong
    readings are the connection's fault, said so (memory:// reads stand in for a flipping link)."""
    calls = []

    def flipping_read(self, key, *, max_size):
        calls.append(key)
        data = bytearray(b"chunk bytes")
        data[len(calls) % len(data)] ^= 1
        return bytes(data)

    storage = ObjectStorage(fsspec.filesystem("memory"), "/flips", "s3://flips")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ObjectStorage, "read", flipping_read)
        with pytest.raises(CorruptDataError, match="read 5 times, different bytes each time"):
            storage.read_checked("k", max_size=100, check=lambda data: check_chunk(data, "0" * 64, "k"))
    assert len(calls) == 5


def test_bytes_damaged_in_the_store_are_read_twice_not_five_times(s3_bucket, s3_client, s3_proxy):
    """The same wrong bytes twice are the store's: the error stands after the second read."""
    url = f"{s3_bucket}/stored-damage"
    ckptfmt.save(small_state(5), f"{url}/a", chunk_size=65536)
    chunk = Repository.open(url).manifest("a").chunks[0]
    key = layout.chunk_key(chunk.hash, chunk.codec)
    bucket, _, prefix = s3_bucket.removeprefix("s3://").partition("/")
    object_key = f"{prefix}/stored-damage/{key}".lstrip("/")
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=object_key)["Body"].read())
    data[100] ^= 1
    s3_client.put_object(Bucket=bucket, Key=object_key, Body=bytes(data))
    s3_proxy.reset_counts()

    report = ckptfmt.verify(f"{url}/a", storage_options=through(s3_proxy))

    assert [p.kind for p in report.problems] == ["corrupt-chunk"] and "hash mismatch" in report.problems[0].message
    gets = s3_proxy.requests()["GET"]
    assert gets <= 2 + len(Repository.open(url).manifest("a").chunks) + 2  # commit, manifest, chunks, the re-read


#: Reads under random faults, the fault campaign's count: in make test-exhaustive alone (botocore's own
#: backoff on the 5xx answers makes a read take about a second; make test keeps each fault's own test).
READ_SOAK = 200


@pytest.mark.exhaustive
def test_reads_succeed_through_a_link_that_faults_a_quarter_of_responses(s3_bucket, s3_proxy, reads=READ_SOAK):
    """The fault campaign's link: every read (load, open + get_tensor, verify) right, none given up, through
    flipped bits, truncated bodies, cut and dropped connections and 5xx answers on a quarter of requests."""
    url = f"{s3_bucket}/soak-reads"
    saved = {name: small_state(10 + i) for i, name in enumerate(("a", "b"))}
    for name, state in saved.items():
        ckptfmt.save(state, f"{url}/{name}", chunk_size=65536)
    options = through(s3_proxy)
    kinds = ("flip", "truncate", "cut", "drop", "internal_error", "slow_down")
    failed = []
    with s3_proxy.faults(0.25, kinds):
        for i in range(reads):
            what, name = list(READS)[i % 3], "ab"[i // 3 % 2]
            try:
                result = READS[what](f"{url}/{name}", options)
            except CheckpointError as exc:
                failed.append(f"{what} {name}: {exc}")
                continue
            if what == "verify":
                assert result.ok and result.checkpoints == [name], result.problems
            else:
                assert_same(saved[name] if what == "load" else saved[name]["w"], result)
    injected = s3_proxy.injected()
    assert failed == []
    assert {kind for kind, _ in injected} == set(kinds), injected
    assert injected[("flip", "GET")] >= reads // 10


# -- many operations under random faults ---------------------------------------------------------

#: Longest any one operation may take: far above what the faults cost (p50 is well under a second),
#: far below a hang. The bound from the settings is larger still (see ckptfmt.storage.object_store.s3_options).
OPERATION_LIMIT_S = 45
WORKERS = 12
ROUNDS = 2
FAULT_RATE = 0.3
#: Half the workers keep the library's retries; the other half allow 2 attempts and no read tried again
#: (``read_tries``), so that some operations fail and the failure paths are exercised too.
FEW_RETRIES = {"mode": "standard", "total_max_attempts": 2}


class Watchdog:
    """Runs operations in daemon threads and fails the test when one outlives OPERATION_LIMIT_S."""

    def __init__(self):
        self.durations: list[float] = []
        self.lock = threading.Lock()

    def run(self, what: str, fn):
        box: dict = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        started = time.monotonic()
        thread = threading.Thread(target=target, name=f"op {what}", daemon=True)
        thread.start()
        thread.join(OPERATION_LIMIT_S)
        if thread.is_alive():
            raise AssertionError(f"{what}: still running after {OPERATION_LIMIT_S} s")
        with self.lock:
            self.durations.append(time.monotonic() - started)
        if "error" in box:
            raise box["error"]
        return box.get("value")


class Soak:
    """One worker's rounds of save / load / get_tensor / verify through its own faulty proxy."""

    def __init__(self, index: int, repo_url: str, proxy, watchdog: Watchdog, options: dict):
        self.index, self.repo_url, self.proxy, self.watchdog, self.options = index, repo_url, proxy, watchdog, options
        self.committed: dict[str, dict] = {}
        self.failed_saves: list[str] = []
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (operation, first try / after retries / failed)
        self.wrong: list[str] = []  # anything the invariants forbid

    def op(self, what: str, fn, check=None) -> bool:
        before = sum(self.proxy.injected().values())
        try:
            value = self.watchdog.run(what, fn)
        except CheckpointError:
            self.outcomes[(what.split()[0], "failed cleanly")] += 1
            return False
        except AssertionError:
            raise
        except BaseException as exc:
            self.wrong.append(f"{what}: {type(exc).__name__}: {exc}")
            return False
        retried = sum(self.proxy.injected().values()) > before
        self.outcomes[(what.split()[0], "after retries" if retried else "first try")] += 1
        if check is not None:
            try:
                check(value)
            except AssertionError as exc:
                self.wrong.append(f"{what}: wrong result: {exc}")
        return True

    def run(self) -> None:
        for r in range(ROUNDS):
            seed = 1000 * self.index + r
            name = f"r{r}"
            state = small_state(seed)
            url = f"{self.repo_url}/{name}"
            if self.op(f"save {url}", lambda: ckptfmt.save(state, url, step=r, chunk_size=65536,
                                                           storage_options=self.options)):
                self.committed[name] = state
            else:
                self.failed_saves.append(name)
            latest = self.committed[max(self.committed, key=lambda n: int(n[1:]))] if self.committed else None
            if name in self.committed:
                self.op(f"load {url}", lambda: ckptfmt.load(url, storage_options=self.options),
                        lambda loaded: assert_same(state, loaded))
                self.op(f"get_tensor {url}", lambda: self.get_tensor(url, "w"),
                        lambda tensor: assert_same(state["w"], tensor))
                self.op(f"verify {url}", lambda: ckptfmt.verify(url, storage_options=self.options),
                        lambda report: self.check_report(report, [name]))
            if latest is not None:  # the repository's latest checkpoint, found by listing and reading commits
                self.op(f"load {self.repo_url}", lambda: ckptfmt.load(self.repo_url, storage_options=self.options),
                        lambda loaded: assert_same(latest, loaded))

    def get_tensor(self, url: str, key: str) -> torch.Tensor:
        with ckptfmt.open(url, storage_options=self.options) as reader:
            return reader.get_tensor(key)

    @staticmethod
    def check_report(report, names) -> None:
        assert report.ok and report.checkpoints == names, report.problems


@pytest.mark.exhaustive  # about 40 s each; make test runs the directed fault tests above
@pytest.mark.parametrize("workers", [pytest.param(WORKERS // 2, id="half"), pytest.param(WORKERS, id="full")])
def test_operations_under_random_faults(s3_bucket, make_s3_proxy, workers):
    """Saves, loads, get_tensor and verifies through proxies failing 30% of requests in every way:
    each operation is right or raises a CheckpointError, in bounded time; a failed save leaves no
    commit record, a successful one verifies and loads bit-exact through a fault-free client.
    make test-exhaustive (which .ci/run runs after make test) soaks with half the workers and with
    all (fewer than half saw no operation fail, now and then, so the failure paths went unchecked)."""
    watchdog = Watchdog()
    soaks = []
    for i in range(workers):
        proxy = make_s3_proxy(seed=i, stall_s=0.6)
        options = {**through(proxy, retries=FEW_RETRIES), "read_tries": 1} if i % 2 else through(proxy)
        soaks.append(Soak(i, f"{s3_bucket}/soak/w{i}", proxy, watchdog, options))
        proxy.set_faults(FAULT_RATE)
    started = time.monotonic()
    threads = [threading.Thread(target=soak.run, name=f"soak {soak.index}", daemon=True) for soak in soaks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(ROUNDS * 5 * OPERATION_LIMIT_S)
        assert not thread.is_alive(), "a worker is stuck"
    elapsed = time.monotonic() - started
    for soak in soaks:
        soak.proxy.set_faults(0.0)

    injected = sum((soak.proxy.injected() for soak in soaks), Counter())
    by_kind = Counter()
    by_op = Counter()
    for (kind, op), n in injected.items():
        by_kind[kind] += n
        by_op[op] += n
    outcomes = sum((soak.outcomes for soak in soaks), Counter())
    requests = sum((soak.proxy.requests() for soak in soaks), Counter())
    durations = sorted(watchdog.durations)
    print(f"\n{len(durations)} operations in {elapsed:.1f} s over {sum(requests.values())} requests "
          f"{dict(requests)}; faults injected: {sum(by_kind.values())}, by kind {dict(by_kind)}, "
          f"by operation {dict(by_op)}")
    for what in ("save", "load", "get_tensor", "verify"):
        print(f"  {what:10} " + ", ".join(f"{how}: {outcomes[(what, how)]}"
                                          for how in ("first try", "after retries", "failed cleanly")))
    print(f"  operation time: p50 {statistics.median(durations):.2f} s, "
          f"p90 {durations[int(0.9 * len(durations))]:.2f} s, max {durations[-1]:.2f} s")

    assert [w for soak in soaks for w in soak.wrong] == []
    assert [e for soak in soaks for e in soak.proxy.errors] == []
    assert sum(by_kind.values()) >= 40 * workers
    assert set(by_kind) == set(RANDOM_KINDS), by_kind
    assert {"GET", "PUT", "HEAD", "LIST"} <= set(by_op), by_op
    for how in ("after retries", "failed cleanly"):
        assert sum(outcomes[(w, how)] for w in ("save", "load", "get_tensor", "verify")) > 0, how

    # Through a fault-free client: committed saves are complete, failed ones left no commit record.
    for soak in soaks:
        repo = Repository.open(soak.repo_url)
        assert repo.names() == sorted(soak.committed)
        for name, state in soak.committed.items():
            assert_same(state, ckptfmt.load(f"{soak.repo_url}/{name}"))
        for name in soak.failed_saves:
            assert not commit_exists(soak.repo_url, name)
        assert ckptfmt.verify(soak.repo_url).ok


# -- two writer processes racing for one name ----------------------------------------------------

#: Races per test: 10 in make test, 50 in make test-exhaustive (the README's figures).
RACE_ROUNDS = [pytest.param(10, id="10-races"), pytest.param(50, id="50-races", marks=pytest.mark.exhaustive)]
MESSAGE_TIMEOUT_S = 60


class RaceWorker:
    """A long-lived writer process (tests/scripts/s3_race_worker.py) and a thread collecting its messages."""

    def __init__(self, log: Path):
        self.log = log
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "scripts" / "s3_race_worker.py")], cwd=ROOT, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))
        self.messages.put(None)

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        try:
            message = self.messages.get(timeout=MESSAGE_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"writer silent for {MESSAGE_TIMEOUT_S} s: {self.log.read_text()[-3000:]}") from None
        if message is None:
            raise AssertionError(f"writer exited: {self.log.read_text()[-3000:]}")
        return message

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def race_workers(s3_server, tmp_path_factory):
    """Two writer processes, shared by the race tests of this module (started with the AWS settings of s3_server)."""
    logs = tmp_path_factory.mktemp("race-writers")
    workers = [RaceWorker(logs / f"writer-{i}.log") for i in range(2)]
    try:
        for worker in workers:
            assert worker.receive() == {"started": True}
        yield workers
    finally:
        for worker in workers:
            worker.close()


def race(workers: list[RaceWorker], url: str, seeds: tuple[int, int], options: dict | None) -> list[dict]:
    """Both writers save ``url``; released together once both have their chunks written."""
    for i, worker in enumerate(workers):
        worker.send(json.dumps({"url": url, "writer": i, "seed": seeds[i], "options": options}))
    first = [worker.receive() for worker in workers]
    for worker, message in zip(workers, first):
        if message.get("ready"):
            worker.send("go")
    return [worker.receive() if message.get("ready") else message for worker, message in zip(workers, first)]


def run_races(workers: list[RaceWorker], repo_url: str, options: dict | None, rounds: int) -> Counter:
    """``rounds`` races for fresh names; checks each through a fault-free client. Returns how losers lost."""
    from tests.support.races import race_state

    ckptfmt.save({"x": 0}, f"{repo_url}/base")  # the repository exists before the first race
    lost = Counter()
    started = time.monotonic()
    for r in range(rounds):
        name = f"race-{r}"
        seeds = (2 * r, 2 * r + 1)
        outcomes = race(workers, f"{repo_url}/{name}", seeds, options)
        winners = [i for i, outcome in enumerate(outcomes) if outcome["outcome"] == "committed"]
        assert len(winners) == 1, (name, outcomes)
        winner = winners[0]
        loser = outcomes[1 - winner]
        assert loser["exists"], (name, outcomes)  # a CheckpointExistsError, nothing else
        lost["store ignored the condition" if "did not honour" in loser["message"] else "already exists"] += 1
        assert_same(race_state(winner, seeds[winner]), ckptfmt.load(f"{repo_url}/{name}"))
    report = ckptfmt.verify(repo_url)
    assert report.ok and len(report.checkpoints) == rounds + 1
    print(f"\n{rounds} races in {time.monotonic() - started:.1f} s: one winner each; losers: {dict(lost)}")
    return lost


@pytest.mark.parametrize("rounds", RACE_ROUNDS)
def test_two_processes_race_for_one_name(s3_bucket, race_workers, rounds):
    """Two processes save the same name at the same moment, again and again: each time exactly one commits,
    the other raises CheckpointExistsError, and the checkpoint is the winner's, complete.
    moto honours If-None-Match but checks then writes without a lock; when both conditional PUTs
    pass, the read-back of the commit record settles it."""
    run_races(race_workers, f"{s3_bucket}/race", None, rounds)


@pytest.mark.parametrize("rounds", RACE_ROUNDS)
def test_two_processes_race_on_a_store_ignoring_conditional_writes(s3_bucket, s3_proxy, race_workers, rounds):
    """The same race through a proxy that strips If-None-Match: both commit PUTs land, the later
    one replaces the earlier. No writer may report success while the record is another's: the
    one whose record was replaced sees it on reading back and raises CheckpointExistsError saying
    the store ignored the condition.

    What is not guaranteed without conditional writes: the read-back catches a rival PUT only
    if it lands before the second read (create_settle_s after the first). A rival delayed longer
    (a stalled request, a paused process) replaces a record whose writer already reported
    success: both report success and the later one stands. Only a store that honours
    If-None-Match (AWS S3) closes that window.
    """
    s3_proxy.strip_if_none_match = True
    lost = run_races(race_workers, f"{s3_bucket}/race", {"client_kwargs": {"endpoint_url": s3_proxy.url}},
                     rounds)
    assert s3_proxy.stripped >= rounds  # the commit PUTs really went out unconditional
    assert lost["store ignored the condition"] > 0  # both creates succeeded: the read-back decided
    assert s3_proxy.errors == []
