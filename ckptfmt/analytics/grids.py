"""Tables as arrays: a steps table's columns as steps x ranks, a saves table as checkpoints x phases.

The straggler analysis, the report's figures and the TUI's run screen all look
at a run this way; they share these two views instead of each rebuilding them.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class StepGrid:
    """A steps table (one run) indexed by step and rank: ``values(column)`` is a steps x ranks array,
    NaN where a rank recorded no such step; a step recorded twice (a resumed run) keeps the last."""

    def __init__(self, steps: pa.Table):
        step_numbers = np.asarray(steps.column("step").to_numpy(zero_copy_only=False), dtype=np.int64)
        rank_numbers = np.asarray(steps.column("rank").to_numpy(zero_copy_only=False), dtype=np.int64)
        self.steps, self._rows = np.unique(step_numbers, return_inverse=True)
        self.ranks, self._columns = np.unique(rank_numbers, return_inverse=True)
        self.hosts: dict[int, str] = dict(zip(rank_numbers.tolist(), steps.column("host").to_pylist()))
        self._table = steps

    def values(self, column: str) -> np.ndarray:
        grid = np.full((self.steps.size, self.ranks.size), np.nan)
        grid[self._rows, self._columns] = self._table.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
        return grid

    def phases(self) -> list[str]:
        """The phase names, in the order the timer first recorded them (the steps table keeps it)."""
        return [c[len("phase_"):] for c in self._table.column_names if c.startswith("phase_")]

    def starts(self) -> np.ndarray:
        """When each step started on each rank: seconds after the run's first start, on that rank's clock."""
        microseconds = self._table.column("start").cast(pa.int64()).to_numpy(zero_copy_only=False)
        grid = np.full((self.steps.size, self.ranks.size), np.nan)
        grid[self._rows, self._columns] = (microseconds - microseconds.min()) / 1e6
        return grid

    def sampled(self, system: pa.Table, column: str) -> np.ndarray:
        """Steps x ranks: ``column`` of a system table (spec 9.4 samples) as the rank sampled it nearest its step's
        start; NaN where the rank took no sample, or the table has no such column."""
        grid = np.full((self.steps.size, self.ranks.size), np.nan)
        if column not in system.column_names:
            return grid
        sample_ranks = system.column("rank").to_numpy(zero_copy_only=False)
        sample_times = system.column("time").cast(pa.int64()).to_numpy(zero_copy_only=False)
        values = system.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
        starts = self._table.column("start").cast(pa.int64()).to_numpy(zero_copy_only=False)
        for column_index in np.unique(self._columns):
            mine = sample_ranks == self.ranks[column_index]
            if not mine.any():
                continue
            order = np.argsort(sample_times[mine])
            times, own = sample_times[mine][order], values[mine][order]
            rows = np.nonzero(self._columns == column_index)[0]
            after = np.minimum(np.searchsorted(times, starts[rows]), times.size - 1)
            before = np.maximum(after - 1, 0)
            nearer = np.abs(times[before] - starts[rows]) <= np.abs(times[after] - starts[rows])
            grid[self._rows[rows], column_index] = own[np.where(nearer, before, after)]
        return grid


def slowest_save_phases(saves: pa.Table) -> tuple[list[str], list[str], np.ndarray]:
    """(checkpoint names, phase names, phases x checkpoints array): the slowest rank's seconds in each
    phase of each checkpoint's save, in the order they first appear."""
    rows = saves.select(["name", "phase", "duration_s"]).to_pylist()
    names = list(dict.fromkeys(r["name"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    name_index, phase_index = {n: i for i, n in enumerate(names)}, {p: i for i, p in enumerate(phases)}
    slowest = np.zeros((len(phases), len(names)))
    for r in rows:
        i, j = phase_index[r["phase"]], name_index[r["name"]]
        slowest[i, j] = max(slowest[i, j], r["duration_s"] or 0.0)
    return names, phases, slowest
