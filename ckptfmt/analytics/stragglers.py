"""Stragglers: which ranks delayed the others, in which steps, by how much; and which saved slowly.

In synchronous training a straggler's own step is no longer than anyone's:
the others wait for it inside a collective (DDP's all-reduce in ``backward``,
FSDP's all-gather in ``forward``), so every rank's step takes as long. What
tells is when each rank gets to that collective: the rank that arrives last
delayed the others, and their longer wait is its delay, not theirs. Nothing
in a step record names the collective, so the end of every phase is a candidate:

- Arrival: a rank reaches the end of a phase at its step's start plus that
  phase and those before it, in the order the timer first recorded them
  (phases are taken to run back to back, in the same order every step, and to
  cover the step's work).
- Clocks: the collective that ends a synchronous step ends it on every rank at
  once, so a rank's clock offset is the median over steps of its step end
  minus the step's median end; it is taken off the rank's times.
- Lateness at a phase end: the rank's arrival minus the median arrival of the
  other ranks (with two ranks, the other rank's: a median over both would put
  the baseline halfway between the straggler and the rank waiting for it, and
  blame both). What the rank was already late at its step's start is taken
  off (being early is no credit): that comes from before the step (a process
  that started late, work between steps), and each step's own work is judged.
- Evidence, per phase: the lateness gained in the phase and still held at its
  end (its jitter is the phase's own), and the lateness held at its end however
  gained (a rank somewhat slow in several phases). Either is a delay where it
  exceeds ``max(k * jitter, step_share * median step, floor_s)``; ``jitter`` is
  its robust spread over the run, from its changes between consecutive steps
  on each rank (a persistent straggler changes its lateness only where it
  starts and stops, so it cannot pass for jitter even with two ranks). The
  delay is the rank's lateness at the worst such phase end; its phase, the one
  in which it gained most of it. A waiting rank is early at the end of the
  phase it waits in (its lateness is made up there): it is never blamed.
- A busy host: where the system samples show the rank's host with more
  runnable tasks than CPUs when the step ran (the 1-minute load of the rank's
  sample nearest the step, over the host's CPUs, above ``busy_load``), ranks
  wait for a CPU now and then, and the jitter is the scheduler's. Its tail is
  heavy (2 or 4 ranks on 2 cores at a load of 4-6: a rank gained 5 ms of
  lateness or more in its data or forward phase in a third of the steps, 50 ms
  in 2% of them, 150 ms in 0.05%), so the median of the changes, which sees
  the many steps it spared, underestimates it: there the jitter is the larger
  of that estimate and the one from the changes' upper quartile (still robust
  to stragglers, in up to a quarter of the changes, and it sees where the tail
  begins). And the scheduler's delays are held until the next collective,
  those that wake a rank late from one until the step's end, where the ranks'
  lateness otherwise scatters little: there the lateness held at a phase end
  is judged against the largest jitter of the lateness held at any phase end.
  Without samples, or on a host with CPUs to spare, the jitter is as above.

Flagged (rank, step) pairs are grouped into episodes of consecutive steps
(bridging gaps of up to ``episode_gap`` steps, which jitter may hide); a rank
with an episode spanning at least ``persistent`` of the run (and
``persistent_steps``) is a persistent straggler, else a transient one. Several
slow ranks of one host in the same steps point at the host. Save phases are
judged per checkpoint against the median of the other ranks' times in that
phase (``join``, ``plan`` and ``wait_ranks`` are waits, left out). A ratio ("x
median": the phase's time over the other ranks' median) is given only against a
baseline no shorter than the least delay counted; against a shorter one (a data
phase of a tenth of a millisecond) it is None.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.analytics._keyed import KeyedResult
from ckptfmt.analytics.explain import explain as explain_episodes
from ckptfmt.analytics.grids import StepGrid
from ckptfmt.analytics.tables import tables
from ckptfmt.tools.formatting import step_range

#: Phases of a collective save that are waits for other ranks, not a rank's own work.
SAVE_WAITS = frozenset({"join", "plan", "wait_ranks"})
#: The upper quartile of a Gaussian's absolute values, in standard deviations (their median is 1 / 1.4826).
_UPPER_QUARTILE_SD = 1.1503


@dataclass(frozen=True)
class Thresholds:
    """When a rank's lateness counts as a delay (see the module docstring)."""

    #: Times the boundary's (or save phase's) noise, its robust spread over the run.
    k: float = 4.5
    #: Share of the median step duration at that step (of the median save, for save phases).
    step_share: float = 0.05
    #: Seconds, whatever the noise.
    floor_s: float = 0.01
    #: Steps without a delay that an episode bridges.
    episode_gap: int = 2
    #: An episode spanning this share of the run's steps, and at least ``persistent_steps``, is persistent.
    persistent: float = 0.25
    persistent_steps: int = 10
    #: Runnable tasks per CPU (a host's 1-minute load over its CPUs, from the system samples) beyond which
    #: ranks wait for a CPU: the noise is then the scheduler's.
    busy_load: float = 1.0


