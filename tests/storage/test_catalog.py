"""The commit index (spec 4.4): listing, latest and a save's parent lookup in a bounded number of requests,
and never a committed checkpoint hidden, whatever races, removals, old repositories or damage it meets."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import CheckpointExistsError, CheckpointNotFoundError, CheckpointWarning, UnsupportedVersionError
from ckptfmt.format import layout
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.limits import MAX_INDEX_PACK_BYTES
from ckptfmt.repository.index import (
    COMPACT_AT,
    ENTRIES_DIR,
    INDEX_DIR,
    PACKS_DIR,
    CommitIndex,
    Entry,
    PackRef,
    encode_pack,
)
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.saving.core import resolve_parent
from ckptfmt.saving.options import LATEST


def seeded(url: str, **options) -> Repository:
    """A repository holding one real checkpoint, 'seed', to clone."""
    ckptfmt.save({"w": torch.arange(4.0)}, f"{url}/seed", step=0, **options)
    return Repository.open(url, options.get("storage_options"))


def clone(repo: Repository, names: list[str], threads: int = 1) -> None:
    """Commit checkpoints ``names`` through the writer's last steps (manifest, then ``create_commit``):
    copies of the seed's manifest under each name, so that thousands take seconds, not a save each."""
    seed = repo.commit("seed")
    manifest = repo.manifest("seed", seed)

    def commit(name: str) -> None:
        copy = dataclasses.replace(manifest, name=name, created_ns=time.time_ns(), parent=None)
        data = copy.to_bytes()
        digest = chunk_hash(data)
        repo.storage.write(layout.manifest_key(name, digest), data)
        repo.create_commit(CommitRecord(name, digest, len(data), copy.step, copy.created_ns, None, copy.totals))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(commit, names))


@contextlib.contextmanager
def requests(storage):
    """The HTTP requests the storage's S3 client sends meanwhile, as 'METHOD path?query' lines."""
    sent: list[str] = []
    events = storage.fs.s3.meta.events

    def note(request, **_):
        sent.append(f"{request.method} {request.url.split('/', 3)[-1]}")

    events.register("before-send.s3", note)
    try:
        yield sent
    finally:
        events.unregister("before-send.s3", note)


