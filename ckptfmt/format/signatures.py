"""Signatures (spec 10.3, 1.7): who vouches for a checkpoint, beyond the hashes that prove its integrity.

Hashes show that bytes are the ones a commit record names; anyone who can write the storage can write
a commit record too. A signature object ``NAME/signature-<key id>.json`` holds an Ed25519 signature over
a short, fixed text of the checkpoint's commit record (``signed_message``): the record names the
manifest's hash, which names every chunk's hash, so one signature covers every byte. The private key
never enters the repository; the object carries the public key only so that readers can name who
signed. Trust is the reader's decision: a checkpoint is trusted when a signature verifies under a
public key the reader was given (``check_signed``), whatever keys the objects themselves carry.

The cryptography is the ``cryptography`` package's Ed25519 (RFC 8032), imported when a key is used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfmt.errors import CheckpointError, ManifestError, quoted
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.features import check_object, version_fields
from ckptfmt.format.limits import check_hash
from ckptfmt.format.maps import parse_json
from ckptfmt.format.version import FORMAT_VERSION

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

#: What ``trusted_keys`` takes: one public key or several (PEM files, ``cryptography`` keys, 32 raw bytes);
#: None checks no signature.
TrustedKeys = Any

SIGNATURE_FORMAT = "ckptfmt-signature"
ALGORITHM = "ed25519"
#: The first line of every signed message: what it is, and the version of its layout.
MESSAGE_HEADER = "ckptfmt-signature-v1"
MAX_SIGNATURE_BYTES = 4096
_PREFIX, _SUFFIX = "signature-", ".json"


class SignatureError(CheckpointError):
    """A checkpoint is not signed by a trusted key, or a signature does not verify (forged or damaged)."""


def signed_message(record: CommitRecord) -> bytes:
    """The bytes a signature signs: one ``field=value`` line per field of the commit record that fixes
    what the checkpoint is (spec 10.3); ``stats``, a summary copied from the manifest, is not one."""
    lines = [MESSAGE_HEADER, f"name={record.name}", f"manifest={record.manifest_hash}",
             f"manifest_size={record.manifest_size}", f"step={_or_null(record.step)}",
             f"created_ns={record.created_ns}", f"parent={_or_null(record.parent)}"]
    return ("\n".join(lines) + "\n").encode()


def _or_null(value: object) -> str:
    return "null" if value is None else str(value)


def key_id(public_key: bytes) -> str:
    """A public key's id: the first 16 hex digits of the SHA-256 of its 32 raw bytes."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def signature_key(name: str, kid: str) -> str:
    """The key of checkpoint ``name``'s signature object by the key with id ``kid``."""
    return f"{name}/{_PREFIX}{kid}{_SUFFIX}"


