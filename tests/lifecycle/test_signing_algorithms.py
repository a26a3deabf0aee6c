"""Signatures of every algorithm (spec 10.3): Ed25519, ML-DSA-65 (FIPS 204) and the hybrid of both, with
real keys made by ``ckptfmt keygen``. A trusting reader accepts a checkpoint only when a trusted key's
signature verifies, for the hybrid both halves, and refuses every forgery: flipped bytes, a half replaced,
another key's bytes, a key of another algorithm, a forged manifest."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from referencing import Registry, Resource

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import ManifestError
from ckptfmt.format.signatures import (
    ALGORITHMS,
    MAX_SIGNATURE_BYTES,
    Signature,
    SignatureError,
    SigningKey,
    public_size,
    signature_size,
)
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.lifecycle.signing import generate_key
from ckptfmt.repository.repository import Repository
from tests.support.helpers import rewrite_manifest

SPEC = Path(__file__).resolve().parents[2] / "spec"
HYBRID = "ed25519+ml-dsa-65"


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"a": torch.randn(8, 4), "b": torch.randn(8, 4)}, "step": seed}


def make_key(folder: Path, name: str, algorithm: str) -> tuple[Path, Path]:
    """A key pair as users make it: ``ckptfmt keygen --algorithm``."""
    key = folder / name
    assert main(["keygen", str(key), "--algorithm", algorithm]) == 0
    return key, Path(f"{key}.pub")


def signature_path(checkpoint: Path) -> Path:
    (path,) = checkpoint.glob("signature-*.json")
    return path


def edit_signature(checkpoint: Path, change) -> None:
    """Apply ``change`` to the raw signature bytes of a checkpoint's only signature object."""
    path = signature_path(checkpoint)
    doc = json.loads(path.read_bytes())
    doc["signature"] = base64.b64encode(change(base64.b64decode(doc["signature"]))).decode()
    path.write_text(json.dumps(doc, indent=1))


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    return {algorithm: make_key(folder, algorithm, algorithm) for algorithm in ALGORITHMS}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_keygen_writes_documented_pem_files_and_key_ids(tmp_path, capsys, algorithm):
    private, public = make_key(tmp_path, "k", algorithm)
    out = capsys.readouterr().out
    assert os.stat(private).st_mode & 0o077 == 0
    parts = ALGORITHMS[algorithm]
    assert private.read_bytes().count(b"-----BEGIN PRIVATE KEY-----") == len(parts)
    assert public.read_bytes().count(b"-----BEGIN PUBLIC KEY-----") == len(parts)
    key = SigningKey.load(private)
    assert key.algorithm == algorithm and len(key.public_key) == public_size(algorithm)
    assert key.key_id == hashlib.sha256(key.public_key).hexdigest()[:16] and key.key_id in out
    # The public key file's bytes, part after part, are the key's public bytes (the hybrid: Ed25519 first).
    from cryptography.hazmat.primitives import serialization

    blocks = [b"-----BEGIN" + block for block in public.read_bytes().split(b"-----BEGIN")[1:]]
    raw = b"".join(serialization.load_pem_public_key(block).public_bytes_raw() for block in blocks)
    assert raw == key.public_key


def test_keygen_errors_are_one_line_with_exit_codes(tmp_path, capsys, keys):
    assert main(["keygen", str(keys["ml-dsa-65"][0]), "--algorithm", "ml-dsa-65"]) == 2
    err = capsys.readouterr().err
    assert "already exists; a key is never replaced" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["keygen", str(tmp_path / "k"), "--algorithm", "rsa"])
    assert exit_.value.code == 2 and "invalid choice: 'rsa'" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()
    with pytest.raises(ValueError, match="algorithm must be one of ed25519, ml-dsa-65, ed25519\\+ml-dsa-65"):
        generate_key(tmp_path / "k", algorithm="ml-dsa-44")


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_save_verify_and_open_with_a_trusted_key_of_each_algorithm(tmp_path, keys, algorithm):
    private, public = keys[algorithm]
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=private)
    assert ckptfmt.load(repo / "a", trusted_keys=public)["step"] == 1
    with ckptfmt.open(repo / "a", trusted_keys=[public]) as reader:
        assert reader.signature.algorithm == algorithm
    assert ckptfmt.verify(repo, trusted_keys=public).ok
    # Signing after the fact, from the command line; another algorithm's key trusted too.
    ckptfmt.save(state(2), repo / "b", step=2)
    assert main(["sign", str(repo / "b"), "--key", str(private)]) == 0
    others = [keys[other][1] for other in ALGORITHMS if other != algorithm]
    assert main(["verify", str(repo), "--trusted-key", str(public), "--trusted-key", str(others[0])]) == 0

    path = signature_path(repo / "a")
    data = path.read_bytes()
    doc = json.loads(data)
    assert doc["algorithm"] == algorithm and doc["version"] == list(FORMAT_VERSION)
    assert doc["requires"] == ([] if algorithm == "ed25519" else [algorithm])
    assert len(base64.b64decode(doc["public_key"])) == public_size(algorithm)
    assert len(base64.b64decode(doc["signature"])) == signature_size(algorithm)
    assert len(data) <= MAX_SIGNATURE_BYTES and (algorithm == "ed25519") == (len(data) <= 4096)
    schema = json.loads((SPEC / "signature.schema.json").read_text())
    commit_schema = json.loads((SPEC / "commit.schema.json").read_text())
    registry = Registry().with_resource(commit_schema["$id"], Resource.from_contents(commit_schema))
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    validator.validate(doc)
    assert not validator.is_valid({**doc, "signature": doc["signature"][4:]})  # the sizes are the algorithm's


