"""Self-healing from parity (spec 5.6), with no replica anywhere: `ckptfmt protect` adds K+M parity; verify
says of each damaged object whether parity rebuilds it; `ckptfmt repair` with no --from rebuilds up to M lost
or damaged objects a stripe bit for bit (chunks, manifests, commit records, whole folders, parity objects and
record copies), checks each before writing it and names what it cannot rebuild; gc, rm and sync know parity.
Local disk, memory:// and the S3 test server take one path."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections import Counter

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.format import layout
from ckptfmt.format.parity_record import record_key
from ckptfmt.lifecycle.gc import collect
from ckptfmt.lifecycle.protect import protect
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.repository.parity import RECORDS_DIR, read_record
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from ckptfmt.tools.verify import verify
from tests.corpus.generate import VERSIONS
from tests.support.helpers import assert_same
from tests.support.old_trees import ROOT, run_in_tree

pytestmark = pytest.mark.s3


def state(seed: int = 0) -> dict:
    """Tensors of a few sizes, dtypes and codecs' worth: most one chunk, the big one several."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{i}.w": torch.randn(200 + 50 * i, 64, generator=g) for i in range(10)}
    out["emb"] = torch.randn(3000, 64, generator=g).to(torch.bfloat16)
    out["big"] = torch.randn(600_000, generator=g)
    out["step"] = seed
    return out


def _parity_record(repo_url: str, name: str):
    repo = Repository.open(repo_url)
    commit = repo.commit(name)
    assert commit.parity is not None
    return read_record(repo.storage, name, commit.parity).record


def _stripes_of(record, key: str) -> set[int]:
    index = next(i for i, (k, _) in enumerate(record.objects) if k == key)
    return {s for s, stripe in enumerate(record.stripes) if any(p.obj == index for p in stripe.pieces)}


def _lose_per_stripe(record, count: int) -> list[str]:
    """Chunk keys to lose: ``count`` in some stripe, and never more than ``count`` in any."""
    lost: list[str] = []
    per_stripe: Counter = Counter()
    for key, _ in record.objects[1:]:  # the manifest stays: chunks only
        stripes = _stripes_of(record, key)
        if all(per_stripe[s] < count for s in stripes):
            lost.append(key)
            per_stripe.update(stripes)
    assert max(per_stripe.values()) == count
    return lost


def test_a_protected_checkpoint_survives_m_lost_objects_a_stripe_bit_for_bit(repo_url):
    saved = state(1)
    ckptfmt.save(saved, f"{repo_url}/a", chunk_size=2**20, compression="zstd")
    report = protect(repo_url, "4+2")
    assert [p.name for p in report.protected] == ["a"] and report.k == 4 and report.m == 2
    record = _parity_record(repo_url, "a")
    storage = open_storage(repo_url)
    lost = _lose_per_stripe(record, 2)
    assert len(lost) >= 3
    damaged, missing = lost[0], lost[1:]
    storage.write(damaged, b"\x00" + storage.read(damaged, max_size=2**30)[1:])
    storage.delete_many(missing)

    found = verify(repo_url)
    assert {p.key for p in found.problems} == set(lost)
    assert all(p.parity == "parity 4+2 can rebuild it" for p in found.problems)

    fixed = repair(repo_url)  # no --from: parity alone
    assert fixed.ok and not fixed.unrepaired, fixed.unrepaired
    assert sorted(f.key for f in fixed.fixed) == sorted(lost)
    assert {f.source for f in fixed.fixed} == {"parity 4+2 of a"}
    assert verify(repo_url).ok
    assert_same(saved, ckptfmt.load(f"{repo_url}/a"))


def test_more_than_m_lost_in_a_stripe_is_named_and_nothing_unchecked_is_written(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(2), f"{url}/a", chunk_size=2**20)
    protect(url, "4+1")
    record = _parity_record(url, "a")
    storage = open_storage(url)
    lost = _lose_per_stripe(record, 2)
    storage.delete_many(lost)
    found = verify(url)
    assert any("cannot rebuild it" in (p.parity or "") for p in found.problems)
    report = repair(url)
    assert not report.ok and report.unrepaired
    for entry in report.unrepaired:
        assert entry.key in lost and "rebuilds at most 1" in entry.tried
    unrepaired = {u.key for u in report.unrepaired}
    assert all(not storage.exists(key) for key in unrepaired)  # nothing written for what could not be rebuilt
    assert main(["repair", url]) == 1