def ls_json(url: str, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- bounded requests on S3 ---------------------------------------------------------------------


@pytest.mark.exhaustive  # 22 s of a moto server filled twice; make test checks the index on local and memory
def test_ls_latest_and_parent_lookup_make_bounded_requests(s3_bucket, capsys):
    """At 20 and 120 checkpoints: latest and the parent lookup cost the same few requests, ls one listing
    page per 1,000 checkpoints, one read per pack and at most COMPACT_AT commit records; without the
    index, each costs two requests per checkpoint."""
    counts = {}
    for n in (20, 120):
        url = f"{s3_bucket}/n{n}"
        repo = seeded(url)
        repo.storage.create_settle_s = 0  # the read-backs still run; only their pause goes
        names = [f"c{i:05d}" for i in range(n - 1)]
        clone(repo, names, threads=2)
        packs = len(repo.index.packs())
        with requests(repo.storage) as sent:
            listed = ls_json(url, capsys)
        ls_count = len(sent)
        assert sorted(r["name"] for r in listed) == sorted(names + ["seed"])
        newest = repo.commits(authority=True)[-1].name  # threads commit in any order
        with requests(repo.storage) as sent:
            assert Repository.open(url).latest() == newest
        latest_count = len(sent)
        with requests(repo.storage) as sent:
            parent, keys, _ = resolve_parent(Repository.open(url), LATEST)
        parent_count = len(sent)
        assert parent == newest and keys
        counts[n] = (ls_count, latest_count, parent_count, packs)

        repo.index_version = None  # the same repository read the pre-index way, for comparison
        with requests(repo.storage) as sent:
            assert len(repo.commits()) == n
        assert len(sent) >= n

    for n, (ls_count, latest_count, parent_count, packs) in counts.items():
        # marker (2), index listings (2, or 3 when one is empty), a pack, a commit record or two ...
        assert latest_count <= 7, counts
        assert parent_count <= 8, counts  # ... and the parent's manifest
        assert packs <= math.log2(n / COMPACT_AT) + 3, counts
        # marker (2), repository listing pages, index listings (2), packs, unpacked commit records
        assert ls_count <= 2 + math.ceil(n / 1000) + 2 + packs + COMPACT_AT + 1, counts


# -- behaviour on every backend ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", "memory", pytest.param("s3", marks=pytest.mark.exhaustive)])
def test_a_new_repository_is_indexed_and_lists_like_the_authority(repo_url, capsys):
    repo = seeded(repo_url)
    assert repo.indexed
    assert json.loads(repo.storage.read(layout.MARKER_KEY, max_size=4096))["index"] == 1
    names = [f"c{i:03d}" for i in range(COMPACT_AT + 5)]
    clone(repo, names)
    assert repo.index.packs(), "a writer compacts once COMPACT_AT entries wait"
    assert len(repo.index.entries()) < COMPACT_AT
    indexed = repo.commits()
    assert repo.names() == sorted(names + ["seed"])
    assert repo.latest() == names[-1] and repo.latest_record() == indexed[-1]
    assert [r["name"] for r in ls_json(repo_url, capsys)] == [r.name for r in indexed]
    assert indexed == repo.commits(authority=True)
    report = ckptfmt.verify(repo_url)
    assert report.ok and not any(INDEX_DIR in warning for warning in report.warnings)


@pytest.mark.parametrize("backend", ["local", "memory", pytest.param("s3", marks=pytest.mark.exhaustive)])
def test_removed_checkpoints_disappear(repo_url, capsys):
    repo = seeded(repo_url)
    names = [f"c{i:03d}" for i in range(COMPACT_AT + 2)]
    clone(repo, names)
    packed, loose = names[0], names[-1]
    repo.remove(packed)
    repo.remove(loose)
    assert repo.storage.list(packed) == [] and repo.storage.list(loose) == []
    assert packed not in repo.names() and loose not in [r["name"] for r in ls_json(repo_url, capsys)]
    assert repo.latest() == names[-2]
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        repo.remove(packed)
    # The name can be saved again: the new checkpoint is listed, not the packed record of the old one.
    ckptfmt.save({"w": torch.ones(2)}, f"{repo_url}/{packed}", step=99)
    assert next(r for r in repo.commits() if r.name == packed).step == 99
    assert repo.latest() == packed


def test_a_losing_or_unfinished_save_leaves_no_visible_entry(repo_url):
    repo = seeded(repo_url)
    seed = repo.commit("seed")
    rival = dataclasses.replace(seed, manifest_hash="1" * 64, created_ns=seed.created_ns + 10)
    repo.storage.exists = lambda key: False  # the rival checked before "seed" was committed
    with pytest.raises(CheckpointExistsError):
        repo.create_commit(rival)
    del repo.storage.exists
    assert repo.index.entries() == [Entry.of(seed)]  # the loser deleted its entry
    unfinished = dataclasses.replace(seed, name="later", created_ns=time.time_ns())
    repo.index.add(unfinished)  # a save that died between its entry and its commit record
    assert repo.latest() == "seed" and repo.names() == ["seed"]
    repo.index.compact()
    assert Entry.of(unfinished) in repo.index.entries(), "compaction keeps entries it cannot confirm"
    assert repo.rebuild_index() == 1
    assert repo.index.entries() == [] and repo.latest() == "seed"


def test_a_repository_without_index_still_lists_and_can_get_one(tmp_path, capsys):
    url = str(tmp_path / "old")
    repo = Repository.open(url, create=True)
    repo.storage.write(layout.MARKER_KEY, json.dumps({"format": "ckptfmt-repository", "version": [1, 2]}).encode())
    for i in range(3):
        ckptfmt.save({"w": torch.full((2,), float(i))}, f"{url}/s{i}", step=i)
    old = Repository.open(url)
    assert not old.indexed and not (tmp_path / "old" / INDEX_DIR).exists()
    assert old.names() == ["s0", "s1", "s2"] and old.latest() == "s2"
    assert [r["name"] for r in ls_json(url, capsys)] == ["s0", "s1", "s2"]
    assert old.rebuild_index() == 3
    new = Repository.open(url)
    assert new.indexed and new.latest() == "s2" and new.commits() == old.commits(authority=True)
    assert [p.count for p in new.index.packs()] == [3]


def test_an_index_of_an_unknown_version_is_not_used_nor_written(tmp_path):
    url = str(tmp_path / "repo")
    repo = seeded(url)
    repo.storage.write(layout.MARKER_KEY, json.dumps(
        {"format": "ckptfmt-repository", "version": [1, 9], "index": 2}).encode())
    future = Repository.open(url)
    assert not future.indexed and future.latest() == "seed"
    with pytest.raises(UnsupportedVersionError, match="commit index of version 2"):
        ckptfmt.save({}, f"{url}/next")
    with pytest.raises(UnsupportedVersionError):
        future.rebuild_index()


# -- races ------------------------------------------------------------------------------------


def test_a_compaction_between_a_readers_listings_hides_nothing(tmp_path, monkeypatch):
    """Readers list entries, then packs: a compaction in between moves entries into a pack that the
    second listing sees; a pack replaced between listing and reading makes the reader list again."""
    url = str(tmp_path / "repo")
    repo = seeded(url)
    names = [f"c{i:03d}" for i in range(COMPACT_AT - 2)]
    clone(repo, names)
    assert repo.index.packs() == []
    entries, packs = CommitIndex.entries, CommitIndex.packs
    compacted = []

    def then_compaction(listing):
        def listed_then_compacted(self):
            listed = listing(self)
            if not compacted:  # whichever listing comes first, a compaction runs right after it
                compacted.append(True)
                CommitIndex(self.storage, self.read_commit).compact()
            return listed
        return listed_then_compacted

    monkeypatch.setattr(CommitIndex, "entries", then_compaction(entries))
    monkeypatch.setattr(CommitIndex, "packs", then_compaction(packs))
    assert repo.latest() == names[-1]
    compacted.clear()
    assert repo.names() == sorted(names + ["seed"])
    assert len(CommitIndex.entries(repo.index)) == 0

    read_pack = CommitIndex.read_pack
    replaced = []

    def pack_replaced_before_read(self, ref):
        if not replaced:  # a rival compaction merges this pack into a newer one, then deletes it
            replaced.append(ref)
            records = read_pack(self, ref)
            self.write_packs(ref.seq + 1, records)
            self.storage.delete(ref.key)
        return read_pack(self, ref)

    monkeypatch.setattr(CommitIndex, "entries", entries)
    monkeypatch.setattr(CommitIndex, "packs", packs)
    monkeypatch.setattr(CommitIndex, "read_pack", pack_replaced_before_read)
    (tmp_path / "repo" / layout.commit_key(names[-1])).unlink()  # the newest is now in the pack only...
    for name in names[-3:-1]:
        repo.remove(name)
    assert repo.latest() == names[-4]  # ... and so is the next one
    assert replaced and len(repo.index.packs()) == 1


def test_saves_compactions_and_readers_racing(tmp_path):
    """Writers commit while two threads compact and readers list: every reader sees every checkpoint
    committed before it started, and a latest at least as new."""
    url = str(tmp_path / "repo")
    repo = seeded(url)
    stop = threading.Event()
    committed: list[str] = ["seed"]
    failures: list[str] = []

    def compact():
        while not stop.is_set():
            with contextlib.suppress(ckptfmt.CheckpointError):
                Repository.open(url).index.compact()

    def read():
        while not stop.is_set():
            before = list(committed)
            reader = Repository.open(url)
            names, latest = set(reader.names()), reader.latest_record()
            missing = set(before) - names
            if missing:
                failures.append(f"listing lost {sorted(missing)}")
            if latest.created_ns < reader.commit(before[-1]).created_ns:
                failures.append(f"latest {latest.name} older than {before[-1]}")

    workers = [threading.Thread(target=f) for f in (compact, compact, read, read)]
    for worker in workers:
        worker.start()
    try:
        for i in range(150):
            clone(repo, [f"c{i:03d}"])
            committed.append(f"c{i:03d}")
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert not failures, failures[:5]
    assert Repository.open(url).names() == sorted(committed)


# -- damage ------------------------------------------------------------------------------------


def indexed_repo(tmp_path, count: int = COMPACT_AT - 1) -> tuple[Repository, list[str]]:
    """A repository whose checkpoints are all in one pack (the seed and ``count`` more)."""
    repo = seeded(str(tmp_path / "repo"))
    names = [f"c{i:03d}" for i in range(count)]
    clone(repo, names)
    return repo, names


DAMAGE = {
    "garbage": lambda ref: b"\xff not json",
    "not a pack": lambda ref: b"[1, 2]",
    "deep nesting": lambda ref: b"[" * 100_000,
    "bad record": lambda ref: json.dumps({"format": "ckptfmt-index-pack", "version": [1, 2],
                                          "records": [{"format": "ckptfmt-commit", "name": "../x"}]}).encode(),
    "count differs from its key": lambda ref: encode_pack([]),
    "other major": lambda ref: json.dumps({"format": "ckptfmt-index-pack", "version": [3, 0],
                                           "records": []}).encode(),
    "oversized": lambda ref: b" " * (MAX_INDEX_PACK_BYTES + 1),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_pack_is_ignored_with_a_warning(tmp_path, damage, capsys):
    repo, names = indexed_repo(tmp_path)
    (ref,) = repo.index.packs()
    repo.storage.write(ref.key, DAMAGE[damage](ref))
    with pytest.warns(CheckpointWarning, match="damaged commit index pack"):
        assert repo.names() == sorted(names + ["seed"])
    with pytest.warns(CheckpointWarning, match="ignoring the commit index"):
        assert repo.latest() == names[-1]
    assert len(ls_json(str(tmp_path / "repo"), capsys)) == len(names) + 1
    assert repo.rebuild_index() == len(names) + 1
    assert len(repo.index.packs()) == 1 and repo.commits() == repo.commits(authority=True)


def test_forged_and_foreign_index_objects_change_nothing_that_matters(tmp_path, capsys):
    repo, names = indexed_repo(tmp_path)
    seed = repo.commit("seed")
    future = time.time_ns() + 10**12
    # An entry for a checkpoint that does not exist, one whose manifest differs, foreign keys:
    for name, digest in (("ghost", "2" * 64), ("seed", "3" * 64)):
        repo.storage.write(Entry(future, name, digest).key, b"")
    for key in (f"{ENTRIES_DIR}/README", f"{ENTRIES_DIR}/0.x.y", f"{PACKS_DIR}/notes.json", f"{PACKS_DIR}/..json"):
        repo.storage.write(key, b"hello")
    # A pack forging a newer record of a name without a folder.
    forged = dataclasses.replace(seed, name="phantom", created_ns=future)
    ref = PackRef(99, 1, future, "00000000")
    repo.storage.write(ref.key, encode_pack([forged]))
    assert repo.latest() == names[-1]
    assert "phantom" not in repo.names() and "ghost" not in repo.names()
    assert [r["name"] for r in ls_json(str(tmp_path / "repo"), capsys)] == ["seed"] + names
