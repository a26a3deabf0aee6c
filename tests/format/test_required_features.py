"""Required features (spec 13.2): every object that carries a version is refused as "written by a newer
ckptfmt; upgrade" when it requires a feature this reader does not know, before anything else of it is read
(an object that is also malformed is still "newer", never "damaged"); what it lists is checked; a 1.x
object has no ``requires``. The repository marker is refused when a repository is opened, and the CLI
says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.copies import CopyRecord
from ckptfmt.format.features import FEATURES, check_declared, version_fields
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.progress import Progress, ProgressKey
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.repository.index import PackRef, decode_pack, encode_pack
from ckptfmt.repository.leases import read_leases
from ckptfmt.repository.repository import Repository, marker_bytes, parse_marker

NEWER = "teleportation"
RECORD = CommitRecord(name="step-1", manifest_hash="ab" * 32, manifest_size=100, step=1, created_ns=5, parent=None,
                      totals={})


def _json_with(data: bytes, **changes) -> bytes:
    doc = json.loads(data)
    doc.update(changes)
    return json.dumps(doc).encode()


def _msgpack_with(data: bytes, **changes) -> bytes:
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    doc.update(changes)
    return msgpack.packb(doc, use_bin_type=True)


def commit_record(**changes):
    return CommitRecord.from_bytes(_json_with(RECORD.to_bytes(), **changes), "COMMIT")


def copy_record(**changes):
    data = CopyRecord("node-a", "ab" * 32, 5, 1, 10).to_bytes()
    return CopyRecord.from_bytes(_json_with(data, **changes), "copy-node-a.json")


def index_pack(**changes):
    data = _json_with(encode_pack([RECORD]), **changes)
    return decode_pack(data, PackRef(0, 1, 5, "t"), "pack")


def history(**changes):
    data = _msgpack_with(History("step-1", "ab" * 32, 1, 5, None, None, {}).to_bytes(), **changes)
    return History.from_bytes(data, HistoryKey(5, "step-1", chunk_hash(data)), "history")


def progress(**changes):
    data = _msgpack_with(Progress(5, 0, 7, "host", 6, None).to_bytes(), **changes)
    return Progress.from_bytes(data, ProgressKey(5, 0, 7), "progress")


def marker(**changes):
    return parse_marker(_json_with(marker_bytes((2, 0), frozenset()), **changes), "ckptfmt.json")


OBJECTS = {"commit record": commit_record, "copy record": copy_record, "index pack": index_pack,
           "history": history, "progress": progress, "marker": marker}


@pytest.mark.parametrize("read", OBJECTS.values(), ids=OBJECTS)
def test_each_object_reads_as_written_and_refuses_an_unknown_feature_as_newer(read):
    read()  # as written: format 2.0, requires []
    read(requires=["tensor-columns"])  # a known feature: nothing forbids listing one it does not use
    with pytest.raises(ckptfmt.UnsupportedVersionError, match=f"requires '{NEWER}': written by a newer ckptfmt; "
                                                              "upgrade to read it"):
        read(requires=[NEWER, "tensor-columns"])


@pytest.mark.parametrize("read", OBJECTS.values(), ids=OBJECTS)
def test_an_unknown_feature_is_reported_before_the_damage_it_may_explain(read):
    """A newer writer's object may well look malformed to this reader: "upgrade" comes first."""
    with pytest.raises(ckptfmt.UnsupportedVersionError):
        read(requires=[NEWER], created_ns="a new form", name=17, host=[], manifest={}, records=7, started_ns="x")


@pytest.mark.parametrize("read", OBJECTS.values(), ids=OBJECTS)
@pytest.mark.parametrize("requires", [None, "tensor-columns", ["a", "a"], [1]])
def test_a_malformed_requires_is_damage(read, requires):
    with pytest.raises(ckptfmt.CheckpointError) as caught:
        read(requires=requires)
    assert not isinstance(caught.value, ckptfmt.UnsupportedVersionError)


