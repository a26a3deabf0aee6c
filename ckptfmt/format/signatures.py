"""Signatures (spec 10.3, 1.7; ML-DSA 2.0): who vouches for a checkpoint, beyond the hashes that prove its integrity.

Hashes show that bytes are the ones a commit record names; anyone who can write the storage can write
a commit record too. A signature object ``NAME/signature-<key id>.json`` holds a signature over a short,
fixed text of the checkpoint's commit record (``signed_message``): the record names the manifest's hash,
which names every chunk's hash, so one signature covers every byte. The private key never enters the
repository; the object carries the public key only so that readers can name who signed. Trust is the
reader's decision: a checkpoint is trusted when a signature verifies under a public key the reader was
given (``check_signed``), whatever keys the objects themselves carry.

Three algorithms: Ed25519 (RFC 8032), ML-DSA-65 (FIPS 204, which a quantum computer is not known to
break) and the hybrid of both, whose signature holds one of each and verifies only when both do. Each
key's public bytes are its parts' raw public keys concatenated, so their length names the algorithm.
The cryptography is the ``cryptography`` package's, imported when a key is used (ML-DSA from its 48.0).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.errors import CheckpointError, ManifestError, quoted
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.features import check_declared, check_object, refuse_unless_writable, version_fields
from ckptfmt.format.limits import check_hash
from ckptfmt.format.maps import parse_json
from ckptfmt.format.version import FORMAT_VERSION

#: What ``trusted_keys`` takes: one public key or several (public key files, ``cryptography`` keys, raw
#: bytes); None checks no signature.
TrustedKeys = Any

SIGNATURE_FORMAT = "ckptfmt-signature"
#: Each algorithm's parts, in the order their public keys and signatures are concatenated (spec 10.3).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "ed25519": ("ed25519",), "ml-dsa-65": ("ml-dsa-65",), "ed25519+ml-dsa-65": ("ed25519", "ml-dsa-65"),
}
DEFAULT_ALGORITHM = "ed25519"
#: A part's raw public key and signature sizes in bytes.
_PUBLIC_BYTES = {"ed25519": 32, "ml-dsa-65": 1952}
_SIGNATURE_BYTES = {"ed25519": 64, "ml-dsa-65": 3309}
#: The first cryptography release whose wheels sign with ML-DSA.
MLDSA_CRYPTOGRAPHY = "48.0"
#: The first line of every signed message: what it is, and the version of its layout.
MESSAGE_HEADER = "ckptfmt-signature-v1"
#: A signature object's size limit: 4 KiB for a 1.x object (Ed25519 only), 16 KiB for a format-2 object
#: (a hybrid one is about 7.3 KiB). Readers read up to the larger and check the smaller by version.
MAX_SIGNATURE_BYTES_1 = 4096
MAX_SIGNATURE_BYTES = 16384
_PREFIX, _SUFFIX = "signature-", ".json"
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----", re.S)


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
    """A public key's id: the first 16 hex digits of the SHA-256 of its raw bytes (a hybrid key's: of its
    Ed25519 then its ML-DSA-65 public key, concatenated)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def public_size(algorithm: str) -> int:
    """The size of an ``algorithm`` key's public bytes."""
    return sum(_PUBLIC_BYTES[part] for part in ALGORITHMS[algorithm])


def signature_size(algorithm: str) -> int:
    """The size of an ``algorithm`` signature."""
    return sum(_SIGNATURE_BYTES[part] for part in ALGORITHMS[algorithm])


#: Each algorithm by the size of its public bytes (distinct: a trusted key's bytes name its algorithm).
_BY_PUBLIC_SIZE = {public_size(name): name for name in ALGORITHMS}


def key_algorithm(public_key: bytes) -> str | None:
    """The algorithm of a key's raw public bytes, by their size; None for a size no algorithm has."""
    return _BY_PUBLIC_SIZE.get(len(public_key))


def signature_features(algorithm: str) -> frozenset[str]:
    """The required features (spec 13.2) of an ``algorithm`` signature object: ML-DSA's are format 2.0's."""
    return frozenset() if algorithm == "ed25519" else frozenset({algorithm})


