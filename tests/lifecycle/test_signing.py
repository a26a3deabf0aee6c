"""Signed checkpoints (spec 10.3): hashes prove integrity, signatures origin. A checkpoint forged by anyone
who can write the storage (two tensors' shards swapped, the manifest hashed again, the commit record
rewritten) verifies by its hashes alone; a reader given a trusted public key refuses it, and an unsigned
one, naming the checkpoint."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from referencing import Registry, Resource

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.format.signatures import SignatureError, SigningKey, signed_message
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.lifecycle.signing import generate_key, sign
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import assert_bits, rewrite_manifest

SPEC = Path(__file__).resolve().parents[2] / "spec"


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"a": torch.randn(32, 16), "b": torch.randn(32, 16)}, "step": seed}


@pytest.fixture
def keys(tmp_path) -> tuple[Path, Path]:
    """A key pair made as users make it: ``ckptfmt keygen``."""
    key = tmp_path / "keys" / "release"
    key.parent.mkdir()
    assert main(["keygen", str(key)]) == 0
    return key, Path(f"{key}.pub")


@pytest.fixture
def signed(tmp_path, keys) -> Path:
    """A repository of two checkpoints saved with ``signer=``."""
    repo = tmp_path / "repo"
    for step in (1, 2):
        ckptfmt.save(state(step), repo / f"step-{step}", step=step, signer=keys[0])
    return repo


def forge(repo: Path, name: str) -> None:
    """What anyone with write access can do: exchange two tensors' shards, hash the manifest again, and
    rewrite the commit record to name it."""
    def swap(doc):
        tensors = {t["key"]: t for t in doc["tensors"]}
        tensors["model/a"]["shards"], tensors["model/b"]["shards"] = (tensors["model/b"]["shards"],
                                                                      tensors["model/a"]["shards"])
    rewrite_manifest(open_storage(repo), name, swap)


def test_a_forged_checkpoint_verifies_by_its_hashes_but_a_trusting_reader_refuses_it(signed, keys, capsys):
    forge(signed, "step-2")
    forged = ckptfmt.load(signed / "step-2")  # the hashes hold: the tensors come back exchanged
    assert_bits(forged["model"]["a"], state(2)["model"]["b"])

    with pytest.raises(SignatureError, match=r"step-2: the signature by trusted key \w{16} does not verify.*forged"):
        ckptfmt.load(signed / "step-2", trusted_keys=keys[1])
    with pytest.raises(SignatureError):
        ckptfmt.open(signed / "step-2", trusted_keys=[keys[1]])
    assert main(["verify", str(signed), "--trusted-key", str(keys[1]), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert [(p["checkpoint"], p["kind"]) for p in problems] == [("step-2", "bad-signature")]
    # Without a trusted key the signature left behind still gives the forgery away.
    report = ckptfmt.verify(signed)
    assert [(p.checkpoint, p.kind) for p in report.problems] == [("step-2", "bad-signature")]
    assert_bits(ckptfmt.load(signed / "step-1", trusted_keys=keys[1])["model"]["a"], state(1)["model"]["a"])


def test_a_forgery_without_its_signature_is_refused_as_unsigned(signed, keys, capsys):
    forge(signed, "step-2")
    for leftover in (signed / "step-2").glob("signature-*.json"):
        leftover.unlink()

    assert ckptfmt.verify(signed).ok  # integrity alone cannot tell
    with pytest.raises(SignatureError, match="step-2: not signed by a trusted key"):
        ckptfmt.load(signed / "step-2", trusted_keys=keys[1])
    assert main(["verify", str(signed / "step-2"), "--trusted-key", str(keys[1])]) == 1
    assert "unsigned" in capsys.readouterr().out


def test_unsigned_and_other_keys_signatures_are_refused_naming_the_checkpoint(tmp_path, signed, keys):
    other_key = tmp_path / "other"
    generate_key(other_key)
    ckptfmt.save(state(3), signed / "step-3", step=3)
    ckptfmt.save(state(4), signed / "step-4", step=4, signer=other_key)

    with pytest.raises(SignatureError, match="step-3: not signed by a trusted key"):
        ckptfmt.load(signed / "step-3", trusted_keys=keys[1])
    with pytest.raises(SignatureError, match="step-4: signed only by keys not trusted"):
        ckptfmt.load(signed / "step-4", trusted_keys=keys[1])
    report = ckptfmt.verify(signed, trusted_keys=[keys[1], f"{other_key}.pub"])
    assert [(p.checkpoint, p.kind) for p in report.problems] == [("step-3", "unsigned")]


def test_ckptfmt_sign_signs_after_the_fact_and_once_per_key(tmp_path, keys, capsys):
    repo = tmp_path / "repo"
    for step in (1, 2):
        ckptfmt.save(state(step), repo / f"step-{step}", step=step)
    assert main(["sign", str(repo / "step-1"), "--key", str(keys[0])]) == 0
    assert "signed 1 checkpoint" in capsys.readouterr().out
    assert main(["sign", str(repo), "--key", str(keys[0])]) == 0
    out = capsys.readouterr().out
    assert "signed 1 checkpoint" in out and "1 checkpoint already signed" in out
    assert ckptfmt.verify(repo, trusted_keys=keys[1]).ok
    assert sign(repo, keys[0]).already == ["step-1", "step-2"]


def test_the_private_key_never_enters_the_repository(signed, keys):
    from cryptography.hazmat.primitives import serialization

    private = serialization.load_pem_private_key(keys[0].read_bytes(), password=None)
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    pem = keys[0].read_bytes()
    for path in signed.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert raw not in data and pem not in data, path
    assert os.stat(keys[0]).st_mode & 0o077 == 0  # keygen's private key: the owner's alone


def test_a_signature_object_matches_its_schema_and_signs_the_documented_message(signed, keys):
    record = Repository.open(signed).commit("step-1")
    (path,) = (signed / "step-1").glob("signature-*.json")
    doc = json.loads(path.read_bytes())
    schema = json.loads((SPEC / "signature.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    commit_schema = json.loads((SPEC / "commit.schema.json").read_text())
    registry = Registry().with_resource(commit_schema["$id"], Resource.from_contents(commit_schema))
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)
    assert path.name == f"signature-{doc['key_id']}.json" and doc["manifest"] == record.manifest_hash
    assert signed_message(record).decode().splitlines() == [
        "ckptfmt-signature-v1", "name=step-1", f"manifest={record.manifest_hash}",
        f"manifest_size={record.manifest_size}", "step=1", f"created_ns={record.created_ns}", "parent=null"]
    # ... which is the template spec 10.3 gives, line for line.
    spec = (SPEC / "FORMAT.md").read_text()
    template = spec[spec.index("The **signed message**"):].split("```")[1].strip().splitlines()
    assert [line.split("=")[0] for line in template] == [
        line.split("=")[0] for line in signed_message(record).decode().splitlines()]
    # A second reader with any Ed25519 library: the documented message, the object's key and signature.
    Ed25519PublicKey.from_public_bytes(base64.b64decode(doc["public_key"])).verify(
        base64.b64decode(doc["signature"]), signed_message(record))


def test_replication_carries_signatures_and_repair_restores_them(signed, keys, tmp_path):
    replica = tmp_path / "replica"
    report = replicate(signed, replica)
    assert report.signatures_copied == 2
    assert ckptfmt.verify(replica, trusted_keys=keys[1]).ok

    for leftover in (signed / "step-1").glob("signature-*.json"):
        leftover.unlink()
    assert not ckptfmt.verify(signed, trusted_keys=keys[1]).ok
    fixed = repair(signed, [replica])
    assert [f.kind for f in fixed.fixed] == ["signature"] and fixed.ok
    assert ckptfmt.verify(signed, trusted_keys=keys[1]).ok

    sign(signed, SigningKey.load(keys[0]))  # nothing new; a later key's signature travels on the next sync
    later = tmp_path / "later"
    generate_key(later)
    sign(signed / "step-2", later)
    assert replicate(signed, replica).signatures_copied == 1
    assert ckptfmt.verify(replica / "step-2", trusted_keys=f"{later}.pub").ok


def test_async_saves_and_the_manager_sign_too(tmp_path, keys):
    repo = tmp_path / "repo"
    ckptfmt.async_save(state(1), repo / "a", signer=keys[0]).result(timeout=60)
    manager = ckptfmt.CheckpointManager(tmp_path / "managed", signer=keys[0])
    manager.save(5, state(5))
    manager.wait()
    assert manager.restore(trusted_keys=keys[1])["step"] == 5
    manager.close()
    assert ckptfmt.verify(repo, trusted_keys=keys[1]).ok


def test_bad_keys_are_clear_errors(tmp_path, keys):
    with pytest.raises(SignatureError, match="not a PEM private key"):
        ckptfmt.save(state(1), tmp_path / "r" / "a", signer=keys[1])  # the public key given as the signer
    with pytest.raises(SignatureError, match="cannot read the key"):
        ckptfmt.save(state(1), tmp_path / "r" / "a", signer=tmp_path / "missing.pem")
    assert not (tmp_path / "r").exists()  # refused before anything was written
    with pytest.raises(ckptfmt.CheckpointExistsError):
        generate_key(keys[0])
