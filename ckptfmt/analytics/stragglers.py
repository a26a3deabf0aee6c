"""Stragglers: which ranks delayed the others, in which steps, by how much; and which saved slowly.

In synchronous training a straggler's own step is no longer than anyone's:
the others wait for it inside a collective (DDP's all-reduce in ``backward``),
so every rank's step takes as long. What differs is where the time goes. The
straggler spends longer than the rest in a phase of its own work (``data``,
``forward``), while the others spend as much longer in the phase holding the
wait. So, phase by phase and step by step, each rank's time is compared with
the median over ranks: a rank whose time exceeds it by far more than the run's
jitter, in a phase where only a few ranks do (a minority: the wait phase is long
on most ranks, and short on the straggler), delayed that step.

"Far more than the jitter": over ``max(k * noise, share * median, step_share *
median step, floor)``, where ``noise`` is the phase's robust spread over the
whole run (1.4826 x the median absolute deviation from the per-step medians):
rare hiccups (a preempted process) do not move it, and the floors keep them out. Flagged (rank, step)
pairs are grouped into episodes of consecutive steps (bridging gaps of up to
``episode_gap`` steps, which jitter may hide); a rank with an episode spanning at
least ``persistent`` of the run (and ``persistent_steps``) is a persistent
straggler, else a transient one. Several slow
ranks of one host in the same steps point at the host. Save phases are judged
the same way per checkpoint (``join``, ``plan`` and ``wait_ranks`` are waits).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from .grids import StepGrid
from .tables import tables

#: Phases of a collective save that are waits for other ranks, not a rank's own work.
SAVE_WAITS = frozenset({"join", "plan", "wait_ranks"})


@dataclass(frozen=True)
class Thresholds:
    """When a rank's time in a phase counts as a delay (see the module docstring)."""

    #: Times the phase's noise (robust spread) over the run.
    k: float = 4.5
    #: Share of the phase's median at that step.
    share: float = 0.25
    #: Share of the median step duration at that step (of the median save, for save phases).
    step_share: float = 0.05
    #: Seconds, whatever the phase's noise.
    floor_s: float = 0.01
    #: At most this share of the ranks may be slow in one phase at one step (else it is the wait,
    #: or everyone slowed down).
    minority: float = 0.34
    #: Steps without a delay that an episode bridges.
    episode_gap: int = 2
    #: An episode spanning this share of the run's steps, and at least ``persistent_steps``, is persistent.
    persistent: float = 0.25
    persistent_steps: int = 10


def stragglers(source: str | os.PathLike | Mapping[str, pa.Table], *, thresholds: Thresholds = Thresholds(),
               storage_options: dict | None = None) -> dict:
    """The straggler report of one run: ``source`` is a repository URL or its ``tables()``.

    Returns ``{"stragglers": [...], "hosts": [...], "slow_saves": [...], "steps": n, "ranks": n}``:
    per straggler its rank, host, steps, total ``delay_s``, ``ratio`` (times the median, at its worst
    step), phase, ``kind`` (persistent or transient) and ``episodes``.
    """
    built = source if isinstance(source, Mapping) else tables(source, storage_options=storage_options)
    steps = built["steps"]
    report = {"steps": 0, "ranks": 0, "stragglers": [], "hosts": [], "slow_saves": []}
    if steps.num_rows:
        delays = step_delays(steps, thresholds)
        report.update(steps=delays.steps.size, ranks=delays.ranks.size,
                      stragglers=_stragglers(delays, thresholds), hosts=_hosts(delays))
    report["slow_saves"] = _slow_saves(built["saves"], thresholds)
    return report


@dataclass
class Delays:
    """Per (step, rank): the delay found (seconds, 0 where none), in which phase, and how many times the
    median that phase took."""

    steps: np.ndarray  # the step numbers, sorted
    ranks: np.ndarray  # the ranks, sorted
    hosts: dict[int, str]
    delay_s: np.ndarray  # steps x ranks
    ratio: np.ndarray  # steps x ranks
    phase: np.ndarray  # steps x ranks, object: the phase name, or None


def step_delays(steps: pa.Table, thresholds: Thresholds = Thresholds()) -> Delays:
    """Judge every (step, rank) of a steps table (one run) phase by phase against the other ranks."""
    grid = StepGrid(steps)
    shape = (grid.steps.size, grid.ranks.size)
    delay, ratio = np.zeros(shape), np.ones(shape)
    phase = np.full(shape, None, dtype=object)
    with np.errstate(all="ignore"):
        step_floor = np.maximum(thresholds.step_share * np.nanmedian(grid.values("duration_s"), axis=1, keepdims=True),
                                thresholds.floor_s)
    for name in [c for c in steps.column_names if c.startswith("phase_")]:
        excess, times = _excess(grid.values(name), thresholds, step_floor)
        better = excess > delay
        delay[better], ratio[better], phase[better] = excess[better], times[better], name[len("phase_"):]
    return Delays(grid.steps, grid.ranks, grid.hosts, delay, ratio, phase)


