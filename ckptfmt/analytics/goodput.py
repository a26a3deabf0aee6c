"""Where a run's wall time went, from its records alone (issue 29, part 5): ``ckptfmt goodput RUN``.

Per rank, the run's timeline is rebuilt from every save's timing (spec 9.4: each
step's start, duration and phases; each save's phases; each resume), the history
objects of removed checkpoints (spec 4.5) and the progress objects of the
processes (spec 4.6: the steps a killed process computed after its last save,
which no checkpoint holds, and its resumes no save stored: a process killed before
its first save after a resume is a restart all the same). Its wall time, from its first step's start to its
last step's or save's end, is split into:

- ``productive``: the steps the run kept (the last computation of each step
  number), less their data phases and the waits on stragglers;
- ``data_waits``: those steps' ``data`` phases;
- ``save_stalls``: the time saves held the loop, outside the steps: each
  save's whole call as the step timer recorded it (spec 9.4 ``stalls``), else
  the save's own phases (an asynchronous one's staging copy);
- ``restarts``: from the last moment a stopped process is known to have worked
  (its last step's or save's end) to the first step after the resume that
  followed (the resume's record, spec 9.4 ``resumes``, marks it);
- ``recomputed``: the steps computed and then computed again (lost with a
  killed process, or of a branch the run abandoned by resuming from an older
  checkpoint);
- ``straggler_waits``: with several ranks, per step the largest delay a rank
  added (``stragglers``): every rank waited that long;
- ``other``: what is left (time between steps the records do not cover).

The job's figures are the mean of its ranks'. Each restart and each change of
world size is listed with its moments (the timeline).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.analytics.timings import saved_timings
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.progress import read_progress
from ckptfmt.repository.repository import Repository

#: The categories, in the order they are shown, and how they are named where people read them.
CATEGORY_NAMES = {"productive": "productive steps", "data_waits": "data waits", "save_stalls": "save stalls",
                  "restarts": "restarts", "recomputed": "steps computed again", "straggler_waits": "straggler waits",
                  "other": "other"}
CATEGORIES = tuple(CATEGORY_NAMES)


@dataclass
class Goodput:
    """``goodput``'s answer (the JSON of ``ckptfmt goodput --json``)."""

    run: str
    ranks: int
    wall_s: float
    #: Seconds per category (CATEGORIES), the mean over ranks.
    seconds: dict[str, float]
    #: Each restart: rank, when the stopped process last worked, the resume, the first step after it.
    restarts: list[dict] = field(default_factory=list)
    #: The world size over time: ``{"from_ns", "world_size"}`` at the first save and at each change.
    world_sizes: list[dict] = field(default_factory=list)
    steps_kept: int = 0
    steps_recomputed: int = 0

    @property
    def shares(self) -> dict[str, float]:
        return {name: (value / self.wall_s if self.wall_s > 0 else 0.0) for name, value in self.seconds.items()}

    def to_json(self) -> dict:
        return {"run": self.run, "ranks": self.ranks, "wall_s": self.wall_s, "seconds": self.seconds,
                "shares": self.shares, "steps_kept": self.steps_kept, "steps_recomputed": self.steps_recomputed,
                "restarts": self.restarts, "world_sizes": self.world_sizes}


@dataclass
class _Rank:
    """One rank's records: step computations (step, start_ns, end_ns, data_s), save stalls (start_ns,
    end_ns), resumes (the stored records)."""

    computations: set[tuple[int, int, int, float]] = field(default_factory=set)
    #: Each save's own record of when it held the loop (its phases: the commit after them is missing).
    saves: list[tuple[int, int]] = field(default_factory=list)
    #: The timer's record of each save's whole call (spec 9.4 ``stalls``, stored by the next save).
    held: list[tuple[int, int]] = field(default_factory=list)
    resumes: list[dict] = field(default_factory=list)

    @property
    def stalls(self) -> list[tuple[int, int]]:
        """When saves held the loop: the timer's records, and the saves' own where the timer has none
        (the last save of a process: no later save stored its whole call)."""
        held = sorted(set(self.held))
        starts = [start for start, _ in held]

        def recorded(save: tuple[int, int]) -> bool:  # a held interval began at or before it and covers it
            at = bisect.bisect_right(starts, save[0]) - 1
            return at >= 0 and held[at][1] >= save[0]
        return held + [save for save in self.saves if not recorded(save)]


