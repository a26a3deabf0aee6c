"""CheckpointManager: save every N steps (or as often as the run's own timing says), keep the right
checkpoints, copy them to slower durable tiers, restore the newest.

    manager = ckptfmt.CheckpointManager(
        tiers=["/nvme/run", ckptfmt.Tier("s3://bucket/run", ckptfmt.Retention(keep_every=1000))],
        keep_last=2, async_save=True, interval="auto")
    for step in range(start, steps):
        ...
        manager.save(step, state, metrics={"val_loss": loss})   # saves only when due
    manager.wait()

Only the save itself is on the training loop's path: replication to the next
tiers, retention and garbage collection run afterwards on one background
thread (on the group's rank 0 under torch.distributed), never deleting a
checkpoint before a newer one is committed or before the next tier has the
copy it wants. Replication pauses while a save writes the first tier, so that
copying to S3 does not slow the local save the loop may wait for next.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .advise import auto_interval
from .asynchronous import async_save as start_async_save
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning
from .gc import collect, remove
from .process_group import distributed_group
from .reader import load
from .replicate import replicate
from .repository import CommitRecord, Repository
from .retention import METRICS_KEY, Retention, metrics_reader
from .writer import save

#: Steps after a save at which ``interval="auto"`` plans the next one (from the steps timed meanwhile).
PLAN_AFTER_STEPS = 5
#: How many recent measurements the automatic interval takes the median of.
WINDOW = 32
#: Chunks copied to the next tier at a time: few, so that a save starting meanwhile soon has the machine
#: back (replication pauses for it, but what is already queued finishes).
REPLICATION_WORKERS = 2


@dataclass(frozen=True)
class Tier:
    """One storage tier: a repository URL, its own retention (None: the manager's rules) and options."""

    url: str
    retention: Retention | None = None
    storage_options: dict | None = field(default=None, hash=False)


class CheckpointManager:
    """Saves, retention, tiers and restore for one training run (see the module docstring).

    ``repo`` (or ``tiers``, fastest first): where checkpoints go; a tier given as
    a string uses the ``keep_*`` rules, a ``Tier`` its own. ``interval``: None
    saves at every ``save`` call, an int N at steps divisible by N, ``"auto"``
    as often as Daly's formula advises for the measured stall, step time and
    ``mtbf`` (``ckptfmt advise``). Other keyword arguments (``compression``,
    ``chunk_size``, ``parallelism``, ...) go to ``ckptfmt.save``.
    """

    def __init__(self, repo: str | os.PathLike | None = None, *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: tuple[str, str, int] | None = None,
                 keep_within: timedelta | None = None, tiers: list[str | os.PathLike | Tier] | None = None,
                 async_save: bool = False, interval: int | str | None = None,
                 mtbf: timedelta | float = timedelta(hours=8), name_format: str = "step-{step:09d}",
                 storage_options: dict | None = None, process_group: Any = None, gc_wait_s: float = 1.0,
                 **save_options: Any):
        if (repo is None) == (tiers is None):
            raise ValueError("give either repo or tiers (fastest first)")
        default = Retention(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, keep_within=keep_within)
        self.tiers = [_tier(t, default, storage_options) for t in ([repo] if tiers is None else tiers)]
        if not self.tiers:
            raise ValueError("tiers must name at least one repository")
        if interval not in (None, "auto") and (isinstance(interval, bool) or not isinstance(interval, int)
                                               or interval < 1):
            raise ValueError(f"interval must be None, a positive number of steps or 'auto', not {interval!r}")
        self.interval = interval
        self.mtbf_s = mtbf.total_seconds() if isinstance(mtbf, timedelta) else float(mtbf)
        if not self.mtbf_s > 0:
            raise ValueError("mtbf must be positive")
        self.async_save = async_save
        self.name_format = name_format
        self.gc_wait_s = gc_wait_s
        self.save_options = save_options
        self.group = distributed_group(process_group)
        self.is_coordinator = self.group is None or torch.distributed.get_rank(self.group) == 0
        self._housekeeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-manager")
        self._tasks: list[Future] = []
        self._save: Future | None = None
        self._metrics: dict[str, dict] = {}
        self._garbage = [False] * len(self.tiers)
        #: Per tier, manifest hash -> chunk keys: each collection reads only manifests it has not seen.
        self._known: list[dict[str, frozenset[str]]] = [{} for _ in self.tiers]
        self._lock = threading.Lock()
        #: Clear while a save writes the first tier: replication to the next ones waits meanwhile.
        self._not_saving = threading.Event()
        self._not_saving.set()
        self._last_saved: int | None = None
        self._next_save: int | None = None
        self._plan_at: int | None = None
        self._last_call: tuple[int, float] | None = None
        self._step_s: deque[float] = deque(maxlen=WINDOW)
        self._stall_s: deque[float] = deque(maxlen=WINDOW)
        self._background_s: deque[float] = deque(maxlen=WINDOW)
        #: With ``interval="auto"``: the steps between saves it last planned (None before the first plan).
        self.planned_interval: int | None = None

    # -- saving ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now (every rank gets the same answer)."""
        if isinstance(self.interval, int):
            return step % self.interval == 0
        if self.interval is None or self._last_saved is None:
            return True
        if self._plan_at is not None and step >= self._plan_at:
            self._plan_next(step)
        return self._next_save is not None and step >= self._next_save

    def save(self, step: int, state: Any, metrics: dict | None = None, timer: Any = None, *,
             force: bool = False, metadata: dict | None = None) -> bool:
        """Save ``state`` as checkpoint ``step`` if due (``force``: regardless); True if it saved.

        Collective under torch.distributed (every rank calls it). ``metrics``
        (plain numbers, e.g. ``{"val_loss": 0.31}``) are stored in the
        checkpoint's metadata for ``keep_best``; ``timer`` is a StepTimer.
        """
        self._time_step(step)
        if not (force or self.should_save(step)):
            return False
        name = self.name_format.format(step=step)
        url = f"{self.tiers[0].url}/{name}"
        user = dict(metadata or {})
        if metrics is not None:
            user[METRICS_KEY] = dict(metrics)
            self._metrics[name] = dict(metrics)
        options = dict(step=step, metadata=user or None, timer=timer, storage_options=self.tiers[0].storage_options,
                       process_group=self.group, **self.save_options)
        started = time.perf_counter()
        self._not_saving.clear()
        try:
            if self.async_save:
                self._save = start_async_save(state, url, **options)
                returned = time.perf_counter()
                self._save.add_done_callback(lambda future: self._committed(future, name, returned))
            else:
                save(state, url, **options)
                self._committed(None, name, None)
        except BaseException:
            self._not_saving.set()
            raise
        self._stall_s.append(time.perf_counter() - started)
        self._last_saved, self._next_save = step, None
        self._plan_at = step + PLAN_AFTER_STEPS
        self._last_call = (step, time.perf_counter())
        return True

    def wait(self) -> None:
        """Wait for the last save (raising its error) and for the background work after it."""
        if self._save is not None:
            self._save.result()
        while True:
            with self._lock:
                tasks, self._tasks = self._tasks, []
            if not tasks:
                return
            for task in tasks:
                task.result()

    def close(self) -> None:
        self.wait()
        self._housekeeper.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps of every committed checkpoint, on any tier, ascending."""
        return sorted({r.step for tier in self.tiers for r in self._records(tier) if r.step is not None})

    def latest(self) -> int | None:
        """The newest step committed on any tier, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, into: Any = None, **load_options: Any) -> Any:
        """Load checkpoint ``step`` (default: the newest) from the fastest tier that has it complete.

        A copy that is missing or damaged on one tier is read from the next.
        ``into`` fills a state in place (see ``ckptfmt.load``).
        """
        self.wait()
        step = self.latest() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(f"{self.tiers[0].url}: no checkpoint on any tier")
        failures = []
        for tier in self.tiers:
            record = next((r for r in self._records(tier) if r.step == step), None)
            if record is None:
                continue
            try:
                return load(f"{tier.url}/{record.name}", into=into, storage_options=tier.storage_options,
                            **load_options)
            except CheckpointError as exc:
                failures.append(str(exc))
                warnings.warn(f"restoring step {step} from the next tier: {exc}", CheckpointWarning, stacklevel=2)
        raise CheckpointNotFoundError(f"step {step}: no tier has a readable copy"
                                      + (f" ({'; '.join(failures)})" if failures else ""))

    def _records(self, tier: Tier) -> list[CommitRecord]:
        try:
            return Repository.open(tier.url, tier.storage_options).commits()
        except CheckpointNotFoundError:  # nothing saved there yet
            return []

    # -- after a commit, in the background -----------------------------------------------------
    def _committed(self, future: Future | None, name: str, returned: float | None) -> None:
        self._not_saving.set()
        if future is not None:
            if future.exception() is not None:
                return  # the next save, or wait(), raises it
            self._background_s.append(time.perf_counter() - returned)
        if self.is_coordinator:
            with self._lock:
                self._tasks.append(self._housekeeper.submit(self._housekeep))

    def _housekeep(self) -> None:
        """Copy to the next tiers what they keep, then apply each tier's retention and collect."""
        for source, target in zip(self.tiers, self.tiers[1:]):
            self._guard(f"replicating to {target.url}", lambda: replicate(
                source.url, target.url, self._wanted(source, target), storage_options=source.storage_options,
                dst_storage_options=target.storage_options, workers=REPLICATION_WORKERS,
                yield_to=self._not_saving.wait))
        for index, tier in enumerate(self.tiers):
            following = self.tiers[index + 1] if index + 1 < len(self.tiers) else None
            self._guard(f"retention on {tier.url}", lambda: self._retain(index, tier, following))

    def _guard(self, what: str, work) -> None:
        """Background failures warn and leave the work for the next save; training goes on."""
        try:
            work()
        except CheckpointError as exc:
            warnings.warn(f"checkpoint manager: {what} failed, will retry after the next save: {exc}",
                          CheckpointWarning, stacklevel=2)

    def _wanted(self, source: Tier, target: Tier) -> list[str]:
        """Checkpoints of ``source`` that ``target`` lacks and its retention would keep."""
        held = self._records(target)
        present = {r.name for r in held}
        candidates = [r for r in self._records(source) if r.name not in present]
        kept = target.retention.kept(held + candidates, self._metrics_of(source))
        return [r.name for r in candidates if r.name in kept]

    def _retain(self, index: int, tier: Tier, following: Tier | None) -> None:
        repo = Repository.open(tier.url, tier.storage_options)
        records = repo.commits()
        doomed = {r.name for r in tier.retention.to_delete(records, self._metrics_of(tier))}
        if following is not None:  # never before the next tier has the copy it wants
            doomed -= set(self._wanted(tier, following))
        if doomed:
            remove(repo, sorted(doomed))
            self._garbage[index] = True
        if self._garbage[index]:
            self._garbage[index] = not collect(repo, wait_s=self.gc_wait_s, known=self._known[index]).swept

    def _metrics_of(self, tier: Tier):
        stored = metrics_reader(Repository.open(tier.url, tier.storage_options))
        return lambda record: self._metrics.get(record.name) or stored(record)

    # -- interval="auto" -----------------------------------------------------------------------
    def _time_step(self, step: int) -> None:
        """One training step's time: since the previous call, which ended after any save."""
        now = time.perf_counter()
        if self._last_call is not None and step > self._last_call[0]:
            self._step_s.append((now - self._last_call[1]) / (step - self._last_call[0]))
        self._last_call = (step, now)

    def _plan_next(self, step: int) -> None:
        """The next save's step, from the medians measured so far; rank 0 decides for the group
        (every rank calls this at the same step). Without measurements yet, plan again later."""
        next_save = None
        if self._step_s and self._stall_s:
            background = statistics.median(self._background_s) if self._background_s else 0.0
            self.planned_interval = auto_interval(statistics.median(self._stall_s), statistics.median(self._step_s),
                                                  self.mtbf_s, background)
            next_save = self._last_saved + self.planned_interval
        if self.group is not None:
            shared = [next_save]
            torch.distributed.broadcast_object_list(shared, src=torch.distributed.get_global_rank(self.group, 0),
                                                    group=self.group)
            next_save = shared[0]
        self._next_save = next_save
        self._plan_at = None if next_save is not None else step + PLAN_AFTER_STEPS


def _tier(tier: str | os.PathLike | Tier, default: Retention, storage_options: dict | None) -> Tier:
    if isinstance(tier, Tier):
        return tier if tier.retention is not None else Tier(tier.url, default, tier.storage_options)
    return Tier(os.fspath(tier).rstrip("/"), default, storage_options)