def test_async_saves_and_the_manager_sign_with_a_hybrid_key(tmp_path, keys):
    private, public = keys[HYBRID]
    ckptfmt.async_save(state(1), tmp_path / "repo" / "a", signer=private).result(timeout=60)
    assert ckptfmt.verify(tmp_path / "repo", trusted_keys=public).ok
    manager = ckptfmt.CheckpointManager(tmp_path / "managed", signer=private)
    manager.save(5, state(5))
    manager.wait()
    assert manager.restore(trusted_keys=public)["step"] == 5
    manager.close()


@pytest.fixture
def hybrid_signed(tmp_path, keys) -> Path:
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=keys[HYBRID][0])
    return repo


@pytest.mark.parametrize("at", [0, 63, 64, 64 + 3308], ids=["ed25519-first", "ed25519-last", "ml-dsa-first",
                                                               "ml-dsa-last"])
def test_a_flipped_byte_in_either_half_of_a_hybrid_signature_is_refused(hybrid_signed, keys, at):
    edit_signature(hybrid_signed / "a", lambda signature: flip(signature, at))
    with pytest.raises(SignatureError, match=r"a: the signature by trusted key \w{16} does not verify"):
        ckptfmt.load(hybrid_signed / "a", trusted_keys=keys[HYBRID][1])
    assert [p.kind for p in ckptfmt.verify(hybrid_signed).problems] == ["bad-signature"]


@pytest.mark.parametrize("half", ["ed25519", "ml-dsa-65"])
def test_one_half_of_a_hybrid_signature_replaced_by_another_keys_valid_one_is_refused(hybrid_signed, keys, half):
    """The other key's half verifies the very same message under its own key: each half is checked under
    the trusted key's part, so the hybrid falls whichever half an attacker controls."""
    record = Repository.open(hybrid_signed).commit("a")
    other = SigningKey.generate(half).sign(record).signature
    ed_size = signature_size("ed25519")
    edit_signature(hybrid_signed / "a", lambda signature: other + signature[ed_size:] if half == "ed25519"
                   else signature[:ed_size] + other)
    with pytest.raises(SignatureError, match="does not verify"):
        ckptfmt.load(hybrid_signed / "a", trusted_keys=keys[HYBRID][1])


def test_a_forged_manifest_is_refused_under_every_algorithm(tmp_path, keys):
    repo = tmp_path / "repo"
    for algorithm, (private, _) in keys.items():
        ckptfmt.save(state(1), repo / algorithm.replace("+", "-"), step=1, signer=private)

    def swap(doc):
        tensors = {t["key"]: t for t in doc["tensors"]}
        tensors["model/a"]["shards"], tensors["model/b"]["shards"] = (tensors["model/b"]["shards"],
                                                                      tensors["model/a"]["shards"])
    for algorithm, (_, public) in keys.items():
        name = algorithm.replace("+", "-")
        rewrite_manifest(Repository.open(repo).storage, name, swap)
        with pytest.raises(SignatureError, match=f"{name}: the signature by trusted key .* does not verify"):
            ckptfmt.open(repo / name, trusted_keys=public)


