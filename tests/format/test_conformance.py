"""spec/conformance/: every case read by ckptfmt and by tests/support/spec_reader.py (written from the spec
alone), as a reader in another language runs it (spec/conformance/README.md): an accepted checkpoint gives
every tensor's dtype, shape and sha256 and the metadata recorded in cases.json; a refused one is refused
with the problem named, when opened or when its tensors are read. The parity cases (spec 5.6) are rebuilt
bit for bit by ``ckptfmt.repair`` and by the spec reader's repairer, or refused by both, nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import ckptfmt
from tests.corpus.typed_json import describe_tensor
from tests.support import spec_reader

CONFORMANCE = Path(__file__).resolve().parents[2] / "spec" / "conformance"
CASES = json.loads((CONFORMANCE / "cases.json").read_text())["cases"]
#: The problems a case names, as ckptfmt's errors.
PROBLEMS = {"corrupt-data": ckptfmt.CorruptDataError, "invalid-manifest": ckptfmt.ManifestError,
            "unsupported-version": ckptfmt.UnsupportedVersionError, "signature": ckptfmt.SignatureError,
            "missing-object": ckptfmt.CheckpointNotFoundError}


#: The problems of a repair from parity (spec 5.6, ``"when": "rebuild"``), as the spec reader's errors.
REBUILD_PROBLEMS = {"not-rebuildable": spec_reader.NotRebuildable, "not-committed": FileNotFoundError,
                    "invalid-manifest": AssertionError, "corrupt-data": AssertionError}

READ = [case for case in CASES if case["expect"] != "rebuild" and case.get("when") != "rebuild"]
REFUSED = [case for case in CASES if case["expect"] == "refuse"]
#: The parity cases: rebuilt, or refused when rebuilt.
PARITY = [case for case in CASES if case["expect"] == "rebuild" or case.get("when") == "rebuild"]


def copied(case: dict, tmp_path: Path) -> tuple[dict, Path, list[Path]]:
    """A case, a copy of its repository (whatever a reader does, the suite stays as written), its keys."""
    repo = tmp_path / "repo"
    shutil.copytree(CONFORMANCE / case["repository"], repo)
    return case, repo, [CONFORMANCE / key for key in case.get("trusted_keys", [])]


@pytest.fixture(params=READ, ids=[case["name"] for case in READ])
def case(request, tmp_path) -> tuple[dict, Path, list[Path]]:
    return copied(request.param, tmp_path)


@pytest.fixture(params=PARITY, ids=[case["name"] for case in PARITY])
def parity_case(request, tmp_path) -> tuple[dict, Path, list[Path]]:
    return copied(request.param, tmp_path)


@pytest.fixture(params=REFUSED, ids=[case["name"] for case in REFUSED])
def refused_case(request, tmp_path) -> tuple[dict, Path, list[Path]]:
    return copied(request.param, tmp_path)


def test_every_repository_has_a_case_and_every_problem_a_name():
    assert {case["repository"] for case in CASES} == {f"repos/{p.name}" for p in (CONFORMANCE / "repos").iterdir()}
    assert {case["problem"] for case in READ if case["expect"] == "refuse"} == set(PROBLEMS)
    assert {case["problem"] for case in PARITY if case["expect"] == "refuse"} == set(REBUILD_PROBLEMS)
    assert {case["expect"] for case in CASES} == {"accept", "refuse", "rebuild"}
    assert len({case["name"] for case in CASES}) == len(CASES)


def read_all(repo: Path, case: dict, keys: list[Path]) -> dict[str, dict]:
    """Open the case's checkpoint with ckptfmt and describe every tensor."""
    with ckptfmt.open(repo / case["checkpoint"], trusted_keys=keys or None) as reader:
        found = {key: _described(reader.get_tensor(key)) for key in reader.keys()}
        metadata = reader.metadata
    assert (metadata["step"], metadata["format_version"]) == (case["metadata"]["step"],
                                                               case["metadata"]["version"]), case["name"]
    return found


def _described(tensor) -> dict:
    found = describe_tensor(tensor)
    return {"dtype": found["dtype"], "shape": found["shape"], "sha256": found["sha256"]}


def test_ckptfmt_reads_or_refuses_each_case_as_recorded(case):
    case, repo, keys = case
    if case["expect"] == "accept":
        assert read_all(repo, case, keys) == case["tensors"]
        assert ckptfmt.verify(repo / case["checkpoint"], trusted_keys=keys or None).ok
        return
    refused = PROBLEMS[case["problem"]]
    if case["when"] == "open":
        with pytest.raises(refused):
            ckptfmt.open(repo / case["checkpoint"], trusted_keys=keys or None)
    else:
        ckptfmt.open(repo / case["checkpoint"], trusted_keys=keys or None).close()
        with pytest.raises(refused):
            ckptfmt.load(repo / case["checkpoint"], trusted_keys=keys or None)


