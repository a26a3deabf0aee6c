"""Progress objects (spec 4.6, 1.9): written as a process trains, read by ``ckptfmt goodput``.

A resume writes its record at once to a progress object of its own in the
repository it resumed from (``ProgressWriter.write_now``, 1.15), so that a process
killed before its first save is still on record as a restart; the process's step
timer then takes that object over at its first step. A save with a ``StepTimer``
binds the timer to its repository otherwise (``bind``): from
then on, at the end of a step (or a save's return) at least
``StepTimer(progress_interval=...)`` seconds after its last write, the timer's steps not yet saved are written to
this process's progress object on a background thread (one write in flight at
a time, so a slow store costs the loop nothing; a failed write is retried at the
next interval, with one warning). The thread is one for the process and kept:
starting a thread per write held the loop until the new thread let go of the
interpreter, 1-3 ms a step on a busy machine. What a killed process computed after its last
save, and when it stopped, is then on record to within an interval.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptfmt.errors import CheckpointError, CheckpointWarning
from ckptfmt.format.layout import PROGRESS_DIR
from ckptfmt.format.progress import MAX_PROGRESS_BYTES, Progress, ProgressKey
from ckptfmt.repository.repository import Repository

#: Seconds between rewrites of a process's progress object by default (``StepTimer(progress_interval=...)``).
DEFAULT_INTERVAL_S = 10.0


class ProgressWriter:
    """Rewrites this process's progress object in ``repo`` with a timer's unsaved steps (a ``StepTimer``,
    which sits above this layer: anything with its ``progress_record()``)."""

    def __init__(self, repo: Repository, rank: int, interval_s: float, *, provisional: bool = False):
        self.repo, self.interval_s = repo, interval_s
        #: Made for a resume, in the repository resumed from: a timer's first save moves its steps to the
        #: repository it saves to, where that is another one.
        self.provisional = provisional
        self.key = ProgressKey(time.time_ns(), rank, os.getpid())  # one object per timer bound, or resume
        _MADE.add(self)
        #: This rank's resumes that no committed save holds yet (spec 9.4 ``resumes``), in every write.
        self.resumes: list[dict] = []
        self._last = -float("inf")
        self._busy = threading.Lock()
        #: A timer whose state to write once the write in flight is done (asked for while it ran).
        self._again: Any = None
        #: The timer that writes here (its last ``maybe_write``), whose steps every write holds.
        self._timer: Any = None
        self._warned = False
        self._host = socket.gethostname()

    def maybe_write(self, timer: Any) -> None:
        """At a step's end, its metrics or a save's return: start a write if the interval has passed; with
        one in flight, that write is followed by one of the state now (the last step's metrics, recorded
        just after its end, are not left to a write that may never come)."""
        self._timer = timer
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        if not self._busy.acquire(blocking=False):
            self._again = timer
            return
        self._last = now
        data = self._record(timer)  # here: the thread then holds the interpreter only to write
        _writer().submit(self._write, data)

    def write_now(self) -> None:
        """Write the object now, on this thread, once the write in flight is done (a resume: on record before
        the loop goes on), with the steps of the timer that writes here, if one does."""
        with self._busy:
            try:
                self.repo.storage.write(self.key.key, self._record(self._timer), durable=False)
            except (CheckpointError, OSError) as exc:
                warnings.warn(f"progress of rank {self.key.rank} not written to {self.repo.url} ({exc}); "
                              "ckptfmt goodput will not see this resume if the process ends before its next save",
                              CheckpointWarning, stacklevel=3)

    def _record(self, timer: Any) -> bytes:
        steps, stalls = timer.progress_record() if timer is not None else (None, None)
        return Progress(self.key.started_ns, self.key.rank, self.key.pid, self._host, time.time_ns(), steps,
                        stalls, list(self.resumes) or None).to_bytes(self.repo.format_version)

    def _write(self, data: bytes) -> None:
        """Write ``data``, then the state asked for meanwhile, if any (``maybe_write``)."""
        while True:
            try:
                self.repo.storage.write(self.key.key, data, durable=False)
            except (CheckpointError, OSError) as exc:
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"progress of rank {self.key.rank} not written to {self.repo.url} ({exc}); "
                                  "ckptfmt goodput will not see the steps since the last save", CheckpointWarning,
                                  stacklevel=2)
            self._busy.release()
            timer = self._again
            if timer is None or not self._busy.acquire(blocking=False):
                return  # none asked for, or the loop has started that write itself
            self._again = None
            data = self._record(timer)


_WRITER: ThreadPoolExecutor | None = None
#: This process's progress writers, for the resumes a save has stored (``forget_stored_resumes``).
_MADE: weakref.WeakSet = weakref.WeakSet()


def _writer() -> ThreadPoolExecutor:
    """The process's one progress-writing thread (made at the first write; a forked child makes its own)."""
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-progress")
    return _WRITER


def _forget_writer_in_child() -> None:
    global _WRITER
    _WRITER = None


os.register_at_fork(after_in_child=_forget_writer_in_child)


def bind(timer: Any, checkpoint_url: str, storage_options: dict | None, rank: int) -> None:
    """Bind ``timer`` to the repository of the checkpoint it was just saved with (once: the first
    repository it saved to), as rank ``rank``."""
    bind_repository(timer, checkpoint_url.rstrip("/").rsplit("/", 1)[0], storage_options, rank)


def bind_repository(timer: Any, repo_url: str, storage_options: dict | None, rank: int) -> None:
    """Bind ``timer`` to the repository at ``repo_url`` (once), as rank ``rank``: for a rank whose steps
    another rank saves (a framework that writes from rank 0 only). A timer writing to its resume's object
    stays there if this is that repository, else moves here with the resumes. Raises ``CheckpointError``
    where there is no repository yet."""
    writer = timer.progress
    if timer.progress_interval is None or writer is not None and not writer.provisional:
        return
    repo = Repository.open(repo_url, storage_options)
    if writer is not None:
        writer.provisional = False
        if (writer.repo.url, writer.key.rank) == (repo.url, rank):
            return
    timer.progress = ProgressWriter(repo, rank, timer.progress_interval)
    if writer is not None:
        timer.progress.resumes = writer.resumes


def forget_stored_resumes(stored: list[dict]) -> None:
    """Resumes a committed save holds: no progress object of this process needs them any more."""
    for writer in list(_MADE):
        writer.resumes = [kept for kept in writer.resumes if all(kept is not s for s in stored)]


def progress_keys(repo: Repository) -> list[ProgressKey]:
    """Every progress object of the repository, oldest process first (other entries are ignored)."""
    keys = [key for entry in repo.storage.list(PROGRESS_DIR) if (key := ProgressKey.parse(entry)) is not None]
    return sorted(keys, key=lambda k: (k.started_ns, k.rank, k.pid))


def read_progress(repo: Repository) -> list[Progress]:
    """The progress objects that can be read; a damaged one is skipped with a warning."""
    found: list[Progress] = []
    for key in progress_keys(repo):
        where = repo.storage.describe(key.key)

        def parse(data: bytes, key: ProgressKey = key, where: str = where) -> Progress:
            return Progress.from_bytes(data, key, where)
        try:
            found.append(repo.storage.read_checked(key.key, max_size=MAX_PROGRESS_BYTES, check=parse))
        except CheckpointError as exc:
            warnings.warn(f"progress object skipped: {exc}", CheckpointWarning, stacklevel=2)
    return found
