"""Whatever any ckptfmt wrote is read forever: today's ckptfmt reads the corpus of every past format version
(tests/corpus/, written by the commits that introduced them) and finds what each writer said it saved
(expected.json): every checkpoint listed and verified, every tensor and plain value bit for bit, codecs,
signatures and step as written. A corpus file missing or changed fails the test too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ckptfmt
from tests.corpus import typed_json
from tests.corpus.generate import KEY, VERSIONS, file_hashes, folder

CORPUS = KEY.parents[1]
PUBLIC_KEY = KEY.with_name(KEY.name + ".pub")


def test_every_version_of_the_table_has_a_folder_and_nothing_else_does():
    assert sorted(CORPUS.glob("v*")) == sorted(folder(version) for version in VERSIONS)


@pytest.fixture(scope="module", params=list(VERSIONS))
def corpus(request, tmp_path_factory) -> tuple[Path, dict]:
    """A version's repository (a copy: whatever today's reader does, the corpus stays as written) and its
    expected.json, once the corpus files are found exactly as the generator wrote them."""
    version = request.param
    written = folder(version)
    expected = json.loads((written / "expected.json").read_text())
    assert (expected["version"], expected["commit"]) == (version, VERSIONS[version])
    assert_same_files(written / "repo", expected["files"])
    repo = tmp_path_factory.mktemp(f"v{version}") / "repo"
    shutil.copytree(written / "repo", repo)
    return repo, expected


def assert_same_files(root: Path, expected: dict[str, str]) -> None:
    found = file_hashes(root)
    differences = {"missing": sorted(set(expected) - set(found)), "unknown": sorted(set(found) - set(expected)),
                   "changed": sorted(p for p in set(expected) & set(found) if found[p] != expected[p])}
    assert differences == {"missing": [], "unknown": [], "changed": []}, f"{root}: corpus files differ"


def test_every_checkpoint_is_listed_and_verifies(corpus):
    """The repository's checkpoints in the order saved; verify of the repository (every chunk, the recorded
    statistics recomputed) and of each checkpoint finds nothing wrong."""
    repo, expected = corpus
    names = list(expected["checkpoints"])
    assert [record.name for record in ckptfmt.Repository.open(repo).commits()] == names
    report = ckptfmt.verify(repo, stats=True)
    assert report.ok, [str(problem) for problem in report.problems]
    assert sorted(report.checkpoints) == sorted(names)
    assert report.chunks_checked == len({p for p in expected["files"] if p.startswith("chunks/")})
    assert report.warnings == []
    for name in names:
        report = ckptfmt.verify(repo / name)
        assert (report.ok, report.checkpoints, report.warnings) == (True, [name], []), name


def test_every_value_loads_bit_for_bit(corpus):
    repo, expected = corpus
    for name, written in expected["checkpoints"].items():
        found: dict = {}
        assert_same(typed_json.encode(ckptfmt.load(repo / name), found), written["state"], name)
        assert list(found) == list(written["tensors"]), name
        for key, tensor in found.items():
            assert_tensor(tensor, written["tensors"][key], f"{name}: {key}")


def test_every_tensor_reads_alone_with_the_metadata_as_written(corpus):
    repo, expected = corpus
    for name, written in expected["checkpoints"].items():
        with ckptfmt.open(repo / name) as reader:
            keys = reader.keys()
            assert keys == list(written["tensors"]), name
            for key, tensor in written["tensors"].items():
                assert_tensor(reader.get_tensor(key), tensor, f"{name}: {key}")
                same_as = reader.tensor_info(key).same_as
                assert (keys[same_as] if same_as is not None else None) == tensor.get("same_as"), f"{name}: {key}"
            assert sorted({chunk.codec for chunk in reader.manifest.chunks}) == written["codecs"], name
            metadata = reader.metadata
        assert (metadata["step"], metadata["format_version"]) == (written["step"], written["format_version"]), name
        assert_same(typed_json.encode(metadata["user"]), written["metadata"], f"{name}: metadata")


def test_a_checkpoint_opens_for_the_key_that_signed_it_only(corpus, tmp_path):
    """From 1.7 the values checkpoint is signed with the test key: it opens and verifies for a reader that
    trusts that key; no other checkpoint of any version does, and another key's trust opens none."""
    repo, expected = corpus
    signed = {name for name, written in expected["checkpoints"].items() if written["signed_by"]}
    assert bool(signed) == (tuple(map(int, expected["version"].split("."))) >= (1, 7))
    ckptfmt.generate_key(tmp_path / "other.pem")
    for name, written in expected["checkpoints"].items():
        if name in signed:
            with ckptfmt.open(repo / name, trusted_keys=[PUBLIC_KEY]) as reader:
                assert reader.keys() == list(written["tensors"])
            assert ckptfmt.verify(repo / name, trusted_keys=[PUBLIC_KEY]).ok
        else:
            with pytest.raises(ckptfmt.SignatureError):
                ckptfmt.open(repo / name, trusted_keys=[PUBLIC_KEY])
        with pytest.raises(ckptfmt.SignatureError):
            ckptfmt.open(repo / name, trusted_keys=[tmp_path / "other.pem.pub"])