def test_a_lost_manifest_commit_record_or_whole_folder_is_rebuilt(tmp_path):
    url = str(tmp_path / "repo")
    saved = state(3)
    ckptfmt.save(saved, f"{url}/a")
    protect(url, "3+1")
    storage = open_storage(url)
    commit = Repository.open(url).commit("a")
    manifest = layout.manifest_key("a", commit.manifest_hash)

    storage.delete(manifest)
    assert verify(url).problems[0].parity == "parity 3+1 can rebuild it"
    assert repair(url).ok
    assert_same(saved, ckptfmt.load(f"{url}/a"))

    storage.delete(layout.commit_key("a"))
    report = repair(url)
    assert report.ok and [f.kind for f in report.fixed] == ["commit-record"]
    assert Repository.open(url).commit("a") == commit

    storage.delete_many([k for k in storage.find("a")])  # the folder: commit record, manifest, record
    storage.remove_folder("a")
    report = repair(url)
    assert report.ok and sorted(f.kind for f in report.fixed) == ["commit-record", "manifest", "parity"]
    assert_same(saved, ckptfmt.load(f"{url}/a"))
    assert verify(url).ok


def test_damaged_parity_and_record_copies_are_reported_and_rebuilt(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(4), f"{url}/a")
    protect(url, "4+2")
    record = _parity_record(url, "a")
    storage = open_storage(url)
    damaged = record.stripes[0].keys[0]
    storage.write(damaged, b"junk")
    commit = Repository.open(url).commit("a")
    copy = f"{RECORDS_DIR}/a/parity-{commit.parity}.1.msgpack"
    storage.delete(copy)
    found = verify(url)
    kinds = {(p.kind, p.key): p.parity for p in found.problems}
    assert kinds[("bad-parity", damaged)] == "parity 4+2 can rebuild it"
    assert ("bad-parity", copy) in kinds
    report = repair(url)
    assert report.ok, report.unrepaired
    assert {f.key for f in report.fixed} == {damaged, copy}
    assert verify(url).ok


def test_a_save_killed_before_its_commit_is_not_brought_back(tmp_path):
    """Copies of the record outside the folder are written only after the commit: a folder with a record
    but no commit record (a save that died) stays uncommitted, and gc reclaims it."""
    url = str(tmp_path / "repo")
    ckptfmt.save(state(5), f"{url}/a")
    protect(url, "2+1")
    storage = open_storage(url)
    storage.delete_many([k for k in storage.find(RECORDS_DIR)])  # as before the commit
    storage.delete(layout.commit_key("a"))
    report = repair(url)
    assert not [f for f in report.fixed if f.kind == "commit-record"]
    assert Repository.open(url).names() == []
    collect(Repository.open(url))
    assert not storage.find(layout.PARITY_DIR) and not storage.list("a")


def test_gc_keeps_parity_while_a_checkpoint_uses_it_and_rm_leaves_nothing_to_resurrect(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(6), f"{url}/a")
    ckptfmt.save(state(7), f"{url}/b")
    protect(url, "4+2")
    storage = open_storage(url)
    before = storage.find(layout.PARITY_DIR)
    dry = collect(Repository.open(url), dry_run=True)
    assert dry.parity == 0 and dry.kept_parity == len(before)
    assert main(["rm", f"{url}/a"]) == 0
    assert not storage.list(f"{RECORDS_DIR}/a")  # no copy left to bring it back
    report = collect(Repository.open(url))
    a_parity = {k for k in before if not k.startswith(RECORDS_DIR)} - {
        key for s in _parity_record(url, "b").stripes for key in s.keys}
    assert report.parity == len(a_parity) and not any(storage.exists(k) for k in a_parity)
    assert verify(url).ok
    assert repair(url).ok and Repository.open(url).names() == ["b"]


def test_gc_refuses_while_a_lost_commit_is_proved_by_a_record_copy(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(8), f"{url}/a")
    protect(url, "2+1")
    storage = open_storage(url)
    storage.delete(layout.commit_key("a"))
    with pytest.raises(ckptfmt.CheckpointError, match="rebuilds it from parity"):
        collect(Repository.open(url))
    assert repair(url).ok and Repository.open(url).names() == ["a"]


