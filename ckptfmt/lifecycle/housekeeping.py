"""What the checkpoint manager does after each commit: copy to the next tiers the checkpoints they
keep, apply each tier's retention, collect the garbage.

A ``Housekeeper`` runs on the manager's background thread; a
``HousekeepingProcess`` (``housekeeping_process``) hands the copying to a child
process (docs/design/replication-child.md). Neither deletes a checkpoint before a newer one is
committed (retention's rule) or before the next tier has the copy its rules
want, and both pause copying while the loop saves to the first tier.
"""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass, field

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.lifecycle.gc import collect, remove
from ckptfmt.lifecycle.protect import protect
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.lifecycle.retention import Retention, metrics_reader
from ckptfmt.repository.protection import parse_parity
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.saving.options import SCOPES

#: How a node-scoped tier survives lost nodes: full copies on peers, or parity across the nodes.
REDUNDANCIES = ("copies", "parity")
#: Chunks copied to the next tier at a time: few, so that a save starting meanwhile soon has the machine
#: back (copying pauses for it, but what is already queued finishes).
REPLICATION_WORKERS = 2


@dataclass(frozen=True)
class Tier:
    """One storage tier: a repository URL, its own retention (None: the manager's rules) and options.

    ``scope="node"``: the URL names each node's own storage (a node-local disk, the same path on every
    node), which holds the boxes of that node's ranks (``ckptfmt.save(scope="node")``, spec 9.8); only
    the first, fastest tier may be one. ``survives``: for a node-scoped tier, how many other nodes
    keep a verified copy of each node's chunks of every checkpoint (``peer_copies``), so that losing
    that many nodes' disks loses no checkpoint. ``parity``: ``"K+M"`` Reed-Solomon parity for this
    tier's checkpoints (spec 5.6; None: the manager's ``parity=``, if any): the first tier's saves write
    it, a later tier's copies get it once they arrive (``protect``).
    """

    url: str
    retention: Retention | None = None
    storage_options: dict | None = field(default=None, hash=False)
    scope: str = "job"
    survives: int = 1
    parity: str | None = None
    redundancy: str = "copies"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"a tier's scope must be one of {', '.join(SCOPES)}, not {self.scope!r}")
        if isinstance(self.survives, bool) or not isinstance(self.survives, int) or self.survives < 0:
            raise ValueError("a tier's survives= (the lost nodes it survives) must be an int >= 0, not "
                             f"{self.survives!r}")
        if self.redundancy not in REDUNDANCIES:
            raise ValueError(f"a tier's redundancy must be one of {', '.join(REDUNDANCIES)}, not {self.redundancy!r}")
        if self.redundancy == "parity" and self.scope != "node":
            raise ValueError("redundancy='parity' stripes a node-scoped tier's nodes with each other: a tier of "
                             "scope 'job' takes parity='K+M' instead")
        if self.parity is not None:
            parse_parity(self.parity)
            if self.scope == "node":
                raise ValueError("a node-scoped tier's nodes each hold their own chunks: its checkpoints are "
                                 "protected by peer copies or parity across nodes (survives=, redundancy=), "
                                 "not by parity=")

    @property
    def replicas(self) -> int:
        """Deprecated: ``survives`` (``replicas`` also names a manifest's replica divergence)."""
        warnings.warn("Tier.replicas is deprecated: use Tier.survives", DeprecationWarning, stacklevel=2)
        return self.survives


#: ``Tier(..., replicas=K)``, its spelling before 1.2.0, still works (with a DeprecationWarning).
Tier.__init__ = renamed_arguments(replicas="survives")(Tier.__init__)  # type: ignore[method-assign]


def tier_records(tier: Tier) -> list[CommitRecord]:
    """The tier's committed checkpoints, oldest first; none where nothing was saved yet."""
    try:
        return Repository.open(tier.url, tier.storage_options).commits()
    except CheckpointNotFoundError:
        return []


