"""History objects (spec 4.5, 1.8): a removed checkpoint's run history, kept in the repository.

A checkpoint's manifest holds the run's history since the checkpoint before it:
every rank's training steps and system samples and its own save's timing
(``timing``). Removing the checkpoint
(retention, ``rm``, a framework's rotation) would take that history with it,
so the removal first writes it to ``REPO/_history/<created_ns>.<NAME>.<h>.msgpack``,
a msgpack map named by its own BLAKE3 hash ``h``. History objects are never
deleted and never changed; the history of a run is its committed checkpoints'
manifests plus the history objects of the removed ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from ckptfmt.errors import CheckpointError, CorruptDataError, ManifestError, quoted
from ckptfmt.format.features import version_fields
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.layout import HISTORY_DIR
from ckptfmt.format.limits import MAX_MANIFEST_BYTES, check_hash, check_name
from ckptfmt.format.maps import unpack_object
from ckptfmt.format.version import FORMAT_VERSION

if TYPE_CHECKING:
    from ckptfmt.format.commit_record import CommitRecord
    from ckptfmt.format.manifest import Manifest

HISTORY_FORMAT = "ckptfmt-history"
#: A history object holds at most what a manifest may.
MAX_HISTORY_BYTES = MAX_MANIFEST_BYTES
_KEY = re.compile(r"(\d{19})\.([A-Za-z0-9][A-Za-z0-9._-]{0,127})\.([0-9a-f]{64})\.msgpack")


@dataclass(frozen=True)
class HistoryKey:
    """What a history object's key says: the checkpoint it came from and the hash of its bytes."""

    created_ns: int
    name: str
    digest: str

    @property
    def key(self) -> str:
        return f"{HISTORY_DIR}/{self.created_ns:019d}.{check_name(self.name)}.{check_hash(self.digest)}.msgpack"

    @classmethod
    def parse(cls, entry: str) -> HistoryKey | None:
        """The parts of an entry listed under ``_history/`` (its base name), or None for anything else
        (a temporary file, a foreign object: readers ignore those)."""
        match = _KEY.fullmatch(entry)
        if match is None or match[2].lower() in ("chunks", "ckptfmt.json"):
            return None
        return cls(int(match[1]), match[2], match[3])


@dataclass(frozen=True)
class History:
    """One removed checkpoint's history: its identity and the manifest's history fields as stored."""

    name: str
    manifest_hash: str
    step: int | None
    created_ns: int
    parent: str | None
    world_size: int | None
    #: The manifest's ``timing`` map (spec 9.4), unchanged.
    timing: dict

    @classmethod
    def of(cls, record: CommitRecord, manifest: Manifest) -> History:
        """The history a committed checkpoint holds (its manifest read with at least ``timing`` and
        ``topology``)."""
        topology = manifest.topology if isinstance(manifest.topology, dict) else {}
        world_size = topology.get("world_size")
        return cls(name=record.name, manifest_hash=record.manifest_hash, step=record.step,
                   created_ns=record.created_ns, parent=record.parent,
                   world_size=world_size if type(world_size) is int and world_size > 0 else None,
                   timing=manifest.timing)

    def to_bytes(self, version: tuple[int, int] = FORMAT_VERSION) -> bytes:
        """The stored form, for readers of ``version`` (its repository's marker's): the same history
        always gives the same bytes, hence the same key."""
        return msgpack.packb({
            "format": HISTORY_FORMAT, **version_fields(version), "name": self.name,
            "manifest": self.manifest_hash, "step": self.step, "created_ns": self.created_ns,
            "parent": self.parent, "world_size": self.world_size, "timing": self.timing,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, expected: HistoryKey, where: str) -> History:
        """Parse a history object read at ``expected``'s key: its hash and identity must match the key."""
        if len(data) > MAX_HISTORY_BYTES:
            raise ManifestError(f"{where}: history object of {len(data)} bytes is over the {MAX_HISTORY_BYTES} limit")
        actual = chunk_hash(data)
        if actual != expected.digest:
            raise CorruptDataError(f"{where}: hash mismatch (expected {expected.digest[:16]}..., got {actual[:16]}...)")
        doc = unpack_object(data, where, HISTORY_FORMAT, MAX_HISTORY_BYTES)
        try:
            return cls._from_dict(doc, expected)
        except CheckpointError as exc:
            raise type(exc)(f"{where}: {exc}") from None

    @classmethod
    def _from_dict(cls, doc: dict, expected: HistoryKey) -> History:
        name, created, step = doc.get("name"), doc.get("created_ns"), doc.get("step")
        if (name, created) != (expected.name, expected.created_ns):
            raise ManifestError(f"its name and created_ns ({quoted(name)}, {quoted(created)}) differ from its key's")
        if step is not None and type(step) is not int:
            raise ManifestError("step is not an integer")
        world_size = doc.get("world_size")
        if world_size is not None and (type(world_size) is not int or world_size < 1):
            raise ManifestError(f"world_size {quoted(world_size)} is not a positive integer")
        parent = doc.get("parent")
        timing = doc.get("timing") or {}
        if not isinstance(timing, dict):
            raise ManifestError("timing is not a map")
        return cls(name=check_name(name), manifest_hash=check_hash(doc.get("manifest")), step=step,
                   created_ns=expected.created_ns, parent=None if parent is None else check_name(parent),
                   world_size=world_size, timing=timing)

    def key(self, data: bytes) -> HistoryKey:
        """The key of this history stored as ``data`` (its ``to_bytes()``)."""
        return HistoryKey(self.created_ns, self.name, chunk_hash(data))