def assert_tensor(tensor, written: dict, where: str) -> None:
    found = typed_json.describe_tensor(tensor)
    assert found == {k: v for k, v in written.items() if k != "same_as"}, where


def assert_same(found: dict, written: dict, where: str) -> None:
    """Equal typed JSON; a difference is named by its path, not shown as two pages of JSON."""
    if found == written:
        return
    assert found.get("type") == written.get("type"), f"{where}: {found} != {written}"
    mine, theirs = found.get("items"), written.get("items")
    if not isinstance(mine, list) or not isinstance(theirs, list) or len(mine) != len(theirs):
        assert found == written, where
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b and isinstance(a, list):  # a map's [key, value] or a per-rank [rank, value]
            assert a[0] == b[0], f"{where}: key {b[0]} became {a[0]}"
            assert_same(a[1], b[1], f"{where}[{_label(b[0])}]")
        elif a != b:
            assert_same(a, b, f"{where}[{i}]")
    assert found == written, where


def _label(key) -> str:
    return json.dumps(key.get("value", key) if isinstance(key, dict) else key)


PARITY_FROM = (2, 1)


@pytest.mark.parametrize("version", [v for v in VERSIONS if tuple(map(int, v.split("."))) >= PARITY_FROM])
def test_the_parity_a_writer_wrote_rebuilds_what_it_protects(version, tmp_path):
    """From 2.1 the corpus' first checkpoint ("values") carries parity 2+1, as its writer computed it:
    today's repair rebuilds lost chunks and the lost manifest from it, bit for bit."""
    repo = tmp_path / "repo"
    shutil.copytree(folder(version) / "repo", repo)
    expected = json.loads((folder(version) / "expected.json").read_text())
    storage = ckptfmt.Repository.open(repo).storage
    commit = ckptfmt.Repository.open(repo).commit("values")
    assert commit.parity is not None
    from ckptfmt.repository.parity import read_record

    record = read_record(storage, "values", commit.parity).record
    stripe = record.stripes[0]
    lost = [record.objects[p.obj][0] for p in stripe.pieces[: record.m]]
    storage.delete_many(lost)
    report = ckptfmt.repair(repo)
    assert report.ok and sorted(f.key for f in report.fixed) == sorted(lost)
    assert_same_files(repo, expected["files"])  # the rebuilt objects are the written bytes


def test_reading_changed_no_file(corpus):
    """Run after the tests above for each version (pytest keeps a module fixture's tests together): today's
    reader wrote nothing into the old repository."""
    repo, expected = corpus
    assert_same_files(repo, expected["files"])