def test_a_key_of_another_algorithm_never_verifies(hybrid_signed, keys):
    """The algorithm is the trusted key's, never the object's: a signature object claiming another algorithm
    verifies under no key of the wrong kind, and the Ed25519 half of a hybrid signature, presented alone,
    is signed by a key the hybrid-trusting reader does not trust."""
    record = Repository.open(hybrid_signed).commit("a")
    hybrid = Signature.from_bytes(signature_path(hybrid_signed / "a").read_bytes(), "a")
    ed_public = hybrid.public_key[:32]
    assert hybrid.verifies(record) and hybrid.verifies(record, hybrid.public_key)
    assert not hybrid.verifies(record, ed_public)  # the hybrid's Ed25519 part alone is another key
    mldsa = SigningKey.generate("ml-dsa-65").sign(record)
    ed = SigningKey.load(keys["ed25519"][0])
    claimed = Signature(ed.key_id, mldsa.public_key, record.manifest_hash, mldsa.signature, 1, algorithm="ml-dsa-65")
    assert claimed.verifies(record) and not claimed.verifies(record, ed.public_key)

    stripped = Signature(hashlib.sha256(ed_public).hexdigest()[:16], ed_public, record.manifest_hash,
                         hybrid.signature[:64], 1)
    assert stripped.verifies(record)  # a true Ed25519 signature by the hybrid's Ed25519 part...
    for path in (hybrid_signed / "a").glob("signature-*.json"):
        path.unlink()
    (hybrid_signed / "a" / f"signature-{stripped.key_id}.json").write_bytes(stripped.to_bytes())
    with pytest.raises(SignatureError, match="signed only by keys not trusted"):  # ...which is not the hybrid key
        ckptfmt.load(hybrid_signed / "a", trusted_keys=keys[HYBRID][1])


def test_a_swapped_public_key_is_refused(tmp_path, keys):
    """An attacker's own ML-DSA key and signature in an object named for the trusted key: the name's key id
    is not the object's (spec 10.3: it counts as absent); keeping the trusted id, the object is malformed."""
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=keys["ml-dsa-65"][0])
    path = signature_path(repo / "a")
    record = Repository.open(repo).commit("a")
    forged = SigningKey.generate("ml-dsa-65").sign(record)
    path.write_bytes(forged.to_bytes())
    with pytest.raises(SignatureError, match=r"named for key \w{16} but holds key \w{16}'s signature"):
        ckptfmt.load(repo / "a", trusted_keys=keys["ml-dsa-65"][1])
    doc = json.loads(forged.to_bytes())
    path.write_text(json.dumps({**doc, "key_id": path.name[10:26]}))
    with pytest.raises(SignatureError, match="key_id .* is not its public key's id"):
        ckptfmt.load(repo / "a", trusted_keys=keys["ml-dsa-65"][1])


def test_a_format_1_save_refuses_an_ml_dsa_signer_and_signing_refuses_it_too(tmp_path, keys, capsys):
    repo = tmp_path / "repo"
    for algorithm in ("ml-dsa-65", HYBRID):
        with pytest.raises(ValueError, match=rf"signer= \(an {algorithm.replace('+', '.')} key\) needs format 2\.0 "
                                             r".*; format 1\.9 cannot express it"):
            ckptfmt.save(state(1), repo / "a", signer=keys[algorithm][0], format_version="1.9")
    assert not repo.exists()
    ckptfmt.save(state(1), repo / "a", step=1, format_version="1.9")
    assert main(["sign", str(repo), "--key", str(keys["ml-dsa-65"][0])]) == 2
    err = capsys.readouterr().err
    assert "a: an ml-dsa-65 signature needs format 2.0" in err and "format 1.9 cannot express it" in err
    assert not list((repo / "a").glob("signature-*.json"))
    # Ed25519 signs it, as an object of the checkpoint's own version, which a 1.9 reader reads.
    assert main(["sign", str(repo), "--key", str(keys["ed25519"][0])]) == 0
    doc = json.loads(signature_path(repo / "a").read_bytes())
    assert doc["version"] == [1, 9] and "requires" not in doc
    assert ckptfmt.verify(repo, trusted_keys=keys["ed25519"][1]).ok


