"""Chunk files this process has checked against their names, for reads with ``verify="once"``.

A chunk is content-addressed and ckptfmt never rewrites one, so a local chunk file that this process
hashed and found right, and whose path, device, inode, size, modification time and change time are
still the same, is taken to hold the same bytes: a later read with ``verify="once"`` skips hashing it
again. What this trusts, exactly: that nothing rewrote the file in place without changing those
times (the change time cannot be set back by an ordinary program) and that the storage did not
corrupt the bytes between the two reads. Object stores are never trusted this way. The memory is the
process's own, bounded (the last ``LIMIT`` files), and gone when it ends.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Literal

from ckptfmt.storage.base import Storage

#: Files remembered at most (the oldest are forgotten first).
LIMIT = 1 << 17
#: How a read checks chunks: every time, the first time in this process, or never (sizes only).
#: How reads are checked: every read hashed (True), each local chunk file once a process ("once"), none.
VerifyMode = Literal[True, "once", False]
VERIFY_MODES: tuple[VerifyMode, ...] = (True, "once", False)

FileIdentity = tuple[str, int, int, int, int, int]

_seen: OrderedDict[FileIdentity, None] = OrderedDict()
_lock = threading.Lock()


def check_verify_mode(verify: object) -> VerifyMode:
    """``verify`` if it is one of ``VERIFY_MODES``; ValueError naming them otherwise."""
    if not any(verify is mode or (isinstance(mode, str) and verify == mode) for mode in VERIFY_MODES):
        raise ValueError(f"verify must be True, 'once' or False, not {verify!r}")
    return verify  # type: ignore[return-value]


def identity(storage: Storage, key: str) -> FileIdentity | None:
    """What a local chunk file is now (None for other storages, or where it cannot be looked at)."""
    if not storage.zero_copy_reads:
        return None
    path = storage.path(key)
    try:
        info = os.stat(path)
    except OSError:
        return None
    return path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def known(file: FileIdentity | None) -> bool:
    """Whether this process has checked this very file."""
    if file is None:
        return False
    with _lock:
        if file in _seen:
            _seen.move_to_end(file)
            return True
    return False


def remember(file: FileIdentity | None) -> None:
    """This process has just checked ``file`` (taken before it was read) and found it right."""
    if file is None:
        return
    with _lock:
        _seen[file] = None
        _seen.move_to_end(file)
        while len(_seen) > LIMIT:
            _seen.popitem(last=False)