def test_protect_again_with_another_code_replaces_the_parity(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(9), f"{url}/a")
    protect(url, "4+2")
    first = Repository.open(url).commit("a").parity
    assert protect(url, "4+2").unchanged == ["a"]
    protect(url, "6+3")
    commit = Repository.open(url).commit("a")
    storage = open_storage(url)
    assert commit.parity != first and not storage.exists(record_key("a", first))
    assert len(storage.list(f"{RECORDS_DIR}/a")) == 3
    collect(Repository.open(url))
    record = _parity_record(url, "a")
    assert {k for k in storage.find(layout.PARITY_DIR) if not k.startswith(RECORDS_DIR)} == {
        key for s in record.stripes for key in s.keys}
    assert verify(url).ok


def test_sync_copies_parity_with_the_chunks(tmp_path, backend, repo_url):
    src = str(tmp_path / "src")
    saved = state(10)
    ckptfmt.save(saved, f"{src}/a")
    protect(src, "4+2")
    replicate(src, repo_url)
    assert Repository.open(repo_url).commit("a").parity == Repository.open(src).commit("a").parity
    found = verify(repo_url)
    assert found.ok and found.protected == ["a"] and found.parity_bytes_checked > 0
    storage = open_storage(repo_url)
    lost = sorted(k for k in storage.find(layout.CHUNKS_DIR))[0]
    storage.delete(lost)
    assert repair(repo_url).ok
    assert_same(saved, ckptfmt.load(f"{repo_url}/a"))


def test_signatures_stay_valid_when_a_checkpoint_is_protected(tmp_path):
    from ckptfmt.lifecycle.signing import generate_key

    url = str(tmp_path / "repo")
    private, public, _ = generate_key(tmp_path / "key")
    ckptfmt.save(state(11), f"{url}/a", signer=private)
    protect(url, "2+1")
    assert verify(url, trusted_keys=[public]).ok