@renamed_arguments(run="repo")
def goodput(repo: str | os.PathLike, *, storage_options: dict | None = None, built: dict | None = None) -> Goodput:
    """Split the wall time of the run in repository ``repo`` (see the module's docstring). ``built``: the
    run's ``tables``, where the caller has them (the stragglers are found in their steps)."""
    opened = Repository.open(repo, storage_options)
    ranks: dict[int, _Rank] = {}
    world_sizes: list[dict] = []
    for created_ns, timing in saved_timings(opened):
        entries = [entry for entry in timing.get("ranks") or [] if isinstance(entry, dict)]
        if entries and (not world_sizes or world_sizes[-1]["world_size"] != len(entries)):
            world_sizes.append({"from_ns": created_ns, "world_size": len(entries)})
        for index, entry in enumerate(entries):
            rank = entry.get("rank")
            if type(rank) is not int:
                continue
            records = ranks.setdefault(rank, _Rank())
            if entry.get("steps") is not None:
                records.computations |= _computations(decode_steps(entry["steps"],
                                                                   f"{opened.url}: timing.ranks[{index}].steps"))
            records.held += _held(entry.get("stalls"))
            stall = _stall(entry)
            if stall is not None:
                records.saves.append(stall)
            records.resumes += [r for r in entry.get("resumes") or [] if isinstance(r, dict)]
    for progress in read_progress(opened):
        records = ranks.setdefault(progress.rank, _Rank())
        if progress.steps:
            records.computations |= _computations(decode_steps(progress.steps, f"progress of rank {progress.rank}"))
        records.held += _held(progress.stalls)  # also stored by a save, if one came after: stalls dedupes
        # a process that died before its first save after a resume: its resume is on record here alone
        records.resumes += [r for r in progress.resumes or [] if isinstance(r, dict)]
    straggling = _straggler_waits(opened.url, storage_options, built) if len(ranks) > 1 else 0.0
    per_rank = [_account(records, straggling) for records in ranks.values() if records.computations]
    if not per_rank:
        return Goodput(opened.url, 0, 0.0, dict.fromkeys(CATEGORIES, 0.0), world_sizes=world_sizes)
    seconds = {name: float(np.mean([each.seconds[name] for each in per_rank])) for name in CATEGORIES}
    restarts = sorted((restart for each in per_rank for restart in each.restarts),
                      key=lambda restart: (restart["resumed_ns"], restart["rank"]))
    return Goodput(opened.url, len(per_rank), float(np.mean([each.wall_s for each in per_rank])), seconds,
                   restarts=restarts, world_sizes=world_sizes, steps_kept=max(each.kept for each in per_rank),
                   steps_recomputed=max(each.recomputed for each in per_rank))


def _computations(columns) -> set[tuple[int, int, int, float]]:
    data = columns.phases.get("data")
    found = set()
    for row, step in enumerate(columns.step.tolist()):
        start = int(columns.start_ns[row])
        waited = 0.0 if data is None or np.isnan(data[row]) else float(data[row])
        found.add((int(step), start, start + int(round(float(columns.duration_s[row]) * 1e9)), waited))
    return found


def _held(stalls: object) -> list[tuple[int, int]]:
    """A rank entry's ``stalls`` (spec 9.4) as intervals."""
    if not isinstance(stalls, dict):
        return []
    starts, durations = stalls.get("start_ns") or [], stalls.get("duration_s") or []
    return [(start, start + int(duration * 1e9)) for start, duration in zip(starts, durations)
            if type(start) is int and isinstance(duration, (int, float))]


