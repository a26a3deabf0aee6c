"""Three rules of spec 10.3 that its first text left unsaid or said wrong, each as ckptfmt keeps it: a
signature counts only when its ``manifest`` member is the commit record's, an object counts only under the
name its ``key_id`` gives, and a negative step is signed with its minus sign."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.format.signatures import SignatureError, signed_message
from ckptfmt.lifecycle.signing import generate_key, sign
from ckptfmt.repository.repository import Repository


@pytest.fixture
def keys(tmp_path) -> dict[str, tuple[Path, Path]]:
    found = {}
    for name in ("first", "second"):
        private, public, _ = generate_key(tmp_path / name)
        found[name] = Path(private), Path(public)
    return found


@pytest.fixture
def repo(tmp_path, keys) -> Path:
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.arange(4.0)}, repo / "a", step=1, signer=keys["first"][0])
    return repo


def test_a_valid_signature_whose_manifest_member_names_another_manifest_does_not_count(repo, keys):
    """Spec 10.3: the signed message does not hold the member, but a signature counts only when the member
    is the record's manifest (so that a reader may match objects to manifests without verifying)."""
    (path,) = (repo / "a").glob("signature-*.json")
    doc = json.loads(path.read_bytes())
    path.write_text(json.dumps({**doc, "manifest": "0" * 64}, indent=1))
    record = Repository.open(repo).commit("a")
    assert signed_message(record)  # the signature bytes still sign this very record's message
    with pytest.raises(SignatureError, match=r"the signature by trusted key \w{16} does not verify"):
        ckptfmt.load(repo / "a", trusted_keys=keys["first"][1])
    assert [p.kind for p in ckptfmt.verify(repo).problems] == ["bad-signature"]


def test_an_object_named_for_another_key_counts_as_absent_and_verify_reports_it(repo, keys):
    (path,) = (repo / "a").glob("signature-*.json")
    second_id = ckptfmt.SigningKey.load(keys["second"][0]).key_id
    misnamed = path.with_name(f"signature-{second_id}.json")
    path.rename(misnamed)
    with pytest.raises(SignatureError, match=rf"no readable signature by a trusted key .*named for key {second_id} "
                                             r"but holds key \w{16}'s signature; it counts as absent"):
        ckptfmt.load(repo / "a", trusted_keys=[keys["first"][1], keys["second"][1]])
    problems = ckptfmt.verify(repo).problems
    assert [p.kind for p in problems] == ["bad-signature"] and "named for key" in problems[0].message
    # The key the name names signs in its place: the misnamed object is no signature of it.
    assert sign(repo / "a", keys["second"][0]).signed == ["a"]
    assert ckptfmt.verify(repo, trusted_keys=keys["second"][1]).ok


def test_a_negative_step_is_signed_with_its_minus_sign(tmp_path, keys):
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(2)}, repo / "warmup", step=-3, signer=keys["first"][0])
    record = Repository.open(repo).commit("warmup")
    assert record.step == -3 and "step=-3" in signed_message(record).decode().splitlines()
    assert ckptfmt.load(repo / "warmup", trusted_keys=keys["first"][1])["w"].tolist() == [1.0, 1.0]
    assert ckptfmt.verify(repo, trusted_keys=keys["first"][1]).ok
