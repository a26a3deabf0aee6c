"""Pointer files: a small JSON object at a path that names a checkpoint of its folder's repository.

The Lightning plug-in writes one at every path Lightning saves (``REPO/last.ckpt``,
``REPO/epoch=1-step=200.ckpt``: ``{"format": "ckptfmt-lightning-pointer", "checkpoint": "last-4"}``),
so that Lightning's own file operations work unchanged. Every reader takes such a path where a
checkpoint URL is taken (``ckptfmt show runs/lit/last.ckpt``), and ``ls`` names checkpoints by the
paths that point at them, as Lightning's users know them.
"""

from __future__ import annotations

import json
import posixpath

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.storage.base import Storage

#: The ``format`` of a pointer file.
POINTER_FORMAT = "ckptfmt-lightning-pointer"
#: A pointer file is small; a larger object at a checkpoint path is not one.
MAX_POINTER_BYTES = 64 * 2**10
#: The suffix of the paths Lightning saves to.
POINTER_SUFFIX = ".ckpt"


def read_small(storage: Storage, key: str) -> bytes | None:
    """The bytes at ``key`` if it is a small object (a pointer may be there), else None (absent, a folder
    such as a checkpoint's, a device, or too big to be a pointer)."""
    try:
        size = storage.size(key)
    except CorruptDataError:  # not a regular file
        return None
    if size is None or size > MAX_POINTER_BYTES:
        return None
    try:
        return storage.read(key, max_size=MAX_POINTER_BYTES)
    except CheckpointNotFoundError:
        return None


def looks_like_pointer(data: bytes) -> bool:
    return data.lstrip().startswith(b"{") and POINTER_FORMAT.encode() in data


def pointed_name(data: bytes, where: str) -> str:
    """The checkpoint name a pointer file holds; CheckpointError naming ``where`` for a damaged one."""
    try:
        document = json.loads(data)
        name = document["checkpoint"]
        if document.get("format") != POINTER_FORMAT or not isinstance(name, str):
            raise ValueError("not a pointer")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: a damaged ckptfmt pointer ({exc})") from None
    return posixpath.basename(name)


def read_pointer(storage: Storage, key: str) -> str | None:
    """The name of the checkpoint the pointer file at ``key`` names; None when no pointer is there."""
    data = read_small(storage, key)
    if data is None or not looks_like_pointer(data):
        return None
    return pointed_name(data, storage.describe(key))


def pointers(storage: Storage, entries: list[str]) -> dict[str, list[str]]:
    """Checkpoint name -> the pointer files among the repository's top-level ``entries`` that name it."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        if not entry.endswith(POINTER_SUFFIX):
            continue
        try:
            name = read_pointer(storage, entry)
        except CheckpointError:  # a damaged pointer names nothing
            continue
        if name is not None:
            found.setdefault(name, []).append(entry)
    return found
