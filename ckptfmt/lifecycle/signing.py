"""Signing checkpoints after the fact, and making the keys (spec 10.3).

``sign`` adds a signature to a committed checkpoint, or to every checkpoint of a repository (a release
manager vouching for a run, or a run that saved without ``signer=``). ``generate_key`` writes a new
key pair as PEM files (Ed25519, ML-DSA-65, or a hybrid of both: one block per part): the private key
readable by its owner only, the public key (``.pub``) to hand to readers (``trusted_keys=``, ``verify
--trusted-key``). ``openssl genpkey -algorithm ed25519`` (or ``ML-DSA-65``, OpenSSL 3.5) makes private
key files of one part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckptfmt.errors import CheckpointExistsError
from ckptfmt.format.layout import MARKER_KEY
from ckptfmt.format.signatures import DEFAULT_ALGORITHM, SigningKey, check_writable
from ckptfmt.repository.repository import Repository, resolve
from ckptfmt.repository.signatures import write_signature
from ckptfmt.storage.factory import open_storage


@dataclass
class SignReport:
    """What ``sign`` did."""

    url: str
    key_id: str
    #: Checkpoints newly signed, and those the key had signed already.
    signed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)


def sign(url: str | os.PathLike, key, *, storage_options: dict | None = None) -> SignReport:
    """Sign checkpoint ``url``, or every committed checkpoint of repository ``url``, with ``key`` (a private
    key file, ``cryptography`` key objects or a ``SigningKey``). Refuses before signing any when a
    checkpoint's format version cannot express the key's algorithm (ML-DSA: format 2.0)."""
    signer = SigningKey.load(key)
    storage = open_storage(url, storage_options)
    if storage.exists(MARKER_KEY):
        repo = Repository.open(url, storage_options)
        records = list(repo.commits())
    else:
        repo, name = resolve(url, storage_options)
        records = [repo.commit(name)]
    for record in records:
        check_writable(signer.algorithm, record)
    report = SignReport(repo.url, signer.key_id)
    for record in records:
        _, written = write_signature(repo, record, signer)
        (report.signed if written else report.already).append(record.name)
    return report


def generate_key(path: str | os.PathLike, algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, str, str]:
    """Write a new private key of ``algorithm`` (``ed25519``, ``ml-dsa-65`` or ``ed25519+ml-dsa-65``) to
    ``path`` (PEM, PKCS #8, mode 0600) and its public key to ``path.pub`` (PEM SubjectPublicKeyInfo; a
    hybrid's files hold the Ed25519 block, then the ML-DSA-65 one); refuses to replace either. Returns
    both paths and the key id."""
    key = SigningKey.generate(algorithm)
    private_path, public_path = os.fspath(path), os.fspath(path) + ".pub"
    for existing in (private_path, public_path):
        if os.path.lexists(existing):
            raise CheckpointExistsError(f"{existing}: already exists; a key is never replaced")
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_pem())
    with open(public_path, "xb") as f:
        f.write(key.public_pem())
    return private_path, public_path, key.key_id
