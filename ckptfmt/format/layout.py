"""Where things live in a repository: the keys of the marker, chunks, manifests and commits.

    REPO/ckptfmt.json                          the marker: format name and version
    REPO/chunks/<h[0:2]>/<h>[.<codec>[.<b>]]   content-addressed chunks (b: a delta's base chunk)
    REPO/NAME/manifest-<manifest hash>.msgpack one checkpoint's manifest
    REPO/NAME/COMMIT                           its commit record, written last
    REPO/_index/...                            the commit index (index.py)
    REPO/_leases/...                           leases of running saves and collectors (leases.py)
    REPO/_parity/...                           parity objects and copies of parity records (parity_record.py)
"""

from __future__ import annotations

from ckptfmt.format.codecs import NONE, check_codec, is_delta
from ckptfmt.format.limits import check_hash, check_name

MARKER_KEY = "ckptfmt.json"
CHUNKS_DIR = "chunks"
COMMIT_NAME = "COMMIT"
#: Save and gc leases (spec 11.6); not a valid checkpoint name, like the commit index's ``_index``.
LEASES_DIR = "_leases"
#: Parity objects and copies of parity records (spec 5.6, 2.1).
PARITY_DIR = "_parity"


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


def commit_key(name: str) -> str:
    return f"{check_name(name)}/{COMMIT_NAME}"
