"""Where things live in a repository (spec 4.1): the keys of the marker, chunks, manifests and commits,
and the one registry of the side objects beside them.

    REPO/ckptfmt.json                          the marker: format name and version
    REPO/chunks/<h[0:2]>/<h>[.<codec>[.<b>]]   content-addressed chunks (b: a delta's base chunk)
    REPO/NAME/manifest-<manifest hash>.msgpack one checkpoint's manifest
    REPO/NAME/COMMIT                           its commit record, written last

Every other object is a side object of ``SIDE_OBJECTS``: in a folder of its own at the top (not a valid
checkpoint name, so readers that do not know it ignore it) or beside a checkpoint's manifest. The modules
named there parse their own keys; what lists a repository or a checkpoint's folder asks this registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptfmt.format.codecs import NONE, check_codec, is_delta
from ckptfmt.format.limits import HASH_PATTERN, check_hash, check_name

MARKER_KEY = "ckptfmt.json"
CHUNKS_DIR = "chunks"
COMMIT_NAME = "COMMIT"
#: The side objects' folders at the top: not valid checkpoint names (spec 4.2).
INDEX_DIR = "_index"
LEASES_DIR = "_leases"
HISTORY_DIR = "_history"
PROGRESS_DIR = "_progress"
PARITY_DIR = "_parity"


@dataclass(frozen=True)
class SideObject:
    """One kind of side object: what it is, where it lives, its key scheme (for people: its module parses
    it), the version that brought it and the module that owns it."""

    what: str
    scheme: str
    since: tuple[int, int]
    module: str
    #: Its top-level folder, or None: it lives in a checkpoint's folder, its entries starting with ``prefix``.
    folder: str | None = None
    prefix: str | None = None


SIDE_OBJECTS = (
    SideObject("commit index", "_index/e/<created_ns>.<NAME>.<m>, _index/p/<seq>.<count>.<newest_ns>.<tag>.json",
               (1, 3), "repository/index.py", folder=INDEX_DIR),
    SideObject("lease", "_leases/<kind>-<16 hex>.json", (1, 3), "repository/leases.py", folder=LEASES_DIR),
    SideObject("run history", "_history/<created_ns>.<NAME>.<h>.msgpack", (1, 8), "format/history.py",
               folder=HISTORY_DIR),
    SideObject("progress", "_progress/<started_ns>.<rank>.<pid>.msgpack", (1, 9), "format/progress.py",
               folder=PROGRESS_DIR),
    SideObject("parity object, parity record copy",
               "_parity/<p[:2]>/<p>.<j>, _parity/records/NAME/parity-<r>.<i>.msgpack", (2, 1),
               "format/parity_record.py", folder=PARITY_DIR),
    SideObject("signature", "NAME/signature-<key id>.json", (1, 7), "format/signatures.py", prefix="signature-"),
    SideObject("copy record", "NAME/copy-<host>.json", (1, 10), "format/copies.py", prefix="copy-"),
    SideObject("parity record", "NAME/parity-<r>.msgpack", (2, 1), "format/parity_record.py", prefix="parity-"),
    SideObject("node parity", "NAME/node-parity-<host>.msgpack, NAME/node-parity-<host>.<round>.<j>.bin", (2, 1),
               "format/node_parity.py", prefix="node-parity-"),
)
#: The top-level entries that are no checkpoint: the marker, the chunk store and the side objects' folders.
RESERVED_ENTRIES = frozenset({MARKER_KEY, CHUNKS_DIR, *(o.folder for o in SIDE_OBJECTS if o.folder)})
_MANIFEST_ENTRY = re.compile(r"manifest-([0-9a-f]{64})\.msgpack")


def chunk_key(digest: str, codec: str, base: str | None = None) -> str:
    """The key of a chunk; the codec suffix keeps differently encoded copies apart, and a delta's
    ``base`` (the base chunk's hash) those encoded against different bases."""
    check_hash(digest)
    if is_delta(check_codec(codec)) != (base is not None):
        raise ValueError(f"a {codec} chunk {'needs' if base is None else 'takes no'} base")
    suffix = "" if codec == NONE else f".{codec}" if base is None else f".{codec}.{check_hash(base)}"
    return f"{CHUNKS_DIR}/{digest[:2]}/{digest}{suffix}"


def manifest_key(name: str, digest: str) -> str:
    return f"{check_name(name)}/manifest-{check_hash(digest)}.msgpack"


def manifest_digest(entry: str) -> str | None:
    """The manifest hash a checkpoint folder's entry names (``manifest-<hash>.msgpack``), else None."""
    match = _MANIFEST_ENTRY.fullmatch(entry)
    return match[1] if match is not None and HASH_PATTERN.fullmatch(match[1]) else None


def manifest_digests(entries: list[str]) -> set[str]:
    """The manifest hashes a checkpoint folder's entries name."""
    return {d for d in map(manifest_digest, entries) if d is not None}


def commit_key(name: str) -> str:
    return f"{check_name(name)}/{COMMIT_NAME}"