@dataclass(frozen=True)
class Episode:
    """A straggler's run of delayed steps (gaps of up to ``Thresholds.episode_gap`` steps bridged)."""

    first_step: int
    last_step: int
    steps: int  # the delayed steps in it
    delay_s: float  # their delays, summed
    ratio: float | None  # the median of its steps' "x median" (None: every baseline too short to divide by)
    phase: str  # the phase most of its steps were delayed in


@dataclass(frozen=True)
class Straggler:
    """A rank that delayed the others: in which steps, by how much, in which phase."""

    rank: int
    host: str | None
    steps: list[int]  # the delayed steps
    delay_s: float  # its delays, summed
    max_delay_s: float  # its worst step's
    #: Its phase's time over the other ranks' median at its worst step; None where that median is shorter
    #: than the least delay counted.
    ratio: float | None
    phase: str  # the phase most of its steps were delayed in
    kind: str  # "persistent" (an episode spanning ``Thresholds.persistent`` of the run) or "transient"
    episodes: list[Episode]


@dataclass(frozen=True)
class SlowHost:
    """A host with two or more ranks slow in the same steps."""

    host: str | None
    ranks: list[int]  # its ranks that were slow together
    of_ranks: int  # its ranks
    steps: list[int]
    delay_s: float


@dataclass(frozen=True)
class SlowSave:
    """A rank whose own save phases lagged the other ranks'."""

    rank: int
    host: str | None
    checkpoints: list[str]  # one entry per lagging phase: a checkpoint may come more than once
    phases: list[str]  # the phase of each entry of ``checkpoints``
    delay_s: float
    ratio: float | None  # the largest "x median" of its phases; None where no baseline was long enough


@dataclass(frozen=True)
class StragglerReport(KeyedResult):
    """What ``stragglers`` found in one run; ``to_json()`` is ``ckptfmt stragglers --json``'s output.

    ``report["stragglers"]`` (the dict it was) still works, with a DeprecationWarning."""

    steps: int  # the steps recorded (0 without step records)
    ranks: int
    stragglers: list[Straggler]  # the most delay first
    hosts: list[SlowHost]
    slow_saves: list[SlowSave]
    #: With ``explain=True``: each episode's likely causes with their evidence and an action
    #: (analytics/explain.py), as ``{"rank", "host", "first_step", "last_step", "phase", "samples", "causes"}``.
    explanations: list[dict] | None = None

    _returned_by = "stragglers()"

    def to_json(self) -> dict:
        found: dict[str, Any] = {"steps": self.steps, "ranks": self.ranks,
                                 "stragglers": [asdict(s) for s in self.stragglers],
                                 "hosts": [asdict(h) for h in self.hosts],
                                 "slow_saves": [asdict(s) for s in self.slow_saves]}
        if self.explanations is not None:
            found["explanations"] = self.explanations
        return found

    def _as_dict(self) -> dict[str, Any]:
        return self.to_json()


