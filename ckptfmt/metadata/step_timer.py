"""Per-rank step timing and data order, recorded by the training loop and stored by the next save.

    timer = ckptfmt.StepTimer()
    for step, (indices, x, y) in enumerate(loader):
        with timer.step(step):
            timer.batch(indices)                  # a digest of the samples this rank consumed
            with timer.phase("forward"): ...
        timer.metrics(loss=loss.item())
        if step % 10 == 0:
            ckptfmt.save(state, f"runs/a/step-{step:06d}", step=step, timer=timer)

``save(..., timer=)`` stores the steps recorded and not yet in a checkpoint, so
each checkpoint holds the steps between it and its parent, every rank's
(gathered with the save's own collectives: the timer has none). They leave the
timer only once the checkpoint is committed: after a failed save the next one
stores them. Records are columns, one
list per field, a row per step; a save stores each column as one msgpack bin of
little-endian numbers (spec 9.4), which readers take with one copy (numpy,
Arrow) instead of decoding a msgpack value per step (that stored form: ``step_records``). The
timer costs two clock reads and a dict update per phase.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from typing import Any

import blake3
import numpy as np

from ckptfmt.metadata.resumes import take_resumed_progress
from ckptfmt.metadata.rng_digests import RngDigests
from ckptfmt.metadata.step_records import BATCH_DIGEST_BYTES as BATCH_DIGEST_BYTES  # re-exported
from ckptfmt.metadata.step_records import BATCH_INDICES, BATCH_NONE, BATCH_TENSORS, encode_steps
from ckptfmt.metadata.step_records import StepColumns as StepColumns  # re-exported
from ckptfmt.metadata.step_records import decode_steps as decode_steps  # re-exported
from ckptfmt.metadata.system import DEFAULT_INTERVAL_S as DEFAULT_SYSTEM_INTERVAL_S
from ckptfmt.metadata.system import SystemSampler
from ckptfmt.repository.progress import DEFAULT_INTERVAL_S

#: Seconds between rewrites of a process's progress object (spec 4.6) by default.
DEFAULT_PROGRESS_INTERVAL_S = DEFAULT_INTERVAL_S


class StepTimer:
    """Records, per training step on this rank: start, duration, time in each named phase, a digest
    of the batch's sample indices and scalar metrics. One timer per training loop, used from its thread.

    From its first step it also samples the rank's resource use (metadata/system.py: CPU, memory,
    disk and network bytes, load, the data wait, the GPU's memory, clocks and temperature):
    ``system_interval`` seconds apart on a background thread (1 s by default), ``"step"`` at the
    end of every step, or None for none. The samples are stored with the steps.
    """

    def __init__(self, *, system_interval: float | str | None = DEFAULT_SYSTEM_INTERVAL_S, rng: bool = True,
                 generators: dict[str, Any] | None = None,
                 progress_interval: float | None = DEFAULT_PROGRESS_INTERVAL_S):
        self._columns = _empty_columns()
        #: Seconds between rewrites of this process's progress object once a save bound the timer to its
        #: repository (spec 4.6: the steps not yet saved, which a killed process takes with it); None: never.
        self.progress_interval = progress_interval
        #: The progress writer a save bound (``repository.progress.bind``), or None.
        self.progress: Any = None
        #: (start_ns, duration_s) of each time a save held the loop, not yet stored (spec 9.4 ``stalls``).
        self._stalls: list[tuple[int, float]] = []
        #: Every generator's state at each step's start, digested (``rng=False``: none).
        self._rng = RngDigests(generators) if rng else None
        self._current: _Step | None = None
        # Steps finish on the training thread while an asynchronous save's thread forgets what it stored.
        self._lock = threading.Lock()
        #: Nanoseconds spent in ``data`` phases so far (the samples' data wait).
        self._data_ns = 0
        self._sampler: SystemSampler | None
        if isinstance(system_interval, str) and system_interval != "step":
            raise ValueError(f"system_interval must be seconds, 'step' or None, not {system_interval!r}")
        # The sampler reads the data wait through a weak reference: its thread must not keep the timer alive.
        owner = weakref.ref(self)

        def data_wait() -> float:
            timer = owner()
            return math.nan if timer is None else timer._data_ns / 1e9
        self._sampler = None
        if system_interval is not None:
            self._sampler = SystemSampler(None if isinstance(system_interval, str) else system_interval, data_wait)
        self._sampling = False

    def track_generator(self, name: str, generator: Any) -> None:
        """Digest ``generator`` (a ``torch.Generator``, ``random.Random`` or numpy ``Generator``) at the
        start of every step from the next one on, as ``name``: a data loader's or a sampler's."""
        if self._rng is None:
            raise ValueError("this StepTimer was made with rng=False: it digests no generator")
        self._rng.track(name, generator)

    def close(self) -> None:
        """Stop sampling (a background sampler also stops when the timer is garbage collected)."""
        if self._sampler is not None:
            self._sampler.stop()

    def step(self, step: int) -> _Step:
        """A context manager around one training step: ``with timer.step(step): ...``."""
        if self._current is not None:
            raise ValueError(f"StepTimer.step({step}) inside step {self._current.step}: steps do not nest")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"StepTimer.step() takes the step number, an int; got {type(step).__name__}")
        return _Step(self, int(step))

    def phase(self, name: str) -> _Phase:
        """A context manager timing one phase of the current step; time in phases of one name adds up."""
        if self._current is None:
            raise ValueError(f"StepTimer.phase({name!r}) outside a step: use it inside `with timer.step(n):`")
        return _Phase(self._current.phases, name)

    # -- for frameworks' hooks, which see a step's boundaries as separate calls --------------------
    def start_step(self, step: int, *, since_ns: int | None = None, phase: str | None = None) -> None:
        """Start step ``step``: what ``with timer.step(n)`` does on entering, for a hook to call.

        ``since_ns``: a ``time.perf_counter_ns()`` reading taken when the step really began (a
        framework's hook may run after the batch was fetched); ``phase``: the phase that began then.
        """
        if self._current is not None:
            raise ValueError(f"StepTimer.start_step({step}) inside step {self._current.step}: end it first")
        current = self.step(step).__enter__()
        if since_ns is not None:
            current.start_ns -= max(0, current.start - since_ns)
            current.start = min(current.start, since_ns)
        if phase is not None:
            current.running = (phase, current.start)

    def mark(self, phase: str | None) -> None:
        """End the phase in progress (from ``start_step`` or an earlier ``mark``) and start ``phase``
        (None: none), both now; phases of one name add up, as with ``timer.phase``."""
        current = self._current
        if current is None:
            raise ValueError(f"StepTimer.mark({phase!r}) outside a step: call start_step first")
        current.switch(phase, time.perf_counter_ns())

    def end_step(self) -> None:
        """End the current step (and its phase in progress): ``with timer.step(n)``'s exit, for a hook."""
        current = self._current
        if current is None:
            raise ValueError("StepTimer.end_step() with no step started")
        end = time.perf_counter_ns()
        current.switch(None, end)
        self._finish(current, end)

    @property
    def in_step(self) -> bool:
        """Whether a step is in progress."""
        return self._current is not None

    @property
    def pending(self) -> int:
        """Finished steps not yet stored by a committed save."""
        with self._lock:
            return len(self._columns["step"])

    def batch(self, indices: Any) -> None:
        """Record which samples this rank consumed in the current step (integer indices: a tensor, an
        array or a sequence). Several calls in one step are digested together, in order."""
        if self._current is None:
            raise ValueError("StepTimer.batch() outside a step: use it inside `with timer.step(n):`")
        values = _indices(indices)
        hasher = self._current.hasher
        if hasher is None:
            hasher = self._current.hasher = blake3.blake3()
        elif self._current.batch_kind != BATCH_INDICES:
            raise ValueError("StepTimer.batch() in a step that recorded its batch's tensors: use one or the other")
        hasher.update(values.tobytes())
        self._current.batch_size += values.size

    def batch_tensors(self, batch: Any) -> None:
        """Record the current step's batch by its contents, where the loop cannot see the sample
        indices (``batch``: a tensor or array, or lists, tuples and dicts of them): a digest of each
        one's dtype, shape and bytes in order. Tensors on a GPU are copied to the host for it."""
        if self._current is None:
            raise ValueError("StepTimer.batch_tensors() outside a step: use it inside `with timer.step(n):`")
        current = self._current
        if current.hasher is None:
            current.hasher = blake3.blake3()
        elif current.batch_kind != BATCH_TENSORS:
            raise ValueError("StepTimer.batch_tensors() in a step that recorded sample indices: use one or the other")
        current.batch_kind = BATCH_TENSORS
        samples = _digest_tensors(batch, current.hasher)
        if current.batch_size == 0:
            current.batch_size = samples

    def metrics(self, **values: Any) -> None:
        """Scalars of the current step, or of the last finished one (``timer.metrics(loss=l)``): numbers,
        or one-element tensors (a GPU tensor is read when the steps are stored, not in the step). A
        float32 or bfloat16 loss is kept exactly (float64 holds it), as the step's signature needs."""
        numbers: dict[str, Any] = {}
        torch = sys.modules.get("torch")
        for name, value in values.items():
            if torch is not None and isinstance(value, torch.Tensor):
                value = value.detach()  # a loss straight from the graph: its value alone
                if value.device.type != "cpu" and value.numel() == 1:
                    numbers[name] = value  # read when the steps are stored: no device sync in the step
                    continue
            try:
                numbers[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"StepTimer.metrics({name}=...): a number is needed, "
                                 f"got {type(value).__name__}") from None
        if self._current is not None:
            self._current.metrics.update(numbers)
            return
        with self._lock:
            rows = len(self._columns["step"])
            if rows == 0:
                raise ValueError("StepTimer.metrics() with no step to attach them to (none yet, or all stored)")
            columns = self._columns["metrics"]
            for name, number in numbers.items():
                if name not in columns:
                    columns[name] = [None] * rows
                columns[name][-1] = number
        if self.progress is not None:  # the finished step's outputs, on record with it
            self.progress.maybe_write(self)

    def held(self, start_ns: int, duration_s: float) -> None:
        """A save held the loop from ``start_ns`` for ``duration_s`` (from its call to its return: what
        its own record cannot hold, as its commit comes after it); the next save stores it."""
        with self._lock:
            self._stalls.append((int(start_ns), float(duration_s)))
        if self.progress is not None:
            self.progress.maybe_write(self)

    def snapshot(self) -> dict:
        """The finished steps not yet stored, as the manifest records them (spec 9.4), with the system
        samples and the saves' stalls not yet stored under ``system`` and ``stalls`` (``timing.with_steps``
        puts them apart); the timer keeps them."""
        with self._lock:
            record = encode_steps(self._columns)
            stalls = self._stalls_record()
        if stalls is not None:
            record["stalls"] = stalls
        samples = self._sampler.snapshot() if self._sampler is not None else None
        if samples is not None:
            record["system"] = samples
        return record

    def progress_record(self) -> tuple[dict | None, dict | None]:
        """The finished steps and the saves' stalls not yet stored (spec 9.4's ``steps`` and ``stalls``;
        None where there are none), for a progress object (spec 4.6)."""
        with self._lock:
            return encode_steps(self._columns) if self._columns["step"] else None, self._stalls_record()

    def _stalls_record(self) -> dict | None:
        """The stalls not yet stored, as spec 9.4 records them (the caller holds the lock)."""
        if not self._stalls:
            return None
        return {"count": len(self._stalls), "start_ns": [start for start, _ in self._stalls],
                "duration_s": [duration for _, duration in self._stalls]}

    def forget_stored(self, snapshot: dict) -> None:
        """Drop what ``snapshot`` held, steps and system samples: a committed checkpoint holds them."""
        self.forget(snapshot["count"])
        if "stalls" in snapshot:
            with self._lock:
                del self._stalls[:snapshot["stalls"]["count"]]
        if self._sampler is not None and "system" in snapshot:
            self._sampler.forget(snapshot["system"]["count"])

    def forget(self, rows: int) -> None:
        """Drop the first ``rows`` steps: a committed checkpoint holds them."""
        with self._lock:
            for column in self._columns.values():
                if type(column) is dict:
                    for key in list(column):
                        del column[key][:rows]
                        if all(value is None for value in column[key]):
                            del column[key]
                else:
                    del column[:rows]

    def _bind_to_a_resume(self) -> None:
        """A process that has resumed keeps its progress object from its first step on (spec 4.6, 1.15), in
        the repository it resumed from, not from its first save."""
        writer = take_resumed_progress()
        if writer is not None and self.progress_interval is not None:
            writer.interval_s = self.progress_interval
            self.progress = writer

    def __len__(self) -> int:
        """Finished steps not yet stored in a checkpoint."""
        return len(self._columns["step"])

    def _finish(self, step: _Step, end: int) -> None:
        self._data_ns += step.phases.get("data", 0)
        with self._lock:
            self._append(step, end)
        self._current = None
        if self.progress is None and self.progress_interval is not None:
            self._bind_to_a_resume()
        if self.progress is not None:
            self.progress.maybe_write(self)
        if self._sampler is not None:
            if self._sampler.interval is None:
                self._sampler.sample()
            elif not self._sampling:
                self._sampling = True
                self._sampler.start()

    def _append(self, step: _Step, end: int) -> None:
        columns, rows = self._columns, len(self._columns["step"])
        columns["step"].append(step.step)
        columns["start_ns"].append(step.start_ns)
        columns["duration_s"].append((end - step.start) / 1e9)
        _append_row(columns["phases"], {name: ns / 1e9 for name, ns in step.phases.items()}, rows)
        columns["batch"].append(None if step.hasher is None else step.hasher.digest(BATCH_DIGEST_BYTES))
        columns["batch_size"].append(step.batch_size if step.hasher is not None else None)
        columns["batch_kind"].append(BATCH_NONE if step.hasher is None else step.batch_kind)
        _append_row(columns["metrics"], step.metrics, rows)
        _append_row(columns["rng"], step.rng, rows)


class _Step:
    __slots__ = ("timer", "step", "start_ns", "start", "phases", "running", "hasher", "batch_size", "batch_kind",
                 "metrics", "rng")

    def __init__(self, timer: StepTimer, step: int):
        self.timer, self.step = timer, step
        self.phases: dict[str, int] = {}
        #: The phase a hook started (``StepTimer.mark``) and when, by ``perf_counter_ns``.
        self.running: tuple[str, int] | None = None
        self.hasher: blake3.blake3 | None = None
        self.batch_size = 0
        self.batch_kind = BATCH_INDICES
        self.metrics: dict[str, float] = {}
        self.rng: dict[str, bytes] = {}

    def __enter__(self) -> _Step:
        self.timer._current = self
        digests = self.timer._rng
        if digests is not None:  # before the clock starts: the step's time is the loop's
            self.rng = digests.digests()
        self.start_ns, self.start = time.time_ns(), time.perf_counter_ns()
        return self

    def __exit__(self, *exc_info) -> None:
        end = time.perf_counter_ns()
        self.switch(None, end)
        self.timer._finish(self, end)

    def switch(self, phase: str | None, now: int) -> None:
        """End the hook-started phase at ``now`` and start ``phase`` there."""
        if self.running is not None:
            name, began = self.running
            self.phases[name] = self.phases.get(name, 0) + now - began
        self.running = None if phase is None else (phase, now)


class _Phase:
    __slots__ = ("phases", "name", "start")

    def __init__(self, phases: dict[str, int], name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc_info) -> None:
        elapsed = time.perf_counter_ns() - self.start
        self.phases[self.name] = self.phases.get(self.name, 0) + elapsed


def _empty_columns() -> dict:
    return {"step": [], "start_ns": [], "duration_s": [], "phases": {}, "batch": [], "batch_size": [],
            "batch_kind": [], "metrics": {}, "rng": {}}


def _append_row(columns: dict[str, list], row: dict, rows: int) -> None:
    """Append one row to named columns: a name met for the first time gets nil for earlier rows."""
    for name, column in columns.items():
        column.append(row.get(name))
    for name in [n for n in row if n not in columns]:
        columns[name] = [None] * rows + [row[name]]


def _digest_tensors(batch: Any, hasher: blake3.blake3) -> int:
    """Feed each tensor or array of ``batch`` (nested in lists, tuples and dicts, in order) to ``hasher``
    as its dtype, shape and bytes; the samples in the batch (the first one's first dimension)."""
    samples = 0
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item[key] for key in reversed(list(item)))
            continue
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
            continue
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(item, torch.Tensor):
            dtype, shape = str(item.dtype).removeprefix("torch."), tuple(item.shape)
            data = item.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        elif isinstance(item, np.ndarray):
            dtype, shape, data = item.dtype.str, item.shape, np.ascontiguousarray(item).view(np.uint8).reshape(-1)
        else:
            continue  # strings, numbers: a batch's metadata, not its samples
        hasher.update(f"{dtype}{shape}".encode())
        hasher.update(data)
        if not samples and shape:
            samples = shape[0]
    return samples


def _indices(indices: Any) -> np.ndarray:
    """Sample indices as a flat little-endian int64 array, or a clear error."""
    torch = sys.modules.get("torch")  # a tensor of indices means torch is loaded: the timer never loads it
    if torch is not None and isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex():
            raise ValueError(f"StepTimer.batch() takes integer indices, got a {indices.dtype} tensor")
        indices = indices.detach().cpu().numpy()
    try:
        array = np.asarray(indices)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"StepTimer.batch() takes integer indices: {exc}") from None
    if not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(f"StepTimer.batch() takes integer indices, got {array.dtype}")
    return np.ascontiguousarray(array.reshape(-1), dtype="<i8")
