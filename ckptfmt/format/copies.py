"""Copy records (spec 9.8, 1.10): a node-scoped checkpoint's chunks of another node, held on this one.

A node of a node-scoped tier holds the chunks its own ranks wrote (the manifest's ``placement``) and,
once copied from a peer and verified here, those of other nodes: ``NAME/copy-<host>.json`` says that
this repository holds every chunk row of the placement node ``host``, checked against their names
after they arrived. The manifest is never rewritten; a reader finds copies by listing the checkpoint's
folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptfmt.errors import CheckpointError, ManifestError
from ckptfmt.format.features import check_object, version_fields
from ckptfmt.format.limits import HASH_PATTERN, NAME_PATTERN
from ckptfmt.format.maps import parse_json
from ckptfmt.format.version import FORMAT_VERSION

COPY_FORMAT = "ckptfmt-copy"
#: A copy record is a handful of members.
MAX_COPY_BYTES = 4096
_PREFIX, _SUFFIX = "copy-", ".json"


def copy_key(name: str, host: str) -> str:
    """The key of checkpoint ``name``'s record of its copy of node ``host``'s chunks."""
    if not NAME_PATTERN.fullmatch(host):
        raise ValueError(f"host name {host!r} cannot name a copy record (spec 9.8: letters, digits, '.', '_', '-')")
    return f"{name}/{_PREFIX}{host}{_SUFFIX}"


def copy_entry_host(entry: str) -> str | None:
    """The host of a checkpoint folder's entry that names a copy record, else None."""
    if not (entry.startswith(_PREFIX) and entry.endswith(_SUFFIX)):
        return None
    host = entry[len(_PREFIX):-len(_SUFFIX)]
    return host if NAME_PATTERN.fullmatch(host) else None


@dataclass(frozen=True)
class CopyRecord:
    """This repository holds, verified, every chunk of placement node ``host`` of the checkpoint whose
    manifest hash is ``manifest_hash``; ``chunks`` and ``stored_bytes`` are what travelled (rows this
    node held already did not)."""

    host: str
    manifest_hash: str
    copied_ns: int
    chunks: int
    stored_bytes: int

    def to_bytes(self, version: tuple[int, int] = FORMAT_VERSION) -> bytes:
        """The stored form, for readers of ``version`` (its repository's marker's)."""
        return json.dumps({"format": COPY_FORMAT, **version_fields(version), "host": self.host,
                           "manifest": self.manifest_hash, "copied_ns": self.copied_ns, "chunks": self.chunks,
                           "bytes": self.stored_bytes}, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> CopyRecord:
        """A copy record, every member checked; ManifestError naming ``where`` otherwise."""
        doc = parse_json(data, where, "copy record")
        if not isinstance(doc, dict) or doc.get("format") != COPY_FORMAT:
            raise ManifestError(f"{where}: not a copy record (format {COPY_FORMAT!r} expected)")
        try:
            check_object(doc, "copy record")
        except CheckpointError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        host, digest = doc.get("host"), doc.get("manifest")
        if not isinstance(host, str) or not NAME_PATTERN.fullmatch(host):
            raise ManifestError(f"{where}: copy record's host must be a host name, found {host!r}")
        if not isinstance(digest, str) or not HASH_PATTERN.fullmatch(digest):
            raise ManifestError(f"{where}: copy record's manifest must be 64 hex digits, found {digest!r}")
        numbers = [doc.get(member) for member in ("copied_ns", "chunks", "bytes")]
        if not all(type(n) is int and n >= 0 for n in numbers):
            raise ManifestError(f"{where}: copy record's copied_ns, chunks and bytes must be integers >= 0")
        return cls(host, digest, int(doc["copied_ns"]), int(doc["chunks"]), int(doc["bytes"]))