def test_an_unknown_algorithm_requiring_an_unknown_feature_reads_as_upgrade(tmp_path, keys):
    """A newer ckptfmt's algorithm: refused as "upgrade" by a reader told to trust its key, and no problem
    (a signature this reader cannot check) for one that trusts no key or others."""
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=keys["ed25519"][0])
    path = signature_path(repo / "a")
    doc = json.loads(path.read_bytes())
    newer = {**doc, "requires": ["slh-dsa-128s"], "algorithm": "slh-dsa-128s", "public_key": "AAAA",
             "signature": "AAAA"}
    path.write_text(json.dumps(newer))
    with pytest.raises(SignatureError, match=r"cannot check the signature by trusted key \w{16} \(.*signature "
                                             r"object requires 'slh-dsa-128s': written by a newer ckptfmt; upgrade"):
        ckptfmt.load(repo / "a", trusted_keys=keys["ed25519"][1])
    assert ckptfmt.verify(repo).ok
    ckptfmt.open(repo / "a").close()
    with pytest.raises(SignatureError, match="not signed by a trusted key"):
        ckptfmt.open(repo / "a", trusted_keys=keys["ml-dsa-65"][1])
    # The same algorithm without declaring it is malformed, not newer.
    path.write_text(json.dumps({**newer, "requires": []}))
    with pytest.raises(ManifestError, match="algorithm 'slh-dsa-128s' is not one of"):
        Signature.from_bytes(path.read_bytes(), str(path))


def test_old_ed25519_signature_objects_read_and_write_back_byte_for_byte():
    corpus = Path(__file__).resolve().parents[1] / "corpus"
    paths = sorted(corpus.glob("v*/repo/*/signature-*.json"))
    assert len(paths) >= 8
    for path in paths:
        data = path.read_bytes()
        signature = Signature.from_bytes(data, str(path))
        assert signature.algorithm == "ed25519" and signature.to_bytes() == data, path


def test_object_size_limits_by_version(tmp_path, keys):
    """A 1.x object is at most 4 KiB, a format-2 object 16 KiB (spec 10.3)."""
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=keys["ed25519"][0], format_version="1.9")
    data = signature_path(repo / "a").read_bytes()
    padded = json.dumps({**json.loads(data), "signer": "x" * 4096}).encode()
    with pytest.raises(ManifestError, match="over a 1.x object's 4096"):
        Signature.from_bytes(padded, "a")
    assert Signature.from_bytes(json.dumps({**json.loads(padded), "version": [2, 0], "requires": []}).encode(), "a")


def test_a_cryptography_without_ml_dsa_says_which_release_it_needs(tmp_path, keys, monkeypatch):
    """cryptography before 48.0 has no ``mldsa`` module (its import fails): ML-DSA keys are refused naming
    the release that brought it, and Ed25519 works as before."""
    repo = tmp_path / "repo"
    ckptfmt.save(state(1), repo / "a", step=1, signer=keys["ml-dsa-65"][0])
    raw = SigningKey.load(keys["ml-dsa-65"][0]).public_key
    from cryptography.hazmat.primitives import asymmetric

    monkeypatch.delattr(asymmetric, "mldsa")
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.asymmetric.mldsa", None)
    with pytest.raises(SignatureError, match=r"ML-DSA needs cryptography>=48\.0 built with ML-DSA \(this is "
                                             r"cryptography [\d.]+\)"):
        generate_key(tmp_path / "new", algorithm="ml-dsa-65")
    with pytest.raises(SignatureError, match=r"ML-DSA needs cryptography>=48\.0"):
        ckptfmt.load(repo / "a", trusted_keys=raw)
    ckptfmt.save(state(2), repo / "b", step=2, signer=keys["ed25519"][0])
    assert ckptfmt.load(repo / "b", trusted_keys=keys["ed25519"][1])["step"] == 2


def test_who_signed_reads_as_signed_by_and_the_old_name_warns_and_works(tmp_path):
    """Issue 50: ``signer`` is the key given to ``save``; who signed is ``signed_by`` on the key and on each
    signature object (the object's JSON field stays ``signer``, spec 10.3)."""
    from ckptfmt.repository.signatures import signatures

    key = ckptfmt.SigningKey.generate()
    with pytest.warns(DeprecationWarning, match="use signed_by="):
        named = ckptfmt.SigningKey(key._parts[0], signer="release bot")
    assert named.signed_by == "release bot"
    with pytest.warns(DeprecationWarning, match="SigningKey.signed_by"):
        assert named.signer == "release bot"
    ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "a", signer=named)
    repo = ckptfmt.Repository.open(str(tmp_path / "repo"))
    (entry,) = signatures(repo, "a")
    assert entry.signature.signed_by == "release bot"
    assert b'"signer": "release bot"' in entry.signature.to_bytes()
    with pytest.warns(DeprecationWarning, match="Signature.signed_by"):
        assert entry.signature.signer == "release bot"
