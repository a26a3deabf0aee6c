"""This process's resumes not yet on record: each is stored by the next committed save (spec 9.4, 1.8).

A resume (``ckptfmt.record_resume``, ``restore``, ``CheckpointManager.restore``, an
integration's) notes what it restored here; the next save of this process puts the
notes in its rank's ``timing.ranks`` entry as ``resumes``, and they leave once that
checkpoint is committed, as a step timer's steps do. A failed save leaves them for the
next one.
"""

from __future__ import annotations

import threading

_PENDING: list[dict] = []
_LOCK = threading.Lock()


def note_resume(record: dict) -> None:
    """Keep ``record`` (a ``resumes`` entry) for the next save of this process. It replaces a record not yet
    stored of the same rank's resume from the same checkpoint: one resume recorded twice (``restore()``,
    then the loop's own ``record_resume`` of the objects it loaded) is one resume, the later record the
    one that knows more."""
    with _LOCK:
        _PENDING[:] = [kept for kept in _PENDING if not _same_resume(kept, record)]
        _PENDING.append(record)


def _same_resume(a: dict, b: dict) -> bool:
    return a.get("rank") == b.get("rank") and a.get("from") == b.get("from")


def pending_resumes() -> list[dict]:
    """The resumes not yet stored, oldest first (a copy: a save captures them when it is called)."""
    with _LOCK:
        return list(_PENDING)


def forget_resumes(stored: list[dict] | None) -> None:
    """Drop the records a committed checkpoint holds."""
    if not stored:
        return
    with _LOCK:
        _PENDING[:] = [record for record in _PENDING if all(record is not s for s in stored)]