def _stall(entry: dict) -> tuple[int, int] | None:
    """When a save held this rank's loop: an asynchronous save's staging copy, else its phases."""
    phases = [p for p in entry.get("phases") or [] if isinstance(p, dict) and type(p.get("start_ns")) is int
              and isinstance(p.get("duration_s"), (int, float))]
    if not phases:
        return None
    staged = [p for p in phases if p.get("name") == "stage"]
    chosen = staged or phases
    start = min(p["start_ns"] for p in chosen)
    return start, max(p["start_ns"] + int(p["duration_s"] * 1e9) for p in chosen)


def _straggler_waits(url: str, storage_options: dict | None, built: dict | None) -> float:
    """Per step, the largest delay a rank added (every rank waited for it), summed over the steps."""
    from ckptfmt.analytics.stragglers import step_delays
    from ckptfmt.analytics.tables import tables

    built = built if built is not None else tables(url, storage_options=storage_options)
    delays = step_delays(built["steps"], system=built.get("system"))  # a busy host's noise is no straggler
    return float(delays.delay_s.max(axis=1).sum()) if delays.delay_s.size else 0.0


class _Account(NamedTuple):
    """One rank's seconds per category, its restarts, wall time, steps kept and steps computed again."""

    seconds: dict[str, float]
    restarts: list[dict]
    wall_s: float
    kept: int
    recomputed: int


def _account(records: _Rank, straggling: float) -> _Account:
    """One rank's split of its wall time."""
    computations = sorted(records.computations, key=lambda c: (c[1], c[0]))
    kept: dict[int, tuple[int, int, int, float]] = {}
    for computation in computations:  # the latest computation of a step number is the one the run kept
        kept[computation[0]] = computation
    wasted = [c for c in computations if kept[c[0]] is not c]
    steps = [(c[1], c[2]) for c in computations]
    stalls = [(start, end) for start, end in records.stalls if end > start]
    first = min(start for start, _ in steps)
    last = max([end for _, end in steps] + [end for start, end in stalls if start >= first])
    account = dict.fromkeys(CATEGORIES, 0.0)
    data = sum(c[3] for c in kept.values())
    busy = sum((c[2] - c[1]) / 1e9 for c in kept.values())
    account["data_waits"] = data
    account["straggler_waits"] = min(straggling, max(busy - data, 0.0))
    account["productive"] = max(busy - data - account["straggler_waits"], 0.0)
    account["recomputed"] = sum((c[2] - c[1]) / 1e9 for c in wasted)
    ordered = sorted(steps)
    starts = [step_start for step_start, _ in ordered]
    account["save_stalls"] = sum(_outside(start, end, ordered, starts) for start, end in stalls if start >= first)
    restarts = []
    seen: set[int] = set()
    for resume in records.resumes:
        resumed = resume.get("resumed_ns")
        if type(resumed) is not int or resumed in seen:  # a progress object's and a save's record of one resume
            continue
        seen.add(resumed)
        before = [end for _, end in steps + stalls if end <= resumed]
        after = [start for start, _ in steps if start >= resumed]
        if not before or not after:
            continue
        stopped, restarted = max(before), min(after)
        account["restarts"] += (restarted - stopped) / 1e9
        source = resume.get("from") or {}
        restarts.append({"rank": resume.get("rank"), "stopped_ns": stopped, "resumed_ns": resumed,
                         "first_step_ns": restarted, "seconds": (restarted - stopped) / 1e9,
                         "from": source.get("name"), "from_step": source.get("step"),
                         "world_size": list(resume.get("world_size") or [])})
    wall = (last - first) / 1e9
    account["other"] = max(wall - sum(account.values()), 0.0)
    return _Account(account, restarts, wall, len(kept), len(wasted))


def _outside(start: int, end: int, steps: list[tuple[int, int]], starts: list[int]) -> float:
    """Seconds of [start, end] outside every step's interval (a save a framework makes inside a step's
    phase is already that step's time). ``steps`` sorted by start (a rank's do not overlap), ``starts``
    their starts: only the steps just before ``end`` are looked at."""
    covered, at = 0, bisect.bisect_left(starts, end) - 1
    while at >= 0 and steps[at][1] > start:
        covered += max(0, min(end, steps[at][1]) - max(start, steps[at][0]))
        at -= 1
    return max(end - start - covered, 0) / 1e9