def check_writable(algorithm: str, record: CommitRecord) -> None:
    """SignatureError unless ``record``'s format version can express an ``algorithm`` signature."""
    for feature in signature_features(algorithm):
        try:
            refuse_unless_writable(feature, record.version, f"an {algorithm} signature")
        except ValueError as exc:
            raise SignatureError(f"{record.name}: {exc}; sign it with an Ed25519 key") from None


def signature_key(name: str, kid: str) -> str:
    """The key of checkpoint ``name``'s signature object by the key with id ``kid``."""
    return f"{name}/{_PREFIX}{kid}{_SUFFIX}"


def is_signature_entry(entry: str) -> bool:
    """Whether a checkpoint folder's entry is a signature object's name."""
    middle = entry[len(_PREFIX):-len(_SUFFIX)]
    return entry.startswith(_PREFIX) and entry.endswith(_SUFFIX) and len(middle) == 16 and _is_hex(middle)


def entry_key_id(entry: str) -> str:
    """The key id a signature object's name gives (``signature-<k>.json``: ``k``)."""
    return entry.rsplit("/", 1)[-1][len(_PREFIX):-len(_SUFFIX)]


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
    #: Who signed, as the signing key said (free text; the object's ``signer`` field, spec 10.3).
    signed_by: str | None = None
    #: The format version it is written for (spec 13): its checkpoint's.
    version: tuple[int, int] = FORMAT_VERSION
    algorithm: str = DEFAULT_ALGORITHM

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "format": SIGNATURE_FORMAT, **version_fields(self.version, signature_features(self.algorithm)),
            "algorithm": self.algorithm, "key_id": self.key_id, "public_key": _b64(self.public_key),
            "manifest": self.manifest_hash, "signature": _b64(self.signature), "created_ns": self.created_ns,
        }
        if self.signed_by is not None:
            doc["signer"] = self.signed_by
        return json.dumps(doc, indent=1).encode()

    @property
    def signer(self) -> str | None:
        """Deprecated: ``signed_by`` (a signer is a key; this is who signed)."""
        warnings.warn("Signature.signer is deprecated: use Signature.signed_by", DeprecationWarning, stacklevel=2)
        return self.signed_by

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Signature:
        """A signature object, every member checked; ManifestError naming ``where`` otherwise (and
        UnsupportedVersionError for one that requires a feature this ckptfmt lacks: a newer algorithm)."""
        doc = parse_json(data, where, "signature object")
        try:
            return cls._from_doc(doc, len(data), where)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ManifestError(f"{where}: malformed signature object ({exc})") from None

    @classmethod
    def _from_doc(cls, doc: object, size: int, where: str) -> Signature:
        if not isinstance(doc, dict) or doc.get("format") != SIGNATURE_FORMAT:
            raise ValueError("not a ckptfmt signature object")
        version, requires = check_object(doc, f"{where}: signature object")
        if version[0] < 2 and size > MAX_SIGNATURE_BYTES_1:
            raise ValueError(f"{size} bytes, over a 1.x object's {MAX_SIGNATURE_BYTES_1}")
        algorithm = _algorithm(doc["algorithm"], version)
        check_declared(signature_features(algorithm), requires, version, f"{where}: signature object")
        public_key = _unb64(doc["public_key"], public_size(algorithm))
        signature = _unb64(doc["signature"], signature_size(algorithm))
        if doc["key_id"] != key_id(public_key):
            raise ValueError(f"key_id {quoted(doc['key_id'])} is not its public key's id")
        created, signer = doc["created_ns"], doc.get("signer")
        if type(created) is not int or not 0 <= created < 2**63:
            raise ValueError("created_ns is not an integer in [0, 2**63)")
        if signer is not None and not isinstance(signer, str):
            raise ValueError("signer is not a string")
        return cls(doc["key_id"], public_key, check_hash(doc["manifest"]), signature, created, signer, version,
                   algorithm)

    def verifies(self, record: CommitRecord, public_key: bytes | None = None) -> bool:
        """Whether this signature signs ``record`` under ``public_key`` (a trusted key's raw bytes; None:
        the object's own key, which proves the object intact, not who made it). Its ``manifest`` must be
        the record's, and the key must be of the object's algorithm; a hybrid's parts must both verify."""
        key = self.public_key if public_key is None else public_key
        if record.manifest_hash != self.manifest_hash or key_algorithm(key) != self.algorithm:
            return False
        message, key_at, signature_at = signed_message(record), 0, 0
        results = []
        for part in ALGORITHMS[self.algorithm]:
            key_end, signature_end = key_at + _PUBLIC_BYTES[part], signature_at + _SIGNATURE_BYTES[part]
            results.append(_part_verifies(part, key[key_at:key_end], self.signature[signature_at:signature_end],
                                          message))
            key_at, signature_at = key_end, signature_end
        return all(results)


