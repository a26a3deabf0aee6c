"""Phase timing of a save: wall-clock start stamps and durations, per rank."""

from __future__ import annotations

import contextlib
import socket
import time


class PhaseTimer:
    """Records named phases as {name, start_ns (wall clock), duration_s (monotonic)}."""

    def __init__(self, staged: tuple[int, float] | None = None):
        """``staged``: (start_ns, duration_s) of an asynchronous save's staging copy, made in the
        caller's thread before the background part this timer measures: its first phase, ``stage``
        (not counted in ``total_s``)."""
        self.phases: list[dict] = []
        self.start_ns = time.time_ns()
        self._start = time.perf_counter()
        if staged is not None:
            self.phases.append({"name": "stage", "start_ns": staged[0], "duration_s": staged[1]})

    @contextlib.contextmanager
    def phase(self, name: str):
        start_ns, start = time.time_ns(), time.perf_counter()
        try:
            yield
        finally:
            self.phases.append({"name": name, "start_ns": start_ns, "duration_s": time.perf_counter() - start})

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def record(self, rank: int, steps: dict | None = None, resumes: list[dict] | None = None) -> dict:
        """This rank's entry of the manifest's ``timing.ranks``, with its training steps and system
        samples if recorded (``steps``: a ``StepTimer.snapshot()``) and its resumes not yet stored."""
        record = {
            "rank": rank,
            "host": socket.gethostname(),
            "start_ns": self.start_ns,
            "phases": list(self.phases),
            "total_s": self.elapsed(),
        }
        return with_steps(record, steps, resumes)


def with_steps(entry: dict, steps: dict | None, resumes: list[dict] | None = None) -> dict:
    """A ``timing.ranks`` entry with a ``StepTimer.snapshot()``'s steps, and its system samples and save
    stalls apart (spec 9.4: ``steps``, ``system``, ``stalls`` 1.9), and the rank's resumes (``resumes``, 1.8)."""
    if resumes:
        entry = {**entry, "resumes": list(resumes)}
    if steps is None:
        return entry
    entry = {**entry, "steps": {k: v for k, v in steps.items() if k not in ("system", "stalls")}}
    for apart in ("system", "stalls"):
        if apart in steps:
            entry[apart] = steps[apart]
    return entry
