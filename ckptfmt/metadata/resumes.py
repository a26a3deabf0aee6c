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
    """Keep ``record`` (a ``resumes`` entry) for the next save of this process."""
    with _LOCK:
        _PENDING.append(record)


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