class Housekeeper:
    """Replication, retention and garbage collection over the tiers (fastest first), one pass per ``run``.

    ``pause`` and ``resume`` may be called from any thread: copying waits
    between chunks while paused. Between runs it remembers what it learnt: the
    metrics of saves, which tiers may hold garbage, and the chunk keys of the
    manifests each collection has read.
    """

    def __init__(self, tiers: list[Tier], gc_wait_s: float, *, copies: bool = True, drained: bool = False):
        self.tiers = tiers
        self.gc_wait_s = gc_wait_s
        #: False: retention and collection on the first tier only (a node's own tier, whose copies, and
        #: the next tiers' upkeep, are rank 0's).
        self.copies = copies
        #: True: the first tier is node-scoped across nodes, and its nodes' leaders drain it to the next
        #: tier themselves (``peer_drains.drain``): only the later tiers are copied here.
        self.drained = drained
        self._running = threading.Event()
        self._running.set()
        #: Checkpoint name -> the metrics its save was given (the rest are read from the checkpoints).
        self._metrics: dict[str, dict] = {}
        self._garbage = [False] * len(tiers)
        #: Per tier, manifest hash -> chunk keys: each collection reads only manifests it has not seen.
        self._known: list[dict[str, frozenset[str]]] = [{} for _ in tiers]

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        """Nothing to release (a ``HousekeepingProcess`` ends its child here)."""

    def run(self, metrics: dict[str, dict]) -> list[str]:
        """One pass, given the metrics of the checkpoints saved since the last; returns what failed, in
        words (storage trouble: the next pass tries again), and raises only what is not a CheckpointError.
        Copies come first: retention deletes nothing the next tier still wants."""
        return (self.replicate(metrics) if self.copies else []) + self.retain()

    def replicate(self, metrics: dict[str, dict]) -> list[str]:
        """Copy to each next tier the checkpoints it lacks and keeps; what failed, in words."""
        self._metrics.update(metrics)
        problems: list[str] = []
        for index, (source, target) in enumerate(zip(self.tiers, self.tiers[1:])):
            if index == 0 and self.drained:
                continue
            self._attempt(problems, f"replicating to {target.url}", functools.partial(
                self._copy, source, target))
        return problems

    def _copy(self, source: Tier, target: Tier) -> None:
        """Copy what ``target`` lacks and keeps; where it has its own parity, protect each copy with it
        (a copy arrives with the source's parity, which ``protect`` keeps when it is the same code)."""
        report = replicate(source.url, target.url, self._wanted(source, target),
                           storage_options=source.storage_options, dst_storage_options=target.storage_options,
                           workers=REPLICATION_WORKERS, yield_to=self._running.wait)
        if target.parity is not None:
            for name in report.copied:
                protect(f"{target.url}/{name}", target.parity, storage_options=target.storage_options)

    def retain(self) -> list[str]:
        """Apply each tier's retention and collect its garbage; what failed, in words."""
        problems: list[str] = []
        for index, tier in enumerate(self.tiers if self.copies else self.tiers[:1]):
            following = self.tiers[index + 1] if index + 1 < len(self.tiers) else None
            self._attempt(problems, f"retention on {tier.url}", functools.partial(self._retain, index, tier, following))
        return problems

    @staticmethod
    def _attempt(problems: list[str], what: str, work) -> None:
        try:
            work()
        except CheckpointError as exc:
            problems.append(f"{what} failed, will retry after the next save: {exc}")

    def wanted_next(self) -> list[str]:
        """The first tier's checkpoints that the second lacks and keeps (for the nodes' drain)."""
        return self._wanted(self.tiers[0], self.tiers[1])

    def _wanted(self, source: Tier, target: Tier) -> list[str]:
        """Checkpoints of ``source`` that ``target`` lacks and its retention would keep."""
        held = tier_records(target)
        present = {r.name for r in held}
        candidates = [r for r in tier_records(source) if r.name not in present]
        kept = _rules(target).kept(held + candidates, self._metrics_of(source))
        return [r.name for r in candidates if r.name in kept]

    def _retain(self, index: int, tier: Tier, following: Tier | None) -> None:
        repo = Repository.open(tier.url, tier.storage_options)
        records = repo.commits()
        doomed = {r.name for r in _rules(tier).to_delete(records, self._metrics_of(tier))}
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


def _rules(tier: Tier) -> Retention:
    """A tier's retention; the manager gives every tier its own or the run's rules before housekeeping."""
    if tier.retention is None:
        raise ValueError(f"{tier.url}: a tier needs its retention rules before housekeeping")
    return tier.retention
