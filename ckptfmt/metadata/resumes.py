"""This process's resumes not yet on record: each is stored by the next committed save (spec 9.4, 1.8).

A resume (``ckptfmt.record_resume``, ``restore``, ``CheckpointManager.restore``, an
integration's) notes what it restored here; the next save of this process puts the
notes in its rank's ``timing.ranks`` entry as ``resumes``, and they leave once that
checkpoint is committed, as a step timer's steps do. A failed save leaves them for the
next one. Until then they are in this process's progress object of the repository it
resumed from, written at once (spec 4.6, 1.15): a process that dies before its first
save is on record as a restart all the same, and its step timer writes its steps to
that object from its first step on (``take_resumed_progress``).
"""

from __future__ import annotations

import threading

from ckptfmt.repository.progress import DEFAULT_INTERVAL_S, ProgressWriter, forget_stored_resumes
from ckptfmt.repository.repository import Repository

_PENDING: list[dict] = []
_LOCK = threading.Lock()
#: The progress writer of this process's last resume, and whether a step timer has taken it over.
_RESUMED: list[ProgressWriter] = []
_TAKEN: list[bool] = [False]


def note_resume(record: dict, repository: Repository | None = None) -> None:
    """Keep ``record`` (a ``resumes`` entry) for the next save of this process, and put it on record in
    ``repository`` (the one it resumed from) at once. It replaces a record not yet stored of the same rank's
    resume from the same checkpoint: one resume recorded twice (``restore()``, then the loop's own
    ``record_resume`` of the objects it loaded) is one resume, the later record the one that knows more."""
    with _LOCK:
        _PENDING[:] = [kept for kept in _PENDING if not _same_resume(kept, record)]
        _PENDING.append(record)
        mine = [kept for kept in _PENDING if kept.get("rank") == record.get("rank")]
    if repository is None or type(record.get("rank")) is not int:
        return
    with _LOCK:  # the same writer again for the same place: a resume recorded twice is in one object
        if not (_RESUMED and _same_place(_RESUMED[0], repository, record["rank"])):
            writer = ProgressWriter(repository, record["rank"], DEFAULT_INTERVAL_S, provisional=True)
            _RESUMED[:], _TAKEN[0] = [writer], False
        writer = _RESUMED[0]
    writer.resumes = mine
    writer.write_now()


def take_resumed_progress() -> ProgressWriter | None:
    """The progress writer of this process's last resume (``note_resume``), for the step timer that takes it
    over (once: None afterwards, before any resume, and once a save has stored the resume)."""
    with _LOCK:  # a resume a save has stored since is no longer the process's latest news
        if not _RESUMED or _TAKEN[0] or not any(any(r is p for p in _PENDING) for r in _RESUMED[0].resumes):
            return None
        _TAKEN[0] = True
        return _RESUMED[0]


def _same_place(writer: ProgressWriter, repository: Repository, rank: int) -> bool:
    return (writer.repo.url, writer.key.rank) == (repository.url, rank)


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
    forget_stored_resumes(stored)
