"""Checking the parity across nodes a node keeps (spec 9.8, 2.1): part of ``verify`` on a node.

A node of a node-scoped checkpoint may keep a record of parity pieces (``peer_parity``): the record must
parse and fit the checkpoint's stripes, and each piece it lists must be there, exactly its length, and
hash to what the record says. What is wrong is said per object; nothing here repairs (the next save's
parity protects the next checkpoint; a rebuild counts a damaged piece as lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.node_parity import MAX_RECORD_BYTES, NodeParityRecord, piece_key, record_key
from ckptfmt.repository.repository import Repository


@dataclass
class NodeParityCheck:
    """What one node's parity of one checkpoint came to: the damaged objects (key -> why) and the bytes read."""

    damaged: dict[str, str] = field(default_factory=dict)
    bytes_checked: int = 0


def check_node_parity(repo: Repository, name: str, manifest_hash: str, manifest: Manifest,
                      host: str) -> NodeParityCheck | None:
    """Check the parity ``host`` keeps here of checkpoint ``name``; None where it keeps none."""
    key = record_key(name, host)
    where = repo.storage.describe(key)
    found = NodeParityCheck()
    try:
        record = NodeParityRecord.from_bytes(repo.storage.read(key, max_size=MAX_RECORD_BYTES), where)
        if record.manifest_hash != manifest_hash or record.name != name or record.holder != host:
            raise CheckpointError(f"{where}: a record of {record.name} on {record.holder} (manifest "
                                  f"{record.manifest_hash[:16]}...), not of this checkpoint on {host}")
        record.check_layout(manifest)
    except CheckpointNotFoundError:
        return None
    except CheckpointError as exc:
        found.damaged[key] = f"{exc}" if str(exc).startswith(where) else f"{where}: {exc}"
        return found
    for piece in record.pieces:
        key = piece_key(name, host, piece.index, piece.place)
        where = repo.storage.describe(key)
        try:
            data = repo.storage.read(key, max_size=piece.length)
        except CheckpointNotFoundError:
            found.damaged[key] = f"{where}: parity piece missing"
            continue
        except CheckpointError as exc:
            found.damaged[key] = str(exc)
            continue
        found.bytes_checked += len(data)
        if len(data) != piece.length or chunk_hash(data) != piece.digest:
            found.damaged[key] = f"{where}: parity piece damaged (its hash or length is not the record's)"
    return found


__all__ = ["NodeParityCheck", "check_node_parity"]
