"""``async_save``: a save that costs the training loop a copy of its state, not the writing.

The state is staged (copied into reused host buffers, ckptfmt/staging.py) in
the caller's thread; hashing, writing, the collectives of a collective save
and the commit run on one background thread per process. One save per
repository is in flight: the next save or async_save to it waits for the
previous one first (ckptfmt/in_flight.py).

A thread, not a process: hashing (BLAKE3), compression and file and network
I/O release the GIL, so the background save takes little from the training
thread (measured in bench/distributed.py), and the staged buffers are shared
without a copy into another process's memory.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptfmt.saving import in_flight
from ckptfmt.metadata.rng import capture_states
from ckptfmt.saving.staging import StagingArea
from ckptfmt.saving.writer import save, save_state, step_records

_executor: ThreadPoolExecutor | None = None
_areas: dict[str, StagingArea] = {}
_lock = threading.Lock()
_SAVE_SIGNATURE = inspect.signature(save)


def async_save(state: Any, url: str | os.PathLike, **options: Any) -> Future:
    """Save ``state`` as checkpoint ``url`` in the background; returns once the state is staged.

    Takes ``save``'s arguments and is collective in the same way. The returned
    ``concurrent.futures.Future`` gives the checkpoint's URL once committed
    (``result(timeout)``, ``done()``, ``exception()``). The caller may change
    its tensors as soon as this returns: what is saved is the state at the call.
    """
    bound = _SAVE_SIGNATURE.bind(state, url, **options)  # a wrong argument fails here, not in the background
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["state"], arguments["url"]
    timer = arguments.pop("timer")
    if arguments["before_commit"] is not None:
        raise ValueError("before_commit is for synchronous saves")
    in_flight.wait_for_previous(url)  # also: the staging buffers are free again
    steps = step_records(timer)  # the steps up to the call, as the state is
    if arguments["rng"] is None:  # the generators as they are now: the loop draws on while this saves
        arguments["captured_rng"] = capture_states()
    start_ns, start = time.time_ns(), time.perf_counter()
    staged = _area(url).stage(state)
    arguments["staged"] = (start_ns, time.perf_counter() - start)  # the stall: recorded as phase "stage"
    future = _background().submit(_save_staged, staged, url, timer, steps, arguments)
    in_flight.register(url, future)
    return future


def _save_staged(staged: Any, url: str | os.PathLike, timer, steps: dict | None, arguments: dict) -> str:
    """The background part; the timer's steps it stored leave the timer before the future is done."""
    committed = save_state(staged, url, frozen=True, steps=steps, **arguments)
    if timer is not None:
        timer.forget(steps["count"])
    return committed


def _area(url: str | os.PathLike) -> StagingArea:
    with _lock:
        return _areas.setdefault(in_flight.repository_key(url), StagingArea())


def _background() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-async-save")
        return _executor
