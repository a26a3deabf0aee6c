"""Asynchronous saves still running in this process: at most one per repository.

A save or asynchronous save to a repository first waits for the previous one
to that repository and raises its error if it failed, so a failure is never
lost and saves commit in the order they were made. At interpreter exit,
pending saves are finished (a killed process commits nothing: spec 11.1).
"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future

from ckptfmt._platform import before_thread_shutdown
from ckptfmt.errors import CheckpointWarning
from ckptfmt.repository.repository import split_checkpoint_url

_pending: dict[str, Future] = {}
_lock = threading.Lock()


def repository_key(url: str | os.PathLike) -> str:
    """The repository of checkpoint ``url``, in a form two spellings of one local path share."""
    repo_url, _ = split_checkpoint_url(url)
    return repo_url if "://" in repo_url else os.path.abspath(repo_url)


def wait_for_previous(url: str | os.PathLike) -> None:
    """Wait for the pending save to ``url``'s repository, if any; raise its error if it failed."""
    with _lock:
        previous = _pending.pop(repository_key(url), None)
    if previous is not None:
        previous.result()


def register(url: str | os.PathLike, future: Future) -> None:
    with _lock:
        _pending[repository_key(url)] = future


def _finish_pending() -> None:
    with _lock:
        pending = list(_pending.items())
        _pending.clear()
    for repository, future in pending:
        try:
            future.result()
        except Exception as exc:
            warnings.warn(f"the asynchronous save to {repository} failed at exit: {exc}", CheckpointWarning,
                          stacklevel=1)


# Pending saves must finish before concurrent.futures refuses new work at exit.
before_thread_shutdown(_finish_pending)