def _excess(values: np.ndarray, thresholds: Thresholds, floor: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Per (row, column): seconds over the row's median where that is a delay (else 0), and the ratio.

    Rows are steps (or checkpoints), columns ranks; ``floor``: the least delay in seconds, per row or one.
    """
    with np.errstate(all="ignore"):
        median = np.nanmedian(values, axis=1, keepdims=True)
        deviation = values - median
        noise = 1.4826 * np.nanmedian(np.abs(deviation)) if np.isfinite(deviation).any() else 0.0
        limit = np.maximum(np.maximum(thresholds.k * noise, thresholds.share * median), floor)
        slow = deviation > limit
        ranks = np.sum(np.isfinite(values), axis=1, keepdims=True)
        few = np.sum(slow, axis=1, keepdims=True) <= np.maximum(1, np.floor(thresholds.minority * ranks))
        slow &= few
        excess = np.where(slow, deviation, 0.0)
        times = np.where(slow, values / np.where(median > 0, median, np.nan), 1.0)
    return excess, np.nan_to_num(times, nan=np.inf)


def _stragglers(delays: Delays, thresholds: Thresholds) -> list[dict]:
    found = []
    for column, rank in enumerate(delays.ranks.tolist()):
        rows = np.nonzero(delays.delay_s[:, column] > 0)[0]
        if rows.size == 0:
            continue
        runs = np.split(rows, np.nonzero(np.diff(rows) > thresholds.episode_gap + 1)[0] + 1)
        episodes = [_episode(delays, column, run) for run in runs]
        longest = max(run[-1] - run[0] + 1 for run in runs)
        worst = rows[np.argmax(delays.delay_s[rows, column])]
        phases = delays.phase[rows, column].tolist()
        found.append({
            "rank": rank, "host": delays.hosts.get(rank),
            "steps": delays.steps[rows].tolist(),
            "delay_s": float(delays.delay_s[rows, column].sum()),
            "max_delay_s": float(delays.delay_s[worst, column]),
            "ratio": _finite(delays.ratio[worst, column]),
            "phase": max(set(phases), key=phases.count),
            "kind": "persistent" if longest >= max(thresholds.persistent * delays.steps.size,
                                                   thresholds.persistent_steps) else "transient",
            "episodes": episodes,
        })
    return sorted(found, key=lambda s: -s["delay_s"])


def _episode(delays: Delays, column: int, rows: np.ndarray) -> dict:
    phases = delays.phase[rows, column].tolist()
    return {"first_step": int(delays.steps[rows[0]]), "last_step": int(delays.steps[rows[-1]]),
            "steps": int(rows.size), "delay_s": float(delays.delay_s[rows, column].sum()),
            "ratio": _finite(np.median(delays.ratio[rows, column])), "phase": max(set(phases), key=phases.count)}


def episode_ranges(episodes: list[dict]) -> str:
    """A straggler's episodes as text: ``4-7, 12``."""
    return ", ".join(str(e["first_step"]) if e["first_step"] == e["last_step"] else f"{e['first_step']}-{e['last_step']}"
                     for e in episodes)


def _finite(value: float) -> float | None:
    """A ratio for the report: None where the median was 0 (JSON has no infinity)."""
    return float(value) if np.isfinite(value) else None


def _hosts(delays: Delays) -> list[dict]:
    """Hosts with two or more ranks slow in the same steps."""
    slow = delays.delay_s > 0
    by_host: dict[str, list[int]] = {}
    for column, rank in enumerate(delays.ranks.tolist()):
        by_host.setdefault(delays.hosts.get(rank), []).append(column)
    found = []
    for host, columns in by_host.items():
        together = slow[:, columns].sum(axis=1) >= 2
        if not together.any():
            continue
        ranks = [int(delays.ranks[c]) for c in columns if slow[together, c].any()]
        found.append({"host": host, "ranks": ranks, "of_ranks": len(columns),
                      "steps": delays.steps[together].tolist(),
                      "delay_s": float(delays.delay_s[together][:, columns].sum())})
    return sorted(found, key=lambda h: -h["delay_s"])


def _slow_saves(saves: pa.Table, thresholds: Thresholds) -> list[dict]:
    """Ranks whose own save phases lagged the other ranks', per checkpoint."""
    if saves.num_rows == 0:
        return []
    names = saves.column("name").combine_chunks().dictionary_encode()
    checkpoints, name_index = names.dictionary.to_pylist(), names.indices.to_numpy(zero_copy_only=False)
    rank_numbers = saves.column("rank").to_numpy(zero_copy_only=False)
    ranks, rank_index = np.unique(rank_numbers, return_inverse=True)
    if ranks.size < 2:
        return []
    hosts = dict(zip(rank_numbers.tolist(), saves.column("host").to_pylist()))
    phase_names = np.asarray(saves.column("phase").to_pylist(), dtype=object)
    durations = saves.column("duration_s").to_numpy(zero_copy_only=False).astype(np.float64)
    totals = np.full((len(checkpoints), ranks.size), np.nan)
    totals[name_index, rank_index] = saves.column("rank_total_s").to_numpy(zero_copy_only=False).astype(np.float64)
    with np.errstate(all="ignore"):  # as for steps: a share of the checkpoint's median save, at least floor_s
        floor = np.maximum(thresholds.step_share * np.nanmedian(totals, axis=1, keepdims=True), thresholds.floor_s)
    floor = np.where(np.isfinite(floor), floor, thresholds.floor_s)
    found: dict[int, dict] = {}
    for phase in sorted({p for p in phase_names.tolist() if isinstance(p, str)} - SAVE_WAITS):
        chosen = phase_names == phase
        values = np.full((len(checkpoints), ranks.size), np.nan)
        values[name_index[chosen], rank_index[chosen]] = durations[chosen]
        excess, times = _excess(values, thresholds, floor)
        for row, column in zip(*np.nonzero(excess > 0)):
            rank = int(ranks[column])
            entry = found.setdefault(rank, {"rank": rank, "host": hosts.get(rank), "checkpoints": [], "phases": [],
                                            "delay_s": 0.0, "ratio": 1.0})
            entry["checkpoints"].append(checkpoints[row])
            entry["phases"].append(phase)
            entry["delay_s"] += float(excess[row, column])
            entry["ratio"] = max(entry["ratio"], _finite(times[row, column]) or 0.0)
    return sorted(found.values(), key=lambda e: -e["delay_s"])