def _algorithm(name: object, version: tuple[int, int]) -> str:
    """A signature object's ``algorithm``, known and of its version (ML-DSA: format 2 objects only)."""
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise ValueError(f"algorithm {quoted(name)} is not one of {', '.join(ALGORITHMS)}")
    if version[0] < 2 and name != "ed25519":
        raise ValueError(f"algorithm {name!r} in a format {version[0]}.{version[1]} object (2.0 brought it)")
    return name


def _part_verifies(part: str, public_key: bytes, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        _public_class(part).from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):  # ValueError: bytes that are no key of the kind
        return False
    return True


def _public_class(part: str) -> Any:
    if part == "ed25519":
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return Ed25519PublicKey
    return _mldsa().MLDSA65PublicKey


def _mldsa() -> Any:
    """cryptography's ML-DSA module; SignatureError when this cryptography cannot sign with ML-DSA."""
    mldsa = _mldsa_or_none()
    if mldsa is None:
        import cryptography

        raise SignatureError(f"ML-DSA needs cryptography>={MLDSA_CRYPTOGRAPHY} built with ML-DSA (this is "
                             f"cryptography {cryptography.__version__}): pip install 'cryptography>="
                             f"{MLDSA_CRYPTOGRAPHY}'")
    return mldsa


def _mldsa_or_none() -> Any:
    """cryptography's ML-DSA module, or None when this cryptography has none (before 48.0, or built without)."""
    try:
        from cryptography.hazmat.backends.openssl.backend import backend
        from cryptography.hazmat.primitives.asymmetric import mldsa
    except ImportError:
        return None
    return mldsa if getattr(backend, "mldsa_supported", lambda: True)() else None


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
    """A private key that signs checkpoints, of any algorithm of ``ALGORITHMS``: ``SigningKey.load("release.pem")``
    or around ``cryptography`` key objects (a hybrid key: the tuple of its Ed25519 and ML-DSA-65 keys).
    ``signed_by``: free text stored with each signature (who signed, for messages); the user and host by
    default."""

    @renamed_arguments(signer="signed_by")
    def __init__(self, private_key: Any, signed_by: str | None = None):
        self._parts = tuple(private_key) if isinstance(private_key, tuple) else (private_key,)
        self.algorithm = "+".join(_private_part(key) for key in self._parts)
        if self.algorithm not in ALGORITHMS:
            kinds = " and ".join(type(key).__name__ for key in self._parts)
            raise TypeError(f"a signing key is one of {', '.join(ALGORITHMS)}, not {kinds}")
        self.public_key = b"".join(key.public_key().public_bytes_raw() for key in self._parts)
        self.key_id = key_id(self.public_key)
        self.signed_by = signed_by if signed_by is not None else _who()

    @classmethod
    def generate(cls, algorithm: str = DEFAULT_ALGORITHM) -> SigningKey:
        """A new key of ``algorithm``."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}")
        return cls(tuple(_private_class(part).generate() for part in ALGORITHMS[algorithm]))

    @classmethod
    def load(cls, key: str | os.PathLike | SigningKey | Any) -> SigningKey:
        """A signing key from a private key file (``ckptfmt keygen``'s: PEM, unencrypted PKCS #8, one block
        per part), ``cryptography`` private key objects, or a SigningKey (returned as is)."""
        if isinstance(key, SigningKey):
            return key
        if isinstance(key, (str, os.PathLike)):
            parts = _load_pem(key, private=True)
            try:
                return cls(parts)
            except TypeError:
                raise SignatureError(f"{os.fspath(key)}: not a private key of {', '.join(ALGORITHMS)} (PEM "
                                     f"blocks in this order)") from None
        try:
            return cls(key)
        except TypeError:
            raise TypeError(f"signer must be a key file, a private key of {', '.join(ALGORITHMS)} or a "
                            f"SigningKey, not {type(key).__name__}") from None

    def private_pem(self) -> bytes:
        """The private key file's bytes: one PEM PKCS #8 block per part, in the algorithm's order."""
        from cryptography.hazmat.primitives import serialization as s

        return b"".join(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())
                        for key in self._parts)

    def public_pem(self) -> bytes:
        """The public key file's bytes: one PEM SubjectPublicKeyInfo block per part, in the algorithm's order."""
        from cryptography.hazmat.primitives import serialization as s

        return b"".join(key.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo)
                        for key in self._parts)

    @property
    def signer(self) -> str:
        """Deprecated: ``signed_by`` (who signs with this key)."""
        warnings.warn("SigningKey.signer is deprecated: use SigningKey.signed_by", DeprecationWarning, stacklevel=2)
        return self.signed_by

    def sign(self, record: CommitRecord) -> Signature:
        """A signature of ``record``, an object of its checkpoint's format version (SignatureError when that
        version cannot express this algorithm)."""
        check_writable(self.algorithm, record)
        message = signed_message(record)
        signature = b"".join(key.sign(message) for key in self._parts)
        return Signature(self.key_id, self.public_key, record.manifest_hash, signature, time.time_ns(), self.signed_by,
                         record.version, self.algorithm)


def _private_part(key: Any) -> str:
    """The part a ``cryptography`` private key is ("?" for another kind)."""
    return _part(key, "Private")


def _public_part(key: Any) -> str:
    """The part a ``cryptography`` public key is ("?" for another kind)."""
    return _part(key, "Public")


def _part(key: Any, half: str) -> str:
    """The algorithm of a ``cryptography`` key of ``half`` ("Private" or "Public"), "?" for another kind."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if isinstance(key, getattr(ed25519, f"Ed25519{half}Key")):
        return "ed25519"
    mldsa = _mldsa_or_none()
    if mldsa is not None and isinstance(key, getattr(mldsa, f"MLDSA65{half}Key")):
        return "ml-dsa-65"
    return "?"