@renamed_arguments(source="repo")
def stragglers(repo: str | os.PathLike | Mapping[str, pa.Table], *, thresholds: Thresholds = Thresholds(),
               storage_options: dict | None = None, explain: bool = False) -> StragglerReport:
    """The straggler report of one run: ``repo`` is its repository's URL or its ``tables()``.

    Returns the stragglers (the ranks that delayed the others, each with its episodes), the hosts where
    several ranks were slow at once, the slow saves, and the steps and ranks judged. ``explain``: also
    each episode's likely causes with their evidence and an action (analytics/explain.py).
    """
    built = repo if isinstance(repo, Mapping) else tables(repo, storage_options=storage_options)
    steps = built["steps"]
    if steps.num_rows:
        delays = step_delays(steps, thresholds, built.get("system"))
        found = StragglerReport(delays.steps.size, delays.ranks.size, _stragglers(delays, thresholds),
                                _hosts(delays), _slow_saves(built["saves"], thresholds))
    else:
        found = StragglerReport(0, 0, [], [], _slow_saves(built["saves"], thresholds))
    if explain:
        found = replace(found, explanations=explain_episodes(built, found.to_json()))
    return found


@dataclass
class Delays:
    """Per (step, rank): the delay found (seconds, 0 where none), in which phase, and how many times the
    other ranks' median that phase took (NaN where that baseline is too short to divide by)."""

    steps: np.ndarray  # the step numbers, sorted
    ranks: np.ndarray  # the ranks, sorted
    hosts: dict[int, str]
    delay_s: np.ndarray  # steps x ranks
    ratio: np.ndarray  # steps x ranks
    phase: np.ndarray  # steps x ranks, object: the phase name, or None


def step_delays(steps: pa.Table, thresholds: Thresholds = Thresholds(), system: pa.Table | None = None) -> Delays:
    """Judge every (step, rank) of a steps table (one run) by when the rank reached each phase's end.

    Phase by phase, in order, with steps x ranks arrays (a run's whole phases x steps x ranks cube would
    be gigabytes): the arrival, the lateness held and gained, and running per (step, rank) the worst
    lateness found a delay and the phase that gained most lateness so far. ``system``: the run's system
    samples, which say where the host was busy (the noise is then the scheduler's)."""
    grid = StepGrid(steps)
    shape = (grid.steps.size, grid.ranks.size)
    delay, ratio, phase = np.zeros(shape), np.ones(shape), np.full(shape, None, dtype=object)
    floor = np.fmax(thresholds.step_share * _nanmedian(grid.values("duration_s"), axis=1), thresholds.floor_s)
    busy = _busy(grid, system, thresholds.busy_load)
    held_on_busy = _busy_held_jitter(grid) if busy.any() else 0.0
    most_gained = np.full(shape, -np.inf)
    gaining_phase, gaining_ratio = np.full(shape, None, dtype=object), np.full(shape, np.nan)
    for name, seconds, gained, held in _lateness(grid):
        # The evidence: lateness gained in the phase and still held at its end (its jitter is the phase's
        # alone), and lateness held at its end however gained (a rank somewhat slow in several phases).
        evidence = (np.minimum(gained, held), held)
        quiet = [_jitter(e) for e in evidence]
        on_busy = [_tail_jitter(evidence[0]), held_on_busy] if busy.any() else quiet
        limits = [np.maximum(thresholds.k * np.where(busy, noisy, jitter), floor[:, None])
                  for jitter, noisy in zip(quiet, on_busy)]
        more = gained > most_gained
        most_gained[more], gaining_phase[more] = gained[more], name
        gaining_ratio[more] = _ratio(seconds, _median_of_others(seconds), np.minimum(*limits))[more]
        worse = ((evidence[0] > limits[0]) | (held > limits[1])) & (held > delay)
        delay[worse], phase[worse], ratio[worse] = held[worse], gaining_phase[worse], gaining_ratio[worse]
    return Delays(grid.steps, grid.ranks, grid.hosts, delay, ratio, phase)


def _lateness(grid: StepGrid) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """Per phase, in order: its name, its seconds, and the lateness gained in it and held at its end (steps
    x ranks): the arrival at its end after the other ranks' median, less what the rank was late at its start."""
    arrival, late_at_start = _aligned_starts(grid)
    held_before = np.zeros(arrival.shape)
    for name in grid.phases():
        seconds = grid.values(f"phase_{name}")
        arrival = arrival + np.nan_to_num(seconds)  # a step without the phase spent no time in it
        held = arrival - _median_of_others(arrival) - late_at_start
        yield name, seconds, held - held_before, held
        held_before = held


