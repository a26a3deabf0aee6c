"""Signing checkpoints after the fact, and making the keys (spec 10.3).

``sign`` adds a signature to a committed checkpoint, or to every checkpoint of a repository (a release
manager vouching for a run, or a run that saved without ``signer=``). ``generate_key`` writes a new
Ed25519 key pair as PEM files: the private key readable by its owner only, the public key (``.pub``)
to hand to readers (``trusted_keys=``, ``verify --trusted-key``). ``openssl genpkey -algorithm ed25519``
makes the same private key files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckptfmt.errors import CheckpointExistsError
from ckptfmt.format.layout import MARKER_KEY
from ckptfmt.format.signatures import SigningKey
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
    """Sign checkpoint ``url``, or every committed checkpoint of repository ``url``, with ``key`` (a PEM
    file of an Ed25519 private key, a ``cryptography`` key or a ``SigningKey``)."""
    signer = SigningKey.load(key)
    storage = open_storage(url, storage_options)
    if storage.exists(MARKER_KEY):
        repo = Repository.open(url, storage_options)
        names = [record.name for record in repo.commits()]
    else:
        repo, name = resolve(url, storage_options)
        names = [name]
    report = SignReport(repo.url, signer.key_id)
    for name in names:
        _, written = write_signature(repo, repo.commit(name), signer)
        (report.signed if written else report.already).append(name)
    return report


def generate_key(path: str | os.PathLike) -> tuple[str, str, str]:
    """Write a new Ed25519 private key to ``path`` (PEM, PKCS #8, mode 0600) and its public key to
    ``path.pub``; refuses to replace either. Returns both paths and the key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path, public_path = os.fspath(path), os.fspath(path) + ".pub"
    for existing in (private_path, public_path):
        if os.path.lexists(existing):
            raise CheckpointExistsError(f"{existing}: already exists; a key is never replaced")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    with open(public_path, "xb") as f:
        f.write(public)
    return private_path, public_path, SigningKey(key).key_id