def _private_class(part: str) -> Any:
    if part == "ed25519":
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return Ed25519PrivateKey
    return _mldsa().MLDSA65PrivateKey


def trusted_public_keys(keys) -> dict[str, bytes]:
    """The raw bytes of each trusted public key by its id: each of ``keys`` a public key file (``ckptfmt
    keygen``'s ``.pub``), a ``cryptography`` Ed25519 or ML-DSA-65 public key, or raw bytes (32: Ed25519,
    1952: ML-DSA-65, 1984: the Ed25519 then the ML-DSA-65 key of a hybrid)."""
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
    if isinstance(key, bytes):
        if key_algorithm(key) is None:
            sizes = ", ".join(f"{public_size(name)} ({name})" for name in ALGORITHMS)
            raise ValueError(f"a raw public key is {sizes} bytes, not {len(key)}")
        return key
    if isinstance(key, (str, os.PathLike)):
        parts = _load_pem(key, private=False)
        if "+".join(_public_part(part) for part in parts) not in ALGORITHMS:
            raise SignatureError(f"{os.fspath(key)}: not a public key of {', '.join(ALGORITHMS)} (PEM blocks in "
                                 "this order)")
        return b"".join(part.public_bytes_raw() for part in parts)
    if _public_part(key) == "?":
        raise TypeError(f"a trusted key is a public key file, an Ed25519 or ML-DSA-65 public key or raw bytes, "
                        f"not {type(key).__name__}")
    return key.public_bytes_raw()


def _load_pem(path: str | os.PathLike, *, private: bool) -> tuple:
    """The keys of a PEM file, one per block."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(64 * 1024)
    except OSError as exc:
        raise SignatureError(f"{where}: cannot read the key ({exc.strerror or exc})") from None
    kind = "private" if private else "public"
    blocks = [match.group(0) for match in _PEM_BLOCK.finditer(data)]
    try:
        if not blocks:
            raise ValueError("no PEM block")
        if private:
            return tuple(serialization.load_pem_private_key(block, password=None) for block in blocks)
        return tuple(serialization.load_pem_public_key(block) for block in blocks)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{where}: not a PEM {kind} key ({exc})") from None
    except UnsupportedAlgorithm as exc:  # a kind of key this cryptography cannot load (ML-DSA before 48.0)
        raise SignatureError(f"{where}: a {kind} key this cryptography cannot load ({exc}; ML-DSA keys need "
                             f"cryptography>={MLDSA_CRYPTOGRAPHY})") from None


def _who() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