def _busy(grid: StepGrid, system: pa.Table | None, load_per_cpu: float) -> np.ndarray:
    """Steps x ranks: whether the rank's host had more than ``load_per_cpu`` runnable tasks per CPU when the
    step ran (its 1-minute load over its CPUs, at the rank's sample nearest the step); False where unsampled."""
    if system is None or system.num_rows == 0:
        return np.zeros((grid.steps.size, grid.ranks.size), dtype=bool)
    with np.errstate(invalid="ignore"):
        return grid.sampled(system, "load_1m") > load_per_cpu * grid.sampled(system, "host_cpus")


def _busy_held_jitter(grid: StepGrid) -> float:
    """The jitter of the lateness held at a phase end on a busy host: the largest of the phase ends' (the
    scheduler's delays are held until the next collective, and one that wakes a rank late from a collective
    to the step's end, where lateness otherwise scatters little), each estimated for a heavy tail."""
    return max((_tail_jitter(held) for _, _, _, held in _lateness(grid)), default=0.0)


def _aligned_starts(grid: StepGrid) -> tuple[np.ndarray, np.ndarray]:
    """Steps x ranks: each step's start on one clock (seconds), and what the rank was late at its start
    after the other ranks' median (0 where early: an early start is no credit)."""
    starts = grid.starts()
    ends = starts + grid.values("duration_s")
    clock_ahead = _nanmedian(ends - _nanmedian(ends, axis=1)[:, None], axis=0)
    starts = starts - np.nan_to_num(clock_ahead)
    return starts, np.maximum(starts - _median_of_others(starts), 0.0)


