"""CheckpointManager: save every N steps (or as often as the run's own timing says), keep the right
checkpoints, copy them to slower durable tiers, restore the newest.

    manager = ckptfmt.CheckpointManager(
        tiers=["/nvme/run", ckptfmt.Tier("s3://bucket/run", ckptfmt.Retention(keep_every=1000))],
        keep_last=2, async_save=True, interval="auto")
    restored = manager.restore(rng=True)     # the newest checkpoint, or None on a fresh start
    for step in range(manager.start_step, steps):
        ...
        manager.save(step, state, metrics={"val_loss": loss})   # saves only when due
    manager.wait()

Only the save itself is on the training loop's path: replication to the next
tiers, retention and garbage collection (``housekeeping``) run after each commit
on rank 0 of the group, never deleting a checkpoint before a newer one is
committed or before the next tier has the copy it wants. Copying pauses while a
save writes the first tier; on Linux it runs in a child process at the lowest
CPU priority, stopped meanwhile (``housekeeping_process``; why:
docs/design/replication-child.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CorruptDataError,
    ManifestError,
    StorageError,
)
from ckptfmt.format.features import refuse_unless_writable
from ckptfmt.format.signatures import SignatureError
from ckptfmt.groups.nodes import NodeLayout
from ckptfmt.groups.process_group import RankGroup, distributed_group
from ckptfmt.lifecycle.advise import auto_interval
from ckptfmt.lifecycle.housekeeping import Housekeeper, Tier, tier_records
from ckptfmt.lifecycle.housekeeping_process import SUPPORTED as PROCESS_SUPPORTED
from ckptfmt.lifecycle.housekeeping_process import HousekeepingProcess
from ckptfmt.lifecycle.peer_copies import copy_to_peers
from ckptfmt.lifecycle.peer_drains import drain
from ckptfmt.lifecycle.peer_parity import protect_across_nodes
from ckptfmt.lifecycle.peer_refills import restore_point
from ckptfmt.lifecycle.peers import NodePeers
from ckptfmt.lifecycle.retention import METRICS_KEY, Retention
from ckptfmt.loading.reader import load, restore_rng
from ckptfmt.loading.resume_check import record_resume
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.asynchronous import AsyncSaver
from ckptfmt.saving.options import DEFAULT_TIMEOUT_S, SaveOptions
from ckptfmt.saving.save import save_with
from ckptfmt.storage.factory import in_process_memory

#: Steps after a save at which ``interval="auto"`` plans the next one (from the steps timed meanwhile).
PLAN_AFTER_STEPS = 5
#: Save options the manager sets for each save itself.
_MANAGED_OPTIONS = frozenset({"step", "metadata", "storage_options", "process_group"})
#: How many recent measurements the automatic interval takes the median of.
WINDOW = 32
#: What makes ``restore`` read a tier's copy from the next tier: the copy is missing, damaged or not the
#: signer's. Anything else (a state that does not match the checkpoint) is the same on every tier: raised.
DAMAGE_OR_ABSENCE = (CheckpointNotFoundError, CorruptDataError, ManifestError, StorageError, SignatureError)


class CheckpointManager:
    """Saves, retention, tiers and restore for one training run (see the module docstring).

    ``repo`` (or ``tiers``, fastest first): where checkpoints go; a tier given as
    a string uses the ``keep_*`` rules, a ``Tier`` its own. ``interval``: None
    saves at every ``save`` call, an int N at steps divisible by N, ``"auto"``
    as often as Daly's formula advises for the measured stall, step time and
    ``mtbf`` (``ckptfmt advise``). ``housekeeping``: where copies to the
    next tiers run: ``"process"`` (a child process, Linux), ``"thread"`` (the
    manager's thread, with retention and collection), ``"auto"`` (the process
    where available, unless a tier is in this process's memory). ``parity="8+2"``:
    Reed-Solomon parity on every tier that gives none of its own
    (``Tier(..., parity=...)``; spec 5.6): the first tier's saves write it, the
    next tiers' copies carry it or get their tier's. Other keyword arguments
    (``compression``, ``chunk_size``, ``parallelism``, ...) go to ``ckptfmt.save``.
    """

    def __init__(self, repo: str | os.PathLike | None = None, *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: tuple[str, str, int] | None = None,
                 keep_within: timedelta | None = None, tiers: list[str | os.PathLike | Tier] | None = None,
                 async_save: bool = False, interval: int | str | None = None,
                 mtbf: timedelta | float = timedelta(hours=8), name_format: str = "step-{step:09d}",
                 storage_options: dict | None = None, process_group: Any = None, gc_wait_s: float = 1.0,
                 housekeeping: str = "auto", **save_options: Any):
        if (repo is None) == (tiers is None):
            raise ValueError("give either repo or tiers (fastest first)")
        default = Retention(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, keep_within=keep_within)
        given = [repo] if repo is not None else tiers or []
        self.tiers = _tiers(given, default, storage_options, save_options.get("parity"))
        self.interval, self.mtbf_s = _schedule(interval, mtbf, housekeeping)
        self.async_save = async_save
        self.name_format = name_format
        #: The options of every save, checked now rather than at the first save: with the first tier's
        #: scope, which each save sets (a node-scoped tier needs format 1.10, ``format_version=``).
        self.save_options = _save_options(save_options, self.tiers[0])
        #: The asynchronous saver, with its staging buffers (freed by ``close``).
        self.saver = AsyncSaver() if async_save else None
        self.group = distributed_group(process_group)
        self.is_coordinator = self.group is None or torch.distributed.get_rank(self.group) == 0
        #: With a node-scoped first tier across ranks: the job's nodes, found once, and this rank's place
        #: among their leaders, who copy each node's chunks to the others, drain and refill.
        self.peers = _peers(self.tiers[0], self.group, self.save_options.format_version)
        #: Replication, retention and collection; the group's rank 0 has one, and with a node-scoped first
        #: tier each other node's lowest rank, for its own node's tier (retention and collection only).
        self.housekeeper = _own_housekeeper(self.tiers, self.peers, self.is_coordinator, gc_wait_s, housekeeping)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-manager")
        #: The peer copies' thread (a node's leader): apart, as every leader must copy each checkpoint in turn.
        self._copying = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-peer-copies")
        #: Set except while the loop saves to the first tier: the peer copies wait for it between messages.
        self._not_saving = threading.Event()
        self._not_saving.set()
        self._tasks: list[Future] = []
        self._save: Future | None = None
        #: Metrics of the saves since the last housekeeping run, which hands them over.
        self._new_metrics: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._last_saved: int | None = None
        self._next_save: int | None = None
        self._plan_at: int | None = None
        self._last_call: tuple[int, float] | None = None
        self._step_s: deque[float] = deque(maxlen=WINDOW)
        self._stall_s: deque[float] = deque(maxlen=WINDOW)
        self._background_s: deque[float] = deque(maxlen=WINDOW)
        #: With ``interval="auto"``: the steps between saves it last planned (None before the first plan).
        self.planned_interval: int | None = None
        #: The step the last ``restore()`` loaded (None: it found none, or was not called).
        self.restored_step: int | None = None
        #: The URL of the copy the last ``restore()`` loaded (the tier it came from; None as ``restored_step``):
        #: what ``ckptfmt.record_resume`` and ``ckptfmt.restore_rng`` take.
        self.restored_url: str | None = None
        #: What the last ``restore()`` fetched from other nodes' copies first, in words (a node whose disk
        #: was lost gets its chunks back from a peer).
        self.fetched_from_peers: list[str] = []

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
            if self.housekeeper is not None:
                with self._lock:
                    self._new_metrics[name] = dict(metrics)
        options = self.save_options.replace(step=step, metadata=user or None, scope=self.tiers[0].scope,
                                            storage_options=self.tiers[0].storage_options, process_group=self.group)
        started = time.perf_counter()
        self._not_saving.clear()  # peer copies and draining wait while the loop saves
        if self.housekeeper is not None:  # copying to the next tiers waits while the loop saves
            self.housekeeper.pause()
        try:
            if self.saver is not None:
                self._save = self.saver.save(state, url, options, timer=timer)
                returned = time.perf_counter()
                self._save.add_done_callback(lambda future: self._saved(future, returned))
            else:
                save_with(state, url, options, timer=timer)
                self._saved(None, None)
        except BaseException:
            self._resume_housekeeping()
            raise
        if self.housekeeper is not None:  # queued now, so that a wait() from here on waits for it too
            self._queue(self._background.submit(self._housekeep, self._save if self.async_save else None))
        if self.peers is not None and self.peers.group is not None:
            self._queue(self._copying.submit(self._copy_to_peers, name, self._save if self.async_save else None))
        self._stall_s.append(time.perf_counter() - started)
        self._last_saved, self._next_save = step, None
        self._plan_at = step + PLAN_AFTER_STEPS
        self._last_call = (step, time.perf_counter())
        return True

    def _queue(self, task: Future) -> None:
        """Background work a ``wait()`` from now on waits for (those done well need no waiting: a long run
        without ``wait()`` keeps few)."""
        with self._lock:
            self._tasks = [t for t in self._tasks if not t.done() or t.exception() is not None]
            self._tasks.append(task)

    @property
    def pending_save(self) -> Future | None:
        """The last asynchronous save's future while it runs (None once done, or with synchronous saves)."""
        return self._save if self._save is not None and not self._save.done() else None

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
        """Wait for the last save and the work after it, then free the staging buffers and threads."""
        try:
            self.wait()
        finally:
            if self.saver is not None:
                self.saver.close()
            if self.housekeeper is not None:
                self.housekeeper.close()
            self._background.shutdown(wait=True)
            self._copying.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps of every committed checkpoint, on any tier, ascending."""
        return sorted({r.step for tier in self.tiers for r in tier_records(tier) if r.step is not None})

    def latest(self) -> int | None:
        """The newest step committed on any tier, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def start_step(self) -> int:
        """The step a resumed training loop starts from: the one after the step ``restore()`` loaded,
        or 0 when it found nothing to restore (a fresh start) or was not called.

            restored = manager.restore(rng=True)      # None on a fresh start
            for step in range(manager.start_step, steps): ...
        """
        return 0 if self.restored_step is None else self.restored_step + 1

    def restore(self, step: int | None = None, into: Any = None, *, rng: bool = False, **load_options: Any) -> Any:
        """Load checkpoint ``step`` (default: the newest) from the fastest tier that has it complete.

        ``into``: the objects to resume, filled in place (see ``ckptfmt.load``), as
        ``{"model": model, "optim": optimizer, "sched": scheduler}``: each object with
        ``state_dict()``/``load_state_dict()`` gets its state back, a fresh optimizer its
        moments. Without it, returns the saved state; None when no tier holds any
        checkpoint yet and no ``step`` was asked for: a fresh start. A state that does
        not match the checkpoint raises ``StateMismatchError`` naming the entries (with
        ``strict=False``, a warning, and what was not restored is on the resume's record).
        A copy that is missing or damaged on one tier is read from the next; a chunk
        missing or damaged on the tier read from is read from another tier that has it,
        the rest still from the fast one, and the damaged copy is repaired before
        ``restore`` returns, with a warning (``ckptfmt.load(heal_from=...)``).
        ``rng=True`` also restores this rank's RNG states from that copy
        (``ckptfmt.restore_rng``). ``start_step`` then says where the loop resumes.
        The resume goes on record in the next checkpoint (``ckptfmt.record_resume``:
        where from and, with ``into``, whether each part holds what the checkpoint
        stored); a loop that loads the returned state into its objects itself may call
        ``record_resume`` with them: that record replaces this one.
        """
        self.wait()
        self.restored_step = self.restored_url = None
        self.fetched_from_peers = []
        if step is None and self.peers is not None:
            step, self.fetched_from_peers, rebuilt = restore_point(self.peers)
            for fetched in self.fetched_from_peers:
                warnings.warn(f"restore: {fetched}", CheckpointWarning, stacklevel=2)
            if rebuilt is not None and self.peers.group is not None:  # the rebuilt nodes' parity, again
                self._queue(self._copying.submit(self._protect_again, rebuilt))
        if step is None:
            step = self.latest() if self.tiers[0].scope == "job" or self.group is None else self._latest_everywhere()
            if step is None:
                return None
        copies = [(tier, record) for tier in self.tiers
                  for record in [next((r for r in tier_records(tier) if r.step == step), None)] if record is not None]
        failures = []
        for index, (tier, record) in enumerate(copies):
            url = f"{tier.url}/{record.name}"
            try:
                state = load(url, into=into, storage_options=tier.storage_options,
                             heal_from=_other_repositories(self.tiers, tier), **load_options)
            except DAMAGE_OR_ABSENCE as exc:
                failures.append(str(exc))
                if index + 1 < len(copies):
                    warnings.warn(f"restoring step {step} from {copies[index + 1][0].url}: {exc}", CheckpointWarning,
                                  stacklevel=2)
                continue
            if rng:
                restore_rng(url, storage_options=tier.storage_options, trusted_keys=load_options.get("trusted_keys"))
            record_resume(url, _parts(into), rng=rng, storage_options=tier.storage_options,
                          every_part=isinstance(into, dict))
            self.restored_step, self.restored_url = step, url
            return state
        raise CheckpointNotFoundError(f"step {step}: no tier has a readable copy"
                                      + (f" ({'; '.join(failures)})" if failures else ""))

    def _latest_everywhere(self) -> int | None:
        """With a node-scoped first tier, the newest step every rank can read (from its node's tier or a
        later one): each node's tier holds its own, and a node whose disk was lost reads from the next
        tier. None where a rank has none: the whole job starts afresh together."""
        ranks = RankGroup(self.group, DEFAULT_TIMEOUT_S, "agreeing on the step to restore")
        found = ranks.gather(self.latest())
        if found is not None:
            found = None if None in found else min(found)
        return ranks.broadcast(found)

    # -- after a commit, in the background -----------------------------------------------------
    def _saved(self, future: Future | None, returned: float | None) -> None:
        """The save has ended (an async one: on its thread, at once): copying goes on, and the
        background part of a successful async save joins the measurements."""
        self._resume_housekeeping()
        if future is not None and returned is not None and future.exception() is None:
            self._background_s.append(time.perf_counter() - returned)

    def _resume_housekeeping(self) -> None:
        self._not_saving.set()
        if self.housekeeper is not None:
            self.housekeeper.resume()

    def _housekeep(self, save: Future | None) -> None:
        """One housekeeping run once ``save`` (an async save's future) has committed; storage failures
        warn and are retried after the next save."""
        if save is not None and save.exception() is not None:
            return  # nothing new is committed; the next save, or wait(), raises the error
        housekeeper = self.housekeeper
        assert housekeeper is not None  # queued only where there is one (rank 0, a node tier's leaders)
        with self._lock:
            metrics, self._new_metrics = self._new_metrics, {}
        for problem in housekeeper.run(metrics):
            warnings.warn(f"checkpoint manager: {problem}", CheckpointWarning, stacklevel=2)

    def _copy_to_peers(self, name: str, save: Future | None) -> None:
        """This node's chunks of checkpoint ``name`` to its peers, theirs to it, once committed, then this
        node's part of what the next tier wants; failures warn (the checkpoint is still whole on each
        node's own disk)."""
        if save is not None:
            with contextlib.suppress(BaseException):  # failed on every rank: each leader still takes its turn
                save.result()
        assert self.peers is not None
        protect = protect_across_nodes if self.tiers[0].redundancy == "parity" else copy_to_peers
        problems = protect(self.peers, name, yield_to=self._not_saving.wait)
        if len(self.tiers) > 1:
            housekeeper = self.housekeeper
            problems += drain(self.peers, self.tiers[1], housekeeper.wanted_next if housekeeper is not None else None,
                              yield_to=self._not_saving.wait)
        for problem in problems:
            warnings.warn(f"checkpoint manager: {problem}", CheckpointWarning, stacklevel=2)

    def _protect_again(self, name: str) -> None:
        """Checkpoint ``name``'s parity across the nodes computed again after a restore rebuilt nodes of it
        (they held parity pieces of it that nothing rebuilt); the others rewrite theirs, the same bytes."""
        assert self.peers is not None
        for problem in protect_across_nodes(self.peers, name):
            warnings.warn(f"checkpoint manager: {problem}", CheckpointWarning, stacklevel=2)

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
        if self._step_s and self._stall_s and self._last_saved is not None:
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


def _tiers(given: list, default: Retention, storage_options: dict | None, parity: str | None) -> list[Tier]:
    """The manager's tiers (``_tier``), checked: at least one, and only the first node-scoped."""
    tiers = [_tier(t, default, storage_options, parity) for t in given]
    if not tiers:
        raise ValueError("tiers must name at least one repository")
    if any(tier.scope == "node" for tier in tiers[1:]):
        raise ValueError("only the first tier may be node-scoped (each node's own disk); the next tiers "
                         "are where every node's checkpoints go")
    return tiers


def _schedule(interval: int | str | None, mtbf: timedelta | float,
              housekeeping: str) -> tuple[int | str | None, float]:
    """The manager's ``interval`` and ``mtbf`` (in seconds), checked, with its ``housekeeping``."""
    if interval not in (None, "auto") and (isinstance(interval, bool) or not isinstance(interval, int)
                                           or interval < 1):
        raise ValueError(f"interval must be None, a positive number of steps or 'auto', not {interval!r}")
    mtbf_s = mtbf.total_seconds() if isinstance(mtbf, timedelta) else float(mtbf)
    if not mtbf_s > 0:
        raise ValueError("mtbf must be positive")
    if housekeeping not in ("auto", "thread", "process"):
        raise ValueError(f"housekeeping must be 'auto', 'thread' or 'process', not {housekeeping!r}")
    return interval, mtbf_s


def _save_options(save_options: dict[str, Any], first: Tier) -> SaveOptions:
    """The manager's save options, checked, with the first tier's scope and parity."""
    managed = sorted(set(save_options) & _MANAGED_OPTIONS)
    if managed:
        raise TypeError(f"CheckpointManager sets {managed[0]!r} itself for each save; "
                        f"pass it to save() or to the manager's own arguments")
    options = SaveOptions.from_keywords("CheckpointManager", save_options).replace(
        scope=first.scope, parity=first.parity)
    if first.redundancy == "parity":
        refuse_unless_writable("node-parity", options.format_version, "Tier(redundancy='parity')")
    return options


def _peers(first: Tier, group: Any, format_version: Any) -> NodePeers | None:
    """With a node-scoped first tier across ranks: the job's nodes, found now (collective); else None."""
    if first.scope == "node" and group is not None:
        ranks = RankGroup(group, DEFAULT_TIMEOUT_S, "finding each node's leader")
        return NodePeers(first, ranks, NodeLayout.gather(ranks), first.survives, DEFAULT_TIMEOUT_S, format_version)
    return None


def _own_housekeeper(tiers: list[Tier], peers: NodePeers | None, is_coordinator: bool, gc_wait_s: float,
                     housekeeping: str) -> Housekeeper | HousekeepingProcess | None:
    """This rank's housekeeper: the coordinator's (``_housekeeper``), a node leader's own (no copies), or None."""
    leads_node = peers is not None and peers.is_leader
    drained = peers is not None and peers.group is not None and len(tiers) > 1
    if is_coordinator:
        return _housekeeper(tiers, gc_wait_s, housekeeping, drained)
    if leads_node:
        return Housekeeper(tiers, gc_wait_s, copies=False)
    return None


def _housekeeper(tiers: list[Tier], gc_wait_s: float, where: str,
                 drained: bool) -> Housekeeper | HousekeepingProcess:
    """The housekeeper ``where`` asks for ("auto": a process if there is a tier to copy to); ``drained``:
    the nodes drain the first tier to the second themselves."""
    in_memory = [t.url for t in tiers if in_process_memory(t.url)]
    if where == "process" and in_memory:
        raise ValueError(f"housekeeping='process' cannot reach {in_memory[0]}: it lives in this process's memory")
    if where == "process" and not PROCESS_SUPPORTED:
        raise ValueError(f"housekeeping='process' needs Linux (a stopped child must end with its parent); "
                         f"this is {sys.platform}")
    if where == "process" or (where == "auto" and PROCESS_SUPPORTED and len(tiers) > 1 and not in_memory):
        return HousekeepingProcess(tiers, gc_wait_s, drained=drained)
    return Housekeeper(tiers, gc_wait_s, drained=drained)


def _other_repositories(tiers: list[Tier], reading: Tier) -> list[Repository]:
    """The tiers other than ``reading`` that exist yet, opened, fastest first: where damaged chunks are read."""
    others = []
    for tier in tiers:
        if tier is not reading:
            with contextlib.suppress(CheckpointError):
                others.append(Repository.open(tier.url, tier.storage_options))
    return others


def _tier(tier: str | os.PathLike | Tier, default: Retention, storage_options: dict | None,
          parity: str | None) -> Tier:
    """A tier with the manager's retention and parity where it has none of its own (a node-scoped tier
    takes no parity: its peer copies protect it)."""
    if not isinstance(tier, Tier):
        return Tier(os.fspath(tier).rstrip("/"), default, storage_options, parity=parity)
    return dataclasses.replace(tier, retention=tier.retention or default,
                               parity=tier.parity or (parity if tier.scope == "job" else None))


def _parts(into: Any) -> dict[str, Any]:
    """The top-level parts of a state loaded in place, for ``record_resume`` (none for a bare value)."""
    return dict(into) if isinstance(into, dict) else {}