def is_signature_entry(entry: str) -> bool:
    """Whether a checkpoint folder's entry is a signature object's name."""
    middle = entry[len(_PREFIX):-len(_SUFFIX)]
    return entry.startswith(_PREFIX) and entry.endswith(_SUFFIX) and len(middle) == 16 and _is_hex(middle)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Signature:
    """A signature object (spec 10.3)."""

    key_id: str
    public_key: bytes
    manifest_hash: str
    signature: bytes
    created_ns: int
    signer: str | None = None
    #: The format version it is written for (spec 13): its checkpoint's.
    version: tuple[int, int] = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": SIGNATURE_FORMAT, **version_fields(self.version), "algorithm": ALGORITHM,
            "key_id": self.key_id, "public_key": _b64(self.public_key), "manifest": self.manifest_hash,
            "signature": _b64(self.signature), "created_ns": self.created_ns,
        }
        if self.signer is not None:
            doc["signer"] = self.signer
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Signature:
        """A signature object, every member checked; ManifestError naming ``where`` otherwise."""
        doc = parse_json(data, where, "signature object")
        try:
            return cls._from_doc(doc)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ManifestError(f"{where}: malformed signature object ({exc})") from None

    @classmethod
    def _from_doc(cls, doc: object) -> Signature:
        if not isinstance(doc, dict) or doc.get("format") != SIGNATURE_FORMAT:
            raise ValueError("not a ckptfmt signature object")
        version, _ = check_object(doc, "signature object")
        if doc["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {quoted(doc['algorithm'])} is not {ALGORITHM}")
        public_key, signature = _unb64(doc["public_key"], 32), _unb64(doc["signature"], 64)
        if doc["key_id"] != key_id(public_key):
            raise ValueError(f"key_id {quoted(doc['key_id'])} is not its public key's id")
        created, signer = doc["created_ns"], doc.get("signer")
        if type(created) is not int or not 0 <= created < 2**63:
            raise ValueError("created_ns is not an integer in [0, 2**63)")
        if signer is not None and not isinstance(signer, str):
            raise ValueError("signer is not a string")
        return cls(doc["key_id"], public_key, check_hash(doc["manifest"]), signature, created, signer, version)

    def verifies(self, record: CommitRecord, public_key: bytes | None = None) -> bool:
        """Whether this signature signs ``record`` under ``public_key`` (a trusted key's raw bytes; None:
        the object's own key, which proves the object intact, not who made it)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if record.manifest_hash != self.manifest_hash:
            return False
        key = Ed25519PublicKey.from_public_bytes(self.public_key if public_key is None else public_key)
        try:
            key.verify(self.signature, signed_message(record))
        except InvalidSignature:
            return False
        return True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object, size: int) -> bytes:
    if not isinstance(text, str):
        raise TypeError("a base64 member is not a string")
    data = base64.b64decode(text, validate=True)
    if len(data) != size:
        raise ValueError(f"{len(data)} bytes where {size} are expected")
    return data


class SigningKey:
    """An Ed25519 private key that signs checkpoints: ``SigningKey.load("release.pem")`` or around a
    ``cryptography`` key object. ``signer``: free text stored with each signature (who signed, for
    messages); the user and host by default."""

    def __init__(self, private_key: Ed25519PrivateKey, signer: str | None = None):
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = key_id(self.public_key)
        self.signer = signer if signer is not None else _who()

    @classmethod
    def load(cls, key: str | os.PathLike | SigningKey | Ed25519PrivateKey) -> SigningKey:
        """A signing key from a PEM file of an Ed25519 private key (unencrypted PKCS #8, as ``ckptfmt
        keygen`` writes), a ``cryptography`` Ed25519 private key, or a SigningKey (returned as is)."""
        if isinstance(key, SigningKey):
            return key
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        if isinstance(key, Ed25519PrivateKey):
            return cls(key)
        if not isinstance(key, (str, os.PathLike)):
            raise TypeError(f"signer must be a key file, an Ed25519 private key or a SigningKey, not "
                            f"{type(key).__name__}")
        loaded = _load_pem(key, private=True)
        if not isinstance(loaded, Ed25519PrivateKey):
            raise SignatureError(f"{os.fspath(key)}: not an Ed25519 private key")
        return cls(loaded)

    def sign(self, record: CommitRecord) -> Signature:
        return Signature(self.key_id, self.public_key, record.manifest_hash, self._key.sign(signed_message(record)),
                         time.time_ns(), self.signer)


def trusted_public_keys(keys) -> dict[str, bytes]:
    """The raw bytes of each trusted public key by its id: each of ``keys`` a PEM file of an Ed25519
    public key (``ckptfmt keygen``'s ``.pub``), a ``cryptography`` Ed25519 public key, or raw bytes."""
    if isinstance(keys, (str, os.PathLike, bytes)) or not hasattr(keys, "__iter__"):
        keys = [keys]
    found = {}
    for key in keys:
        raw = _public_bytes(key)
        found[key_id(raw)] = raw
    if not found:
        raise ValueError("trusted_keys is empty: give at least one public key, or None to check no signature")
    return found


def _public_bytes(key) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    if isinstance(key, bytes):
        if len(key) != 32:
            raise ValueError(f"a raw Ed25519 public key is 32 bytes, not {len(key)}")
        return key
    if isinstance(key, (str, os.PathLike)):
        loaded = _load_pem(key, private=False)
        if not isinstance(loaded, Ed25519PublicKey):
            raise SignatureError(f"{os.fspath(key)}: not an Ed25519 public key")
        key = loaded
    if not isinstance(key, Ed25519PublicKey):
        raise TypeError(f"a trusted key is a public key file, an Ed25519 public key or 32 raw bytes, not "
                        f"{type(key).__name__}")
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _load_pem(path: str | os.PathLike, *, private: bool):
    from cryptography.hazmat.primitives import serialization

    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(64 * 1024)
    except OSError as exc:
        raise SignatureError(f"{where}: cannot read the key ({exc.strerror or exc})") from None
    try:
        if private:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        kind = "private" if private else "public"
        raise SignatureError(f"{where}: not a PEM {kind} key ({exc})") from None


def _who() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
