"""Retention: which checkpoints of a repository to keep, by rules combined with OR (like Orbax's).

A checkpoint is kept if any rule keeps it; the newest committed checkpoint is
always kept, so a checkpoint is only ever deleted once a newer one exists. A
policy without rules keeps everything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import OPTIONAL_FIELDS
from ckptfmt.format.values import decode_tree
from ckptfmt.repository.repository import CommitRecord, Repository

#: The metadata key under which ``CheckpointManager`` stores a checkpoint's metrics.
METRICS_KEY = "metrics"
MODES = ("min", "max")


@dataclass(frozen=True)
class Retention:
    """Rules: ``keep_last`` the newest N; ``keep_every`` every K steps (step % K == 0); ``keep_best``
    (metric, "min" or "max", N) the N best; ``keep_within`` those created less than a timedelta ago.

    Checkpoints without a step are kept by ``keep_every``, and checkpoints without
    the metric (or with a NaN) by ``keep_best``: a rule never deletes what it cannot judge.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: tuple[str, str, int] | None = None
    keep_within: timedelta | None = None

    def __post_init__(self):
        for field, value in (("keep_last", self.keep_last), ("keep_every", self.keep_every)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer or None, not {value!r}")
        if self.keep_best is not None:
            if not (isinstance(self.keep_best, tuple) and len(self.keep_best) == 3):
                raise ValueError("keep_best must be (metric, 'min' or 'max', count)")
            metric, mode, count = self.keep_best
            if not isinstance(metric, str) or mode not in MODES or isinstance(count, bool) \
                    or not isinstance(count, int) or count < 1:
                raise ValueError(f"keep_best must be (metric, 'min' or 'max', positive count), not {self.keep_best!r}")
        if self.keep_within is not None and (not isinstance(self.keep_within, timedelta)
                                             or self.keep_within <= timedelta(0)):
            raise ValueError("keep_within must be a positive datetime.timedelta")

    @property
    def active(self) -> bool:
        """Whether any rule is set (without one, everything is kept)."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best, self.keep_within))

    @property
    def needs_metrics(self) -> bool:
        return self.keep_best is not None

    def to_delete(self, records: list[CommitRecord], metrics: Callable[[CommitRecord], dict] | None = None,
                  now_ns: int | None = None) -> list[CommitRecord]:
        """The checkpoints no rule keeps, oldest first. ``metrics(record)`` gives a checkpoint's metrics
        (needed by ``keep_best``)."""
        if not self.active or not records:
            return []
        ordered = sorted(records, key=lambda r: (r.created_ns, r.name))
        kept = {ordered[-1].name} | self._kept(ordered, metrics, time.time_ns() if now_ns is None else now_ns)
        return [r for r in ordered if r.name not in kept]

    def kept(self, records: list[CommitRecord], metrics: Callable[[CommitRecord], dict] | None = None,
             now_ns: int | None = None) -> set[str]:
        """The names the rules keep, without the newest-is-kept guarantee: what a tier that does
        not have them yet wants copied."""
        if not self.active:
            return {r.name for r in records}
        ordered = sorted(records, key=lambda r: (r.created_ns, r.name))
        return self._kept(ordered, metrics, time.time_ns() if now_ns is None else now_ns)

    def _kept(self, ordered: list[CommitRecord], metrics, now_ns: int) -> set[str]:
        kept: set[str] = set()
        if self.keep_last is not None:
            kept.update(r.name for r in ordered[-self.keep_last:])
        if self.keep_every is not None:
            kept.update(r.name for r in ordered if r.step is None or r.step % self.keep_every == 0)
        if self.keep_within is not None:
            horizon = now_ns - int(self.keep_within.total_seconds() * 1e9)
            kept.update(r.name for r in ordered if r.created_ns >= horizon)
        if self.keep_best is not None:
            if metrics is None:
                raise ValueError("keep_best needs the checkpoints' metrics")
            kept.update(_best(ordered, metrics, *self.keep_best))
        return kept


def _best(ordered: list[CommitRecord], metrics, metric: str, mode: str, count: int) -> set[str]:
    """The ``count`` best checkpoints by ``metric``, plus every one that lacks it."""
    scored, unjudged = [], set()
    for record in ordered:
        value = metrics(record).get(metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            unjudged.add(record.name)
        else:
            scored.append((value if mode == "min" else -value, -record.created_ns, record.name))
    return unjudged | {name for _, _, name in sorted(scored)[:count]}


def metrics_reader(repo: Repository) -> Callable[[CommitRecord], dict]:
    """``record -> metrics``: what ``CheckpointManager.save(metrics=)`` stored in a checkpoint's
    metadata, read from its manifest once per manifest ({} when there are none)."""
    cache: dict[str, dict] = {}

    def metrics(record: CommitRecord) -> dict:
        if record.manifest_hash not in cache:
            try:
                user = decode_tree(repo.manifest(record.name, record, skip=OPTIONAL_FIELDS).user)
            except CheckpointError:  # gone or damaged: nothing to judge it by, so keep_best keeps it
                user = {}
            found = user.get(METRICS_KEY) if isinstance(user, dict) else None
            cache[record.manifest_hash] = found if isinstance(found, dict) else {}
        return cache[record.manifest_hash]
    return metrics