def test_verify_finds_what_each_refused_case_breaks(refused_case):
    """verify reports the problem, or refuses the checkpoint outright as a reader does (a newer format)."""
    case, repo, keys = refused_case
    if case["problem"] == "not-committed":  # a save killed before its commit: no checkpoint to read or verify
        with pytest.raises(ckptfmt.CheckpointNotFoundError):
            ckptfmt.verify(repo / case["checkpoint"])
        return
    try:
        report = ckptfmt.verify(repo / case["checkpoint"], trusted_keys=keys or None)
    except PROBLEMS.get(case["problem"], ()):
        return
    assert not report.ok, case["name"]


def tensors_read(reader, keys) -> dict:
    """Each tensor's dtype, shape and the sha256 of its bytes, as the spec reader reads them."""
    found = {}
    for key in keys:
        entry, data = reader.tensor_bytes(key)
        found[key] = {"dtype": entry["dtype"], "shape": entry["shape"], "sha256": hashlib.sha256(data).hexdigest()}
    return found


def test_the_reader_written_from_the_spec_agrees(case):
    """The spec's second reader checks no signatures (spec 10.3 is optional for a reader given no key)."""
    case, repo, keys = case
    if case["expect"] == "accept":
        reader = spec_reader.SpecReader(repo, case["checkpoint"])
        assert tensors_read(reader, case["tensors"]) == case["tensors"]
        assert spec_reader.json_image(reader.value_tree()) == case["state"]
        assert {f: reader.manifest.get(f) for f in case["metadata"]} == case["metadata"]
    elif case["problem"] != "signature":
        with pytest.raises(Exception):  # noqa: B017 - the spec reader refuses by any failed check
            reader = spec_reader.SpecReader(repo, case["checkpoint"])
            reader.value_tree()
            for entry in reader.tensors:
                reader.tensor_bytes(entry["key"])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _as_stored(repo: Path) -> dict[str, bytes]:
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()}


def test_ckptfmt_repair_rebuilds_from_parity_bit_for_bit_or_writes_nothing(parity_case, tmp_path):
    """Rebuilt: every lost object is back with the recorded sha256 (the commit record with the recorded
    members), the repair names exactly those, and the checkpoint reads and verifies as recorded. Refused:
    not one lost object is written back, and nothing is written outside the repository."""
    case, repo, keys = parity_case
    before = _as_stored(repo)
    report = ckptfmt.repair(repo)
    if case["expect"] == "rebuild":
        assert report.ok, report.unrepaired
        assert {key: _sha256(repo / key) for key in case["rebuilt"]} == case["rebuilt"]
        fixed = {fix.key for fix in report.fixed}
        assert fixed == set(case["lost"]), fixed ^ set(case["lost"])
        if "commit" in case:
            assert json.loads((repo / case["checkpoint"] / "COMMIT").read_bytes()) == case["commit"]
        assert read_all(repo, case, keys) == case["tensors"]
        assert ckptfmt.verify(repo / case["checkpoint"]).ok
        return
    if case["problem"] == "not-rebuildable":
        assert not report.ok and all("rebuilds at most" in entry.tried for entry in report.unrepaired)
    elif case["problem"] != "not-committed":  # a record broken or damaged: no good copy of it
        assert not report.ok and any(entry.kind == "parity" for entry in report.unrepaired)
    after = _as_stored(repo)
    assert {key: after.get(key) for key in case["lost"]} == {key: before.get(key) for key in case["lost"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_the_repairer_written_from_the_spec_rebuilds_or_refuses_alike(parity_case):
    """The spec reader's repairer (spec 5.6 alone, reedsolo's GF(2^8) arithmetic) rebuilds exactly the lost
    objects, to the recorded sha256; the checkpoint then reads, in memory, to the recorded tensors. A refused
    case is refused for the reason named."""
    case, repo, _ = parity_case
    if case["expect"] == "refuse":
        with pytest.raises(REBUILD_PROBLEMS[case["problem"]]) as refused:
            spec_reader.ParityRepairer(repo, case["checkpoint"]).rebuild()
        assert case["problem"] == "not-rebuildable" or refused.type is not spec_reader.NotRebuildable
        return
    rebuilt = spec_reader.ParityRepairer(repo, case["checkpoint"]).rebuild()
    assert sorted(rebuilt) == case["lost"]
    commit = f"{case['checkpoint']}/COMMIT"
    assert {key: hashlib.sha256(data).hexdigest() for key, data in rebuilt.items() if key != commit} == case["rebuilt"]
    if "commit" in case:
        assert json.loads(rebuilt[commit]) == case["commit"]
    reader = spec_reader.SpecReader(repo, case["checkpoint"], objects=rebuilt)
    assert tensors_read(reader, case["tensors"]) == case["tensors"]
    assert spec_reader.json_image(reader.value_tree()) == case["state"]