def test_the_cli_protects_verifies_and_repairs(tmp_path, capsys):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(12), f"{url}/a")
    assert main(["protect", url, "--parity", "4+1"]) == 0
    out = capsys.readouterr().out
    assert "protected 1 checkpoint with parity 4+1" in out and "of parity (" in out
    assert main(["ls", url]) == 0
    assert "1 checkpoint; parity " in capsys.readouterr().out  # the space it takes
    assert main(["protect", f"{url}/a", "--parity", "4+1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unchanged"] == ["a"] and doc["k"] == 4 and doc["m"] == 1
    assert main(["protect", url, "--parity", "300+2"]) == 2
    assert "K and M" in capsys.readouterr().err
    storage = open_storage(url)
    storage.delete(sorted(storage.find(layout.CHUNKS_DIR))[0])
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"parity can rebuild 1 of them: ckptfmt repair {url}" in out
    assert main(["repair", url]) == 0
    assert "repaired 1 object" in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert "of parity" in capsys.readouterr().out


def test_save_and_async_save_protect_from_the_start(tmp_path):
    url = str(tmp_path / "repo")
    saved = state(13)
    ckptfmt.save(saved, f"{url}/a", parity="4+2", compression="zstd")
    ckptfmt.async_save(state(14), f"{url}/b", parity="2+1").result(timeout=120)
    repo = Repository.open(url)
    assert _parity_record(url, "a").k == 4 and _parity_record(url, "b").m == 1
    found = verify(url)
    assert found.ok and found.protected == ["a", "b"]
    storage = open_storage(url)
    assert len(storage.list(f"{RECORDS_DIR}/a")) == 2 and len(storage.list(f"{RECORDS_DIR}/b")) == 1
    lost = _lose_per_stripe(_parity_record(url, "a"), 1)  # and the manifest: two in its stripe
    storage.delete_many(lost)
    storage.delete(layout.manifest_key("a", repo.commit("a").manifest_hash))
    assert repair(url).ok
    assert_same(saved, ckptfmt.load(f"{url}/a"))


def test_parity_options_are_checked_before_anything_is_written(tmp_path):
    url = str(tmp_path / "repo")
    with pytest.raises(ValueError, match="K\\+M"):
        ckptfmt.save(state(15), f"{url}/a", parity="8")
    with pytest.raises(ValueError, match="parity= needs format 2.1"):
        ckptfmt.save(state(15), f"{url}/a", parity="8+2", format_version="2.0")
    with pytest.raises(ValueError, match="node-scoped"):
        ckptfmt.save(state(15), f"{url}/a", parity="8+2", scope="node")
    assert not (tmp_path / "repo").exists()


def test_the_manager_protects_each_tier_with_its_own_parity(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    manager = ckptfmt.CheckpointManager(tiers=[fast, ckptfmt.Tier(slow, parity="4+1")], keep_last=3,
                                        parity="2+1", housekeeping="thread")
    for step in (1, 2):
        manager.save(step, state(step))
    manager.wait()
    manager.close()
    names = Repository.open(slow).names()
    assert len(names) == 2
    for name in names:
        fast_record, slow_record = _parity_record(fast, name), _parity_record(slow, name)
        assert (fast_record.k, fast_record.m) == (2, 1) and (slow_record.k, slow_record.m) == (4, 1)
    assert verify(fast).ok and verify(slow).ok
    storage = open_storage(slow)
    storage.delete(sorted(storage.find(layout.CHUNKS_DIR))[0])
    assert repair(slow).ok
    with pytest.raises(ValueError, match="peer copies"):
        ckptfmt.Tier(fast, scope="node", parity="2+1")


def test_k_of_one_keeps_m_copies_and_equal_parity_bytes_stay_apart(tmp_path):
    """With K=1 every parity piece equals the data piece (G's rows are all 1): each place is its own object,
    so losing the data and M-1 of its copies still rebuilds it."""
    url = str(tmp_path / "repo")
    saved = state(16)
    ckptfmt.save(saved, f"{url}/a", parity="1+2")
    record = _parity_record(url, "a")
    stripe = next(s for s in record.stripes if s.pieces[0].length == s.length)
    assert stripe.parity[0] == stripe.parity[1] and stripe.keys[0] != stripe.keys[1]
    storage = open_storage(url)
    storage.delete_many([record.objects[stripe.pieces[0].obj][0], stripe.keys[0]])
    assert repair(url).ok
    assert_same(saved, ckptfmt.load(f"{url}/a"))


#: What ckptfmt 1.0.0 (format 2.0, before parity) does with a protected 2.1 repository: lists, verifies and
#: loads every checkpoint, then removes "a" and collects the garbage its own way.
OLD_READER = """
import hashlib, json, sys
import torch, ckptfmt
from ckptfmt.lifecycle.gc import collect, remove
url = sys.argv[1]
repo = ckptfmt.Repository.open(url)
tensors = {}
for name in repo.names():
    for key, value in ckptfmt.load(f"{url}/{name}").items():
        if isinstance(value, torch.Tensor):
            data = value.contiguous().view(torch.uint8).numpy().tobytes()
            tensors[f"{name}/{key}"] = hashlib.sha256(data).hexdigest()
report = ckptfmt.verify(url)
remove(repo, ["a"])
collect(repo)
print(json.dumps({"names": repo.names(), "tensors": tensors, "ok": report.ok,
                  "problems": [str(p) for p in report.problems]}))
"""


@pytest.mark.skipif(subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() != "false", reason="needs the repository's history")
def test_ckptfmt_of_format_2_0_reads_a_protected_repository_and_its_gc_keeps_the_parity(tmp_path):
    url = str(tmp_path / "repo")
    ckptfmt.save(state(17), f"{url}/a", parity="2+1")
    saved = state(18)
    ckptfmt.save(saved, f"{url}/b", parity="2+1")
    expected = {f"{name}/{key}": hashlib.sha256(value.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for name in ("a", "b") for key, value in ckptfmt.load(f"{url}/{name}").items()
                if isinstance(value, torch.Tensor)}
    found = run_in_tree(VERSIONS["2.0"], OLD_READER, url, timeout=300)
    assert found["ok"] and not found["problems"] and found["tensors"] == expected
    assert found["names"] == ["b"]
    # What the old collector left: b's parity whole, and a's parity and record copies (it knows no parity).
    # Today's repair rebuilds b from it and takes a's copies for what they are, the leftovers of a removal
    # its history records (not a lost commit); today's gc then takes what is a's.
    storage = open_storage(url)
    assert storage.list(f"{RECORDS_DIR}/a")
    lost = _lose_per_stripe(_parity_record(url, "b"), 1)
    storage.delete_many(lost)
    report = repair(url)
    assert report.ok and sorted(f.key for f in report.fixed) == sorted(lost)
    assert_same(saved, ckptfmt.load(f"{url}/b"))
    collect(Repository.open(url))
    assert not storage.list(f"{RECORDS_DIR}/a")
    assert {k for k in storage.find(layout.PARITY_DIR) if not k.startswith(RECORDS_DIR)} == {
        key for s in _parity_record(url, "b").stripes for key in s.keys}