def _median_of_others(values: np.ndarray) -> np.ndarray:
    """Per value, the median of the other finite values along the last axis (the other ranks at that
    step): with two ranks, the other one. NaN where the value or every other is missing."""
    order = np.argsort(values, axis=-1)  # NaN sorts last
    ordered = np.take_along_axis(values, order, axis=-1)
    position = np.argsort(order, axis=-1)  # each value's place in ``ordered``
    others = np.isfinite(values).sum(axis=-1, keepdims=True) - 1

    def other(j: np.ndarray) -> np.ndarray:  # the j-th smallest of the others: one's own place skipped
        j = np.maximum(j, 0)
        return np.take_along_axis(ordered, np.minimum(j + (j >= position), values.shape[-1] - 1), axis=-1)
    middle = (other((others - 1) // 2) + other(others // 2)) / 2
    return np.where((others > 0) & np.isfinite(values), middle, np.nan)


def _jitter(lateness: np.ndarray) -> float:
    """The robust spread over the run of a steps x ranks lateness, from its changes from one step to the
    next on each rank: 1.4826 x their median absolute value, over the square root of 2. A straggler moves it
    little: a persistent one changes its lateness only where it starts and stops (with two ranks, one slow
    in half the steps would otherwise be half the sample)."""
    return float(np.nan_to_num(1.4826 / np.sqrt(2) * _nanmedian(np.abs(np.diff(lateness, axis=0)), axis=None)))


def _tail_jitter(lateness: np.ndarray) -> float:
    """``_jitter``, or where larger the same from the upper quartile of the changes (over a Gaussian's,
    ``_UPPER_QUARTILE_SD``): still robust to stragglers, in up to a quarter of the changes, and it sees the
    start of a heavy tail, where the median sees only the steps the tail spared."""
    changes = np.abs(np.diff(lateness, axis=0))
    if not np.isfinite(changes).any():
        return 0.0
    return max(_jitter(lateness), float(np.nanquantile(changes, 0.75)) / (_UPPER_QUARTILE_SD * np.sqrt(2)))


def _nanmedian(values: np.ndarray, axis: int | None) -> np.ndarray:
    """``np.nanmedian``: NaN where a slice has no number, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=axis)


def _ratio(values: np.ndarray, baseline: np.ndarray, least: np.ndarray | float) -> np.ndarray:
    """``values`` over ``baseline``, NaN where the baseline is shorter than ``least`` (the least delay that
    counts): a ratio to a time within the jitter (0.1 ms of data loading) says nothing."""
    with np.errstate(all="ignore"):
        return np.where(baseline >= least, values / baseline, np.nan)


def _stragglers(delays: Delays, thresholds: Thresholds) -> list[Straggler]:
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
        found.append(Straggler(
            rank=rank, host=delays.hosts.get(rank),
            steps=delays.steps[rows].tolist(),
            delay_s=float(delays.delay_s[rows, column].sum()),
            max_delay_s=float(delays.delay_s[worst, column]),
            ratio=_finite(delays.ratio[worst, column]),
            phase=max(set(phases), key=phases.count),
            kind="persistent" if longest >= max(thresholds.persistent * delays.steps.size,
                                                thresholds.persistent_steps) else "transient",
            episodes=episodes,
        ))
    return sorted(found, key=lambda s: -s.delay_s)


def _episode(delays: Delays, column: int, rows: np.ndarray) -> Episode:
    phases = delays.phase[rows, column].tolist()
    return Episode(first_step=int(delays.steps[rows[0]]), last_step=int(delays.steps[rows[-1]]),
                   steps=int(rows.size), delay_s=float(delays.delay_s[rows, column].sum()),
                   ratio=_finite(_nanmedian(delays.ratio[rows, column], axis=0)),
                   phase=max(set(phases), key=phases.count))


def episode_ranges(episodes: Sequence[Episode | Mapping[str, Any]]) -> str:
    """A straggler's episodes as text: ``4-7, 12`` (``Straggler.episodes``, or their dicts in ``to_json()``)."""
    spans = ((e.first_step, e.last_step) if isinstance(e, Episode) else (e["first_step"], e["last_step"])
             for e in episodes)
    return ", ".join(step_range(first, last) for first, last in spans)


def _finite(value: float | np.ndarray) -> float | None:
    """A ratio for the report: None where its baseline was too short to divide by (JSON has no NaN)."""
    return float(value) if np.isfinite(value) else None


def _hosts(delays: Delays) -> list[SlowHost]:
    """Hosts with two or more ranks slow in the same steps."""
    slow = delays.delay_s > 0
    by_host: dict[str | None, list[int]] = {}
    for column, rank in enumerate(delays.ranks.tolist()):
        by_host.setdefault(delays.hosts.get(rank), []).append(column)
    found = []
    for host, columns in by_host.items():
        together = slow[:, columns].sum(axis=1) >= 2
        if not together.any():
            continue
        ranks = [int(delays.ranks[c]) for c in columns if slow[together, c].any()]
        found.append(SlowHost(host=host, ranks=ranks, of_ranks=len(columns), steps=delays.steps[together].tolist(),
                              delay_s=float(delays.delay_s[together][:, columns].sum())))
    return sorted(found, key=lambda h: -h.delay_s)


def _slow_saves(saves: pa.Table, thresholds: Thresholds) -> list[SlowSave]:
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
    # As for steps: a share of the checkpoint's median save, at least floor_s.
    floor = np.fmax(thresholds.step_share * _nanmedian(totals, axis=1), thresholds.floor_s)[:, None]
    found: dict[int, dict] = {}
    for phase in sorted({p for p in phase_names.tolist() if isinstance(p, str)} - SAVE_WAITS):
        chosen = phase_names == phase
        values = np.full((len(checkpoints), ranks.size), np.nan)
        values[name_index[chosen], rank_index[chosen]] = durations[chosen]
        baseline = _median_of_others(values)
        excess = values - baseline
        limit = np.maximum(thresholds.k * 1.4826 * _nanmedian(np.abs(excess), axis=None), floor)
        times = _ratio(values, baseline, limit)
        for row, column in zip(*np.nonzero(excess > limit)):
            rank = int(ranks[column])
            entry = found.setdefault(rank, {"rank": rank, "host": hosts.get(rank), "checkpoints": [], "phases": [],
                                            "delay_s": 0.0, "ratio": None})
            entry["checkpoints"].append(checkpoints[row])
            entry["phases"].append(phase)
            entry["delay_s"] += float(excess[row, column])
            ratio = _finite(times[row, column])
            if ratio is not None:
                entry["ratio"] = max(entry["ratio"] or 0.0, ratio)
    return [SlowSave(**entry) for entry in sorted(found.values(), key=lambda e: -e["delay_s"])]
