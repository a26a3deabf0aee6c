"""Why a rank straggled, and what to do: each straggler episode joined with the rank's system samples
(spec 9.4 ``system``) and its save phases (``ckptfmt stragglers --explain``).

For an episode (a rank's run of delayed steps, ``stragglers``) the window is
from the start of its first step to the end of its last, on that rank. Over the
samples the rank took in the window, and the same rank's samples elsewhere in
the run (its baseline), each cause below is weighed; every cause whose evidence
holds is given, the likeliest first, with the evidence in figures and an action:

- **data loading**: the rank spent at least half of these steps' time in its
  ``data`` phase (from its step records: each step's data phase lies within
  the step, so the share is at most 1), or the episode's slow phase is
  ``data``: its input pipeline could not keep up.
- **CPU contention**: the rank's process got at most ``CONTENDED`` of the CPU
  time it gets elsewhere in the run while it computed (the slow phase is not
  ``data``), or its involuntary context switches per second rose ``SWITCHES``-fold:
  something else ran on its CPUs. When its host was busy on nearly all CPUs and
  processes other than the job's ranks held at least half a CPU, the host was
  saturated by other processes.
- **memory pressure**: the host had less than ``MEMORY_FREE`` of its memory
  available during the window.
- **GPU throttled**: NVML reported a clock event reason other than idle or
  application clocks (power cap, thermal or hardware slowdown), a temperature of
  ``HOT_C`` or more, or an SM clock at most ``CLOCK_DROP`` of the rank's usual.
- **storage I/O during a save**: the window overlaps one of the rank's save
  phases, or the process wrote ``WRITE_FOLD`` times its usual bytes per second.

An episode none of these explain is reported as such (with how densely it was
sampled): the rank's own work in that phase was slower, for a reason the
samples do not show.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

#: A process getting at most this share of its usual CPU rate while it computes is contended.
CONTENDED = 0.7
#: Involuntary context switches per second rising this many times over the rank's usual mean contention.
SWITCHES = 3.0
#: Busy share of a host's CPUs from which it counts as saturated.
SATURATED = 0.9
#: Host memory available under this share of its total is memory pressure.
MEMORY_FREE = 0.05
#: GPU temperature (Celsius) from which it counts as hot; SM clock at most this share of its usual: throttled.
HOT_C = 85.0
CLOCK_DROP = 0.85
#: Disk bytes written per second this many times the rank's usual: storage I/O.
WRITE_FOLD = 10.0
#: NVML clock event reasons that are no slowdown: the GPU is idle, or runs at the application's clocks.
_BENIGN_REASONS = 0x1 | 0x2


def explain(built: Mapping[str, pa.Table], found: dict) -> list[dict]:
    """Each straggler episode of ``found`` (``stragglers()``'s report over the tables ``built``) with its
    causes: ``{"rank", "host", "first_step", "last_step", "phase", "samples", "causes": [{"cause",
    "evidence", "action"}]}``."""
    steps, system, saves = built["steps"], built["system"], built["saves"]
    samples = _Samples(system)
    windows = _StepWindows(steps)
    hosts = _host_ranks(steps)
    explained = []
    for straggler in found["stragglers"]:
        rank, host = straggler["rank"], straggler["host"]
        for episode in straggler["episodes"]:
            first, last = episode["first_step"], episode["last_step"]
            start, end = windows.span(rank, first, last)
            inside, outside = samples.split(rank, start, end)
            causes = _causes(rank, host, episode["phase"], start, end, inside, outside, samples,
                             hosts.get(host, [rank]), saves, windows.data_share(rank, first, last))
            explained.append({"rank": rank, "host": host, "first_step": episode["first_step"],
                              "last_step": episode["last_step"], "phase": episode["phase"],
                              "samples": int(inside.size), "causes": causes})
    return explained


class _Samples:
    """One run's system samples by rank, as numpy columns sorted by time."""

    def __init__(self, system: pa.Table):
        self.by_rank: dict[int, dict[str, np.ndarray]] = {}
        if system.num_rows == 0:
            return
        ranks = system.column("rank").to_numpy(zero_copy_only=False)
        times = system.column("time").cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6  # seconds
        fields = [name for name in system.column_names if name not in ("run", "checkpoint", "rank", "host", "time")]
        columns = {name: system.column(name).to_numpy(zero_copy_only=False).astype(float) for name in fields}
        for rank in np.unique(ranks).tolist():
            chosen = ranks == rank
            order = np.argsort(times[chosen])
            self.by_rank[rank] = {"time": times[chosen][order],
                                  **{name: values[chosen][order] for name, values in columns.items()}}

    def split(self, rank: int, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Indices of the rank's samples within [start, end] (and the one just after: counters read at a
        sample cover the time since the previous one), and of the others."""
        columns = self.by_rank.get(rank)
        if columns is None:
            return np.array([], int), np.array([], int)
        times = columns["time"]
        inside = np.nonzero((times >= start) & (times <= end))[0]
        after = np.searchsorted(times, end, side="right")
        if after < times.size:
            inside = np.append(inside, after)
        return inside, np.setdiff1d(np.arange(times.size), inside)

    def rate(self, rank: int, field: str, rows: np.ndarray) -> float | None:
        """A cumulative field's mean rate per second over the intervals ending at ``rows``."""
        columns = self.by_rank.get(rank)
        if columns is None or field not in columns:
            return None
        rows = rows[rows > 0]
        if rows.size == 0:
            return None
        delta = columns[field][rows] - columns[field][rows - 1]
        span = columns["time"][rows] - columns["time"][rows - 1]
        usable = np.isfinite(delta) & (span > 0)
        return float(delta[usable].sum() / span[usable].sum()) if usable.any() and span[usable].sum() > 0 else None

    def mean(self, rank: int, field: str, rows: np.ndarray, reduce=np.nanmean) -> float | None:
        columns = self.by_rank.get(rank)
        if columns is None or field not in columns or rows.size == 0:
            return None
        values = columns[field][rows]
        return float(reduce(values)) if np.isfinite(values).any() else None


class _StepWindows:
    """Per rank, each step's number, start (seconds since the epoch), duration and seconds in its ``data``
    phase (NaN where it recorded none), from the steps table."""

    def __init__(self, steps: pa.Table):
        ranks = steps.column("rank").to_numpy(zero_copy_only=False)
        columns = np.stack([
            steps.column("step").to_numpy(zero_copy_only=False).astype(float),
            steps.column("start").cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6,
            steps.column("duration_s").to_numpy(zero_copy_only=False).astype(float),
            (steps.column("phase_data").to_numpy(zero_copy_only=False).astype(float)
             if "phase_data" in steps.column_names else np.full(steps.num_rows, np.nan))], axis=1)
        self.by_rank = {rank: columns[ranks == rank] for rank in np.unique(ranks).tolist()}

    def _chosen(self, rank: int, first: int, last: int) -> np.ndarray:
        """The rank's steps ``first`` to ``last``: rows of (step, start, duration, data)."""
        rows = self.by_rank[rank]
        return rows[(rows[:, 0] >= first) & (rows[:, 0] <= last)]

    def span(self, rank: int, first: int, last: int) -> tuple[float, float]:
        """From the start of the rank's first step to the end of its last."""
        chosen = self._chosen(rank, first, last)
        return float(chosen[:, 1].min()), float((chosen[:, 1] + chosen[:, 2]).max())

    def data_share(self, rank: int, first: int, last: int) -> float | None:
        """The share of these steps' time the rank spent in its ``data`` phase, None where none recorded one.

        Both come from the step records, timed by one clock around the same work, so the share is at most 1.
        The samples' data wait cannot give it: that counter grows by a step's whole data phase when the step
        ends, so a sample interval can hold data time spent before it began (over 100% of the interval)."""
        chosen = self._chosen(rank, first, last)
        if not np.isfinite(chosen[:, 3]).any() or chosen[:, 2].sum() <= 0:
            return None
        return float(np.nansum(chosen[:, 3]) / chosen[:, 2].sum())  # a step without the phase spent no time in it


def _host_ranks(steps: pa.Table) -> dict[str, list[int]]:
    hosts: dict[str, set[int]] = {}
    for rank, host in zip(steps.column("rank").to_pylist(), steps.column("host").to_pylist()):
        hosts.setdefault(host, set()).add(rank)
    return {host: sorted(ranks) for host, ranks in hosts.items()}


def _causes(rank: int, host: str, phase: str, start: float, end: float, inside: np.ndarray, outside: np.ndarray,
            samples: _Samples, neighbours: list[int], saves: pa.Table, waited: float | None) -> list[dict]:
    """The episode's causes, likeliest first; ``waited``: the share of its steps' time spent in ``data``."""
    where = f"rank {rank}"
    weighed = [_data_loading(where, phase, waited),
               _cpu_contention(rank, host, phase, start, end, inside, outside, samples, neighbours),
               _memory_pressure(rank, host, inside, samples),
               _gpu_throttled(rank, host, inside, outside, samples),
               _storage_io(rank, start, end, inside, outside, samples, saves)]
    causes = [cause for cause in weighed if cause is not None]
    if not causes:
        sampled = "no system sample" if inside.size == 0 else f"{inside.size} system samples"
        return [{"cause": "unexplained", "evidence": f"{sampled} in these steps show none of the known causes",
                 "action": f"profile {where}'s {phase} phase"}]
    return [cause for _, cause in sorted(causes, key=lambda c: -c[0])]


def _data_loading(where: str, phase: str, waited: float | None) -> tuple[float, dict] | None:
    """Data loading: the share of the steps' time spent waiting for data."""
    if phase == "data" or (waited is not None and waited >= 0.5):
        waiting = (f"{where} waited for its data {waited:.0%} of the time in these steps" if waited is not None
                   else f"{where} was slowest in its data phase in these steps")
        return (waited or 0.5, {
            "cause": "data loading", "evidence": waiting,
            "action": f"give {where}'s data loader more workers (num_workers), prefetch or pin memory, and check "
                      "the storage it reads from"})
    return None


def _cpu_contention(rank: int, host: str, phase: str, start: float, end: float, inside: np.ndarray,
                    outside: np.ndarray, samples: _Samples, neighbours: list[int]) -> tuple[float, dict] | None:
    """CPU contention: the process got less CPU than usual while it computed, or was switched out more."""
    where = f"rank {rank}"
    cpu_in = _sum(samples.rate(rank, "cpu_user_s", inside), samples.rate(rank, "cpu_system_s", inside))
    cpu_out = _sum(samples.rate(rank, "cpu_user_s", outside), samples.rate(rank, "cpu_system_s", outside))
    switches_in = samples.rate(rank, "ctx_involuntary", inside)
    switches_out = samples.rate(rank, "ctx_involuntary", outside)
    starved = phase != "data" and cpu_in is not None and cpu_out and cpu_in <= CONTENDED * cpu_out
    switched = switches_in is not None and switches_out is not None and switches_in >= SWITCHES * max(switches_out, 1.0)
    if not (starved or switched):
        return None
    evidence = []
    if cpu_in is not None and cpu_out:
        evidence.append(f"its process got {cpu_in:.2f} CPUs against {cpu_out:.2f} elsewhere in the run")
    if switches_in is not None:
        evidence.append(f"{switches_in:.0f} involuntary context switches a second (usually "
                        f"{switches_out or 0:.0f})")
    busy, cpus = samples.mean(rank, "host_cpu_busy", inside), samples.mean(rank, "host_cpus", inside)
    others = None
    if busy is not None and cpus:  # the host's busy CPUs less what the job's ranks on it used
        job = 0.0
        for neighbour in neighbours:
            window = samples.split(neighbour, start, end)[0]
            job += _sum(samples.rate(neighbour, "cpu_user_s", window),
                        samples.rate(neighbour, "cpu_system_s", window)) or 0.0
        others = busy * cpus - job
    saturated = others is not None and busy is not None and busy >= SATURATED and others >= 0.5
    if saturated:
        evidence.append(f"host {host} was busy on {busy:.0%} of its {cpus:.0f} CPUs, {others:.1f} of them not "
                        "this job's ranks")
    return (1.0 + (1 - cpu_in / cpu_out if starved and cpu_in is not None and cpu_out else 0.0), {
        "cause": "host saturated by other processes" if saturated else "CPU contention",
        "evidence": "; ".join(evidence),
        "action": (f"drain or exclude host {host}, or stop what else runs on it" if saturated else
                   f"give {where} CPUs of its own (pin it, and keep other work off its cores)")})


def _memory_pressure(rank: int, host: str, inside: np.ndarray, samples: _Samples) -> tuple[float, dict] | None:
    """Memory pressure on the host."""
    available = samples.mean(rank, "host_mem_available_bytes", inside, np.nanmin)
    total = samples.mean(rank, "host_mem_total_bytes", inside)
    if available is not None and total and available / total < MEMORY_FREE:
        return (1.0, {
            "cause": "memory pressure", "evidence": f"host {host} had {available / total:.1%} of its memory available",
            "action": f"free memory on host {host} (other processes, page cache pressure) or give the job more"})
    return None


def _gpu_throttled(rank: int, host: str, inside: np.ndarray, outside: np.ndarray,
                   samples: _Samples) -> tuple[float, dict] | None:
    """A throttled or hot GPU."""
    gpu = _gpu_evidence(samples, rank, inside, outside)
    if gpu:
        return (1.0, {"cause": "GPU throttled", "evidence": "; ".join(gpu),
                      "action": f"check the cooling and power of rank {rank}'s GPU on host {host}; drain the "
                                "host if it persists"})
    return None


def _storage_io(rank: int, start: float, end: float, inside: np.ndarray, outside: np.ndarray, samples: _Samples,
                saves: pa.Table) -> tuple[float, dict] | None:
    """Storage I/O: a save of this rank during the window, or far more bytes written than usual."""
    span = end - start
    saving = _save_overlap(saves, rank, start, end)
    written_in, written_out = samples.rate(rank, "disk_write_bytes", inside), samples.rate(rank, "disk_write_bytes",
                                                                                           outside)
    heavy = written_in is not None and written_in > WRITE_FOLD * max(written_out or 0.0, 1e6)
    if saving or heavy:
        evidence = [f"it was saving ({saving:.2f} s of save phases in these {span:.2f} s)"] if saving else []
        if written_in is not None:
            evidence.append(f"it wrote {written_in / 1e6:.0f} MB/s (usually {(written_out or 0) / 1e6:.0f})")
        return (0.9, {"cause": "storage I/O during a save", "evidence": "; ".join(evidence),
                      "action": "save to a fast local tier first (CheckpointManager tiers), save "
                                "asynchronously (async_save), or save less often (ckptfmt advise)"})
    return None


def _sum(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _gpu_evidence(samples: _Samples, rank: int, inside: np.ndarray, outside: np.ndarray) -> list[str]:
    evidence = []
    columns = samples.by_rank.get(rank, {})
    reasons = columns.get("gpu_throttle_reasons")
    if reasons is not None and inside.size:
        slow = [int(r) & ~_BENIGN_REASONS for r in reasons[inside] if np.isfinite(r)]
        if any(slow):
            evidence.append(f"NVML clock event reasons {max(slow):#x} (power cap, thermal or hardware slowdown)")
    hottest = samples.mean(rank, "gpu_temperature_c", inside, np.nanmax)
    if hottest is not None and hottest >= HOT_C:
        evidence.append(f"GPU at {hottest:.0f} C")
    clock_in, clock_out = (samples.mean(rank, "gpu_sm_clock_mhz", inside),
                           samples.mean(rank, "gpu_sm_clock_mhz", outside, np.nanmedian))
    if clock_in is not None and clock_out and clock_in <= CLOCK_DROP * clock_out:
        evidence.append(f"SM clock {clock_in:.0f} MHz against {clock_out:.0f} MHz elsewhere")
    return evidence


def _save_overlap(saves: pa.Table, rank: int, start: float, end: float) -> float:
    """Seconds of the rank's save phases within [start, end]."""
    if saves.num_rows == 0:
        return 0.0
    ranks = saves.column("rank").to_numpy(zero_copy_only=False)
    starts = saves.column("start").cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6
    durations = saves.column("duration_s").to_numpy(zero_copy_only=False)
    chosen = ranks == rank
    overlap = np.minimum(starts[chosen] + durations[chosen], end) - np.maximum(starts[chosen], start)
    return float(np.clip(overlap, 0, None).sum())
