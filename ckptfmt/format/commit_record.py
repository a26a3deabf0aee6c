"""The commit record (spec 10.1): the small JSON object whose existence at NAME/COMMIT makes a checkpoint exist.

Its own module because the repository and the commit index (spec 4.4) both read and write it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

from ckptfmt.errors import CheckpointError, ManifestError, quoted
from ckptfmt.format.features import check_object, version_fields
from ckptfmt.format.limits import MAX_MANIFEST_BYTES, check_hash, check_name
from ckptfmt.format.maps import parse_json
from ckptfmt.format.version import FORMAT_VERSION

COMMIT_FORMAT = "ckptfmt-commit"


@dataclass(frozen=True)
class CommitRecord:
    """The small record that makes a checkpoint exist: its manifest's hash plus a summary."""

    name: str
    manifest_hash: str
    manifest_size: int
    step: int | None
    created_ns: int
    parent: str | None
    #: The checkpoint's totals (spec 9.5: the manifest's ``stats`` map, tensor and chunk counts and bytes).
    totals: dict
    #: The format version it is written for (spec 13): the save's.
    version: tuple[int, int] = FORMAT_VERSION
    #: The hash of the checkpoint's parity record (spec 5.6, 2.1), None when it has no parity.
    parity: str | None = None

    @property
    def stats(self) -> dict:
        """Deprecated name of ``totals``: ``stats`` means a tensor's statistics everywhere else."""
        warnings.warn("CommitRecord.stats is renamed totals", DeprecationWarning, stacklevel=2)
        return self.totals

    def to_dict(self) -> dict:
        return {
            "format": COMMIT_FORMAT,
            **version_fields(self.version),
            "name": self.name,
            "manifest": self.manifest_hash,
            "manifest_size": self.manifest_size,
            "step": self.step,
            "created_ns": self.created_ns,
            "parent": self.parent,
            "stats": self.totals,
            **({"parity": self.parity} if self.parity is not None else {}),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> CommitRecord:
        return cls.from_dict(parse_json(data, where, "commit record"), where)

    @classmethod
    def from_dict(cls, doc: object, where: str) -> CommitRecord:
        """The record in a parsed JSON object, every field checked (spec 10.1)."""
        try:
            if not isinstance(doc, dict) or doc.get("format") != COMMIT_FORMAT:
                raise ManifestError("not a ckptfmt commit record")
            version, _ = check_object(doc, "commit record")
            size = doc["manifest_size"]
            step = doc.get("step")
            created = doc["created_ns"]
            if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest_size {quoted(size)} is invalid")
            if step is not None and type(step) is not int:
                raise ManifestError("step is not an integer")
            if type(created) is not int or not 0 <= created < 2**63:
                raise ManifestError("created_ns is not an integer in [0, 2**63)")
            parent = doc.get("parent")
            stats = doc.get("stats") or {}
            if not isinstance(stats, dict):
                raise ManifestError("stats is not a map")
            return cls(
                name=check_name(doc["name"]),
                manifest_hash=check_hash(doc["manifest"]),
                manifest_size=size,
                step=step,
                created_ns=created,
                parent=check_name(parent) if parent is not None else None,
                totals=stats,
                version=version,
                parity=check_hash(doc["parity"]) if doc.get("parity") is not None else None,
            )
        except CheckpointError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        except KeyError as exc:
            raise ManifestError(f"{where}: malformed commit record (missing field {exc})") from None
        except (ValueError, TypeError) as exc:
            raise ManifestError(f"{where}: malformed commit record ({exc})") from None