@pytest.mark.parametrize("read", OBJECTS.values(), ids=OBJECTS)
def test_a_1x_object_has_no_requires_and_any_is_ignored(read):
    """Format 1.x readers never knew ``requires``: a 1.x object's forms are read by their types (13.1)."""
    read(version=[1, 15], requires=[NEWER])


@pytest.mark.parametrize("read", OBJECTS.values(), ids=OBJECTS)
def test_a_newer_major_of_each_object_is_refused_as_newer(read):
    with pytest.raises(ckptfmt.UnsupportedVersionError, match="newer ckptfmt; upgrade"):
        read(version=[3, 0])


def test_the_names_refused_are_bounded():
    with pytest.raises(ckptfmt.UnsupportedVersionError) as caught:
        commit_record(requires=[f"f{i}" for i in range(40)])
    assert "and 35 more" in str(caught.value) and len(str(caught.value)) < 200


def test_a_feature_used_but_not_declared_is_malformed():
    check_declared({"tensor-columns"}, frozenset({"tensor-columns"}), (2, 0), "manifest")
    check_declared({"tensor-columns"}, frozenset(), (1, 15), "manifest")  # 1.x declares nothing
    with pytest.raises(ckptfmt.ManifestError, match="uses tensor-columns without declaring it"):
        check_declared({"tensor-columns"}, frozenset(), (2, 0), "manifest")


def test_every_feature_names_its_version_and_every_version_writes_only_its_own():
    assert all(feature.since <= FORMAT_VERSION for feature in FEATURES.values())
    assert version_fields((1, 6)) == {"version": [1, 6]}
    assert version_fields((2, 0), {"tensor-columns", "chunk-columns"}) == {
        "version": [2, 0], "requires": ["chunk-columns", "tensor-columns"]}


def test_a_lease_of_a_newer_writer_is_unreadable_so_it_holds(tmp_path):
    """A lease this reader cannot read counts as live for the collector (fail safe), as damage does."""
    ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "a")
    repo = Repository.open(tmp_path / "repo")
    lease = tmp_path / "repo" / "_leases" / "save-0123456789abcdef.json"
    lease.parent.mkdir(exist_ok=True)
    lease.write_text(json.dumps({"format": "ckptfmt-lease", "version": [2, 0], "requires": [NEWER], "kind": "save",
                                 "holder": "a newer writer", "expires_ns": 1}))
    records, unreadable = read_leases(repo)
    assert (records, unreadable) == ([], ["_leases/save-0123456789abcdef.json"])


@pytest.fixture
def newer_repository(tmp_path):
    """A repository whose marker requires a feature this reader lacks, as a newer writer leaves it."""
    ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "a")
    path = tmp_path / "repo" / "ckptfmt.json"
    path.write_bytes(_json_with(path.read_bytes(), requires=[NEWER]))
    return tmp_path / "repo"


def test_a_repository_whose_marker_needs_more_is_refused_when_opened(newer_repository):
    for call in (lambda: Repository.open(newer_repository), lambda: ckptfmt.open(newer_repository / "a"),
                 lambda: ckptfmt.load(newer_repository / "a"), lambda: ckptfmt.verify(newer_repository)):
        with pytest.raises(ckptfmt.UnsupportedVersionError, match=f"requires '{NEWER}'"):
            call()
    with pytest.raises(ckptfmt.UnsupportedVersionError):  # nor written into: it would drop what it cannot read
        ckptfmt.save({"w": torch.ones(2)}, newer_repository / "b")


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["show", "a"]])
def test_the_cli_says_upgrade_in_one_line(newer_repository, command):
    target = [str(newer_repository / command[1])] if len(command) > 1 else [str(newer_repository)]
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", command[0], *target], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "upgrade" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_a_save_that_raises_the_marker_warns_at_the_callers_line(tmp_path):
    """The warning names the readers it shuts out, and points at the user's save, not a line of ckptfmt."""
    ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "old", format_version="1.6")
    with pytest.warns(ckptfmt.CheckpointWarning, match="readers of format 1.6 now refuse it") as caught:
        ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "new")
    assert [warning.filename for warning in caught] == [__file__]
    assert Repository.open(tmp_path / "repo").format_version == FORMAT_VERSION
