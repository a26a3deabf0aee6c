"""``async_save``: a save that costs the training loop a copy of its state, not the writing.

The state is staged (copied into reused host buffers, saving/staging.py) in
the caller's thread; hashing, writing, the collectives of a collective save
and the commit run on one background thread. One save per repository is in
flight: the next save or async_save to it waits for the previous one first
(saving/in_flight.py).

An ``AsyncSaver`` owns the staging buffers (a full host copy of each state it
saved, kept for the next save) and the thread; ``close()`` gives both back.
``ckptfmt.async_save`` uses a default saver that lives as long as the process;
a ``CheckpointManager`` has its own, closed with the manager.

A thread, not a process: hashing (BLAKE3), compression and file and network
I/O release the GIL, so the background save takes little from the training
thread (measured in bench/distributed.py), and the staged buffers are shared
without a copy into another process's memory.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptfmt.metadata.resumes import forget_resumes, pending_resumes
from ckptfmt.metadata.rng import capture_states
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.metadata.topology import current_rank
from ckptfmt.repository.progress import bind as bind_progress
from ckptfmt.saving import in_flight
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.records import Captured
from ckptfmt.saving.save import run_save, step_records
from ckptfmt.saving.staging import StagingArea
from ckptfmt.tensors.stateful import states_taken


class AsyncSaver:
    """Asynchronous saves with their own staging buffers (one area per repository) and thread."""

    def __init__(self):
        self._areas: dict[str, StagingArea] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def save(self, state: Any, url: str | os.PathLike, options: SaveOptions, *,
             timer: StepTimer | None = None) -> Future:
        """Stage ``state`` and save it in the background; the future gives the checkpoint's URL."""
        if options.before_commit is not None:
            raise ValueError("before_commit is for synchronous saves")
        began_ns = time.time_ns()
        in_flight.wait_for_previous(url)  # also: the staging buffers are free again
        steps = step_records(timer)  # the steps up to the call, as the state is
        # The generators as they are now: the loop draws on while this saves.
        rng = capture_states() if options.records_own_rng else None
        start_ns, start = time.time_ns(), time.perf_counter()
        area = self.staging_area(url)
        area.tensor_stats = options.tensor_stats
        staged = area.stage(states_taken(state))
        captured = Captured(steps=steps, rng=rng, staged=(start_ns, time.perf_counter() - start), frozen=True,
                            device_stats=area.device_stats, resumes=pending_resumes())
        future = self._background().submit(_save_staged, staged, url, options, captured, timer)
        in_flight.register(url, future)
        if timer is not None:
            timer.held(began_ns, (time.time_ns() - began_ns) / 1e9)
        return future

    def close(self) -> None:
        """Wait for this saver's saves, end its thread and free its staging buffers.

        Errors of those saves stay with their futures (and are raised by the next
        save to the same repository). The saver can be used again afterwards.
        """
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        with self._lock:
            self._areas.clear()

    def staging_area(self, url: str | os.PathLike) -> StagingArea:
        """The host buffers that stage saves to the repository of checkpoint ``url`` (made on first use)."""
        with self._lock:
            return self._areas.setdefault(in_flight.repository_key(url), StagingArea())

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory this saver's staging buffers hold."""
        with self._lock:
            return sum(area.nbytes for area in self._areas.values())

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _background(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-async-save")
            return self._executor


def _save_staged(staged: Any, url: str | os.PathLike, options: SaveOptions, captured: Captured,
                 timer: StepTimer | None) -> str:
    """The background part; the timer's steps it stored leave the timer before the future is done."""
    committed = run_save(staged, url, options, captured)
    if timer is not None:
        if captured.steps is not None:
            timer.forget_stored(captured.steps)
        bind_progress(timer, committed, options.storage_options, current_rank()[0])
    forget_resumes(captured.resumes)
    return committed


#: The saver of ``ckptfmt.async_save``.
DEFAULT_SAVER = AsyncSaver()


def async_save(state: Any, url: str | os.PathLike, *, timer: StepTimer | None = None, **options: Any) -> Future:
    """Save ``state`` as checkpoint ``url`` in the background; returns once the state is staged.

    Takes ``save``'s keywords and is collective in the same way. The returned
    ``concurrent.futures.Future`` gives the checkpoint's URL once committed
    (``result(timeout)``, ``done()``, ``exception()``). The caller may change
    its tensors as soon as this returns: what is saved is the state at the call.
    Its staging buffers are kept for the next call (``DEFAULT_SAVER.close()``
    frees them).
    """
    return DEFAULT_SAVER.save(state, url, SaveOptions.from_keywords("async_save", options), timer=timer)
