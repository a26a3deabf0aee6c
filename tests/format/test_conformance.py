"""spec/conformance/: every case read by ckptfmt and by tests/support/spec_reader.py (written from the spec
alone), as a reader in another language runs it (spec/conformance/README.md): an accepted checkpoint gives
every tensor's dtype, shape and sha256 and the metadata recorded in cases.json; a refused one is refused
with the problem named, when opened or when its tensors are read."""

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


REFUSED = [case for case in CASES if case["expect"] == "refuse"]


def copied(case: dict, tmp_path: Path) -> tuple[dict, Path, list[Path]]:
    """A case, a copy of its repository (whatever a reader does, the suite stays as written), its keys."""
    repo = tmp_path / "repo"
    shutil.copytree(CONFORMANCE / case["repository"], repo)
    return case, repo, [CONFORMANCE / key for key in case.get("trusted_keys", [])]


@pytest.fixture(params=CASES, ids=[case["name"] for case in CASES])
def case(request, tmp_path) -> tuple[dict, Path, list[Path]]:
    return copied(request.param, tmp_path)


@pytest.fixture(params=REFUSED, ids=[case["name"] for case in REFUSED])
def refused_case(request, tmp_path) -> tuple[dict, Path, list[Path]]:
    return copied(request.param, tmp_path)


def test_every_repository_has_a_case_and_every_problem_a_name():
    assert {case["repository"] for case in CASES} == {f"repos/{p.name}" for p in (CONFORMANCE / "repos").iterdir()}
    assert {case["problem"] for case in CASES if case["expect"] == "refuse"} == set(PROBLEMS)
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
    try:
        report = ckptfmt.verify(repo / case["checkpoint"], trusted_keys=keys or None)
    except PROBLEMS[case["problem"]]:
        return
    assert not report.ok, case["name"]


def test_the_reader_written_from_the_spec_agrees(case):
    """The spec's second reader checks no signatures (spec 10.3 is optional for a reader given no key)."""
    case, repo, keys = case
    if case["expect"] == "accept":
        reader = spec_reader.SpecReader(repo, case["checkpoint"])
        found = {}
        for key in case["tensors"]:
            entry, data = reader.tensor_bytes(key)
            found[key] = {"dtype": entry["dtype"], "shape": entry["shape"], "sha256": hashlib.sha256(data).hexdigest()}
        assert found == case["tensors"]
        assert spec_reader.json_image(reader.value_tree()) == case["state"]
        assert {f: reader.manifest.get(f) for f in case["metadata"]} == case["metadata"]
    elif case["problem"] != "signature":
        with pytest.raises(Exception):  # noqa: B017 - the spec reader refuses by any failed check
            reader = spec_reader.SpecReader(repo, case["checkpoint"])
            reader.value_tree()
            for entry in reader.tensors:
                reader.tensor_bytes(entry["key"])
