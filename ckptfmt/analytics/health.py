"""Training health from a run's checkpoints: where values went bad, which layers moved oddly, what never
moved, what is mostly zeros, where the loss spiked (``ckptfmt health``).

Read from manifests alone (the ``tensor_stats``, ``tensors``, ``steps`` and
``checkpoints`` tables), except ``deep=True``, which reads the tensors whose
chunks changed between consecutive checkpoints to measure how far each moved.

- **NaN and infinities**: the first checkpoint in which a tensor's statistics
  (spec 6.10) count a NaN or an infinite element, and every tensor that does.
- **Norms per group**: a group is a layer (a key up to its last numeric part,
  ``model/layers.3``), an optimizer moment (``optim exp_avg``: every
  ``.../exp_avg`` of the optimizer state), or else the key's parent. A group's
  norm is the root of its tensors' summed squared ``l2``.
- **Jumps**: a group's norm jumps at a checkpoint when its log change from the
  previous checkpoint lies more than ``JUMP_MADS`` median absolute deviations
  from the median log change of that group over the run, and the norm changed by
  at least ``JUMP_FACTOR`` either way. Growth at a steady pace is a trend, not a
  jump; one checkpoint where a layer's norm suddenly doubles is one.
- **Unchanged**: tensors whose chunk hashes are the same in every checkpoint of
  the run that holds them (two at least): frozen, or dead (no gradient reaches them).
- **Mostly zeros**: tensors whose share of exact zeros is at least ``zeros_share``
  in the last checkpoint holding them (dead units, pruned weights, masks).
- **Metric spikes**: a recorded metric (``loss``) whose value at a step is NaN or
  lies more than ``SPIKE_MADS`` median absolute deviations above the median of the
  ``SPIKE_WINDOW`` steps before it, placed between the checkpoints around it.
- **Updates** (``deep``): ``||W_t - W_prev|| / ||W_t||`` per tensor between
  consecutive checkpoints, reading only tensors whose chunks differ, a block of
  rows at a time (memory bounded by ``UPDATE_BLOCK_BYTES`` per tensor pair).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import torch

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.analytics.tables import tables
from ckptfmt.loading.reader import open as open_checkpoint

#: A norm's log change further than this many median absolute deviations from its group's median is a jump.
JUMP_MADS = 6.0
#: ... and only if the norm changed by at least this factor, up or down.
JUMP_FACTOR = 1.5
#: A metric value this many median absolute deviations above the median of the steps before it is a spike.
SPIKE_MADS = 8.0
SPIKE_WINDOW = 20
#: Rows of two tensors held at once by the deep update measure, at most (each tensor's share).
UPDATE_BLOCK_BYTES = 64 * 2**20
#: Optimizer state entries that are per-parameter moments, grouped across parameters by name.
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")
_NUMBER = re.compile(r"^\d+$")


@dataclass
class HealthReport:
    """What ``health`` found in one run (see the module's docstring for each rule)."""

    run: str
    checkpoints: list[dict]  # {"name", "step"} in commit order
    #: {"checkpoint", "step", "tensors": [{"key", "nan", "posinf", "neginf"}]} for the first checkpoint with
    #: non-finite values; None when none has any.
    first_non_finite: dict | None
    #: Checkpoints holding non-finite values: {"checkpoint", "step", "tensors": count}.
    non_finite: list[dict]
    #: group -> its norm at each checkpoint (None where it holds none of the group's tensors).
    group_norms: dict[str, list[float | None]]
    jumps: list[dict]  # {"group", "checkpoint", "step", "norm", "previous", "factor"}
    unchanged: list[dict]  # {"key", "since", "checkpoints", "evidence": "chunks" or "statistics"}
    mostly_zeros: list[dict]  # {"key", "checkpoint", "zeros", "count", "share"}
    #: {"metric", "first_step", "last_step", "peak", "non_finite", "baseline", "after", "before"}: consecutive
    #: spiking steps are one episode; ``after`` and ``before`` are the checkpoints around it.
    metric_spikes: list[dict]
    #: deep only, per changed tensor and consecutive pair: {"key", "group", "checkpoint", "previous",
    #: "moved_l2" (||W_t - W_prev||), "l2" (||W_t||), "ratio" (their quotient, None where ||W_t|| is 0)}.
    updates: list[dict] | None = None
    rules: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.first_non_finite is None and not self.jumps and not self.metric_spikes

    def to_json(self) -> dict:
        return {**asdict(self), "healthy": self.healthy}


def group_of(key: str) -> str:
    """The tensor group of a key: an optimizer moment across parameters, a layer, or the key's parent."""
    parts = [part for part in re.split(r"[/.]", key) if part]
    if len(parts) > 1 and parts[-1] in MOMENTS:
        return f"{parts[0]} {parts[-1]}"
    numbered = [index for index, part in enumerate(parts) if _NUMBER.match(part)]
    if numbered and numbered[-1] < len(parts) - 1:
        return ".".join(parts[:numbered[-1] + 1])
    return ".".join(parts[:-1]) or key


@renamed_arguments(run="repo")
def health(repo: str | os.PathLike, *, deep: bool = False, zeros_share: float = 0.5,
           storage_options: dict | None = None, built: dict[str, pa.Table] | None = None) -> HealthReport:
    """The health of the run in repository ``repo`` (a URL) from its checkpoints; ``deep``: also measure
    how far each tensor moved between consecutive checkpoints (reads the tensors whose chunks changed).
    ``built``: the run's analytics tables, when the caller has them already."""
    if not 0 < zeros_share <= 1:
        raise ValueError("zeros_share must be in (0, 1]")
    run = os.fspath(repo)
    if built is None:
        built = tables(run, storage_options=storage_options)
    listed = built["checkpoints"]
    checkpoints = [{"name": name, "step": step}
                   for name, step in zip(listed.column("name").to_pylist(), listed.column("step").to_pylist())]
    order = {c["name"]: index for index, c in enumerate(checkpoints)}
    stats = built["tensor_stats"].to_pylist()
    first, non_finite = _non_finite(stats, checkpoints, order)
    norms = _group_norms(stats, len(checkpoints), order)
    report = HealthReport(
        run=run, checkpoints=checkpoints, first_non_finite=first, non_finite=non_finite, group_norms=norms,
        jumps=_jumps(norms, checkpoints), unchanged=_unchanged(built["tensors"], stats, order),
        mostly_zeros=_mostly_zeros(stats, zeros_share), metric_spikes=_spikes(built["steps"], checkpoints),
        rules={"jump_mads": JUMP_MADS, "jump_factor": JUMP_FACTOR, "spike_mads": SPIKE_MADS,
               "spike_window": SPIKE_WINDOW, "zeros_share": zeros_share},
    )
    if deep:
        report.updates = _updates(run, built["tensors"], checkpoints, storage_options)
    return report


# -- from the statistics -------------------------------------------------------------------------
def _non_finite(stats: list[dict], checkpoints: list[dict], order: dict[str, int]) -> tuple[dict | None, list[dict]]:
    bad: dict[str, list[dict]] = {}
    for row in stats:
        counts = {name: row[name] or 0 for name in ("nan", "posinf", "neginf")}
        if any(counts.values()):
            bad.setdefault(row["name"], []).append({"key": row["key"], **counts})
    found = sorted(bad, key=order.__getitem__)
    timeline = [{"checkpoint": name, "step": checkpoints[order[name]]["step"], "tensors": len(bad[name])}
                for name in found]
    if not found:
        return None, timeline
    return {"checkpoint": found[0], "step": checkpoints[order[found[0]]]["step"], "tensors": bad[found[0]]}, timeline


def _group_norms(stats: list[dict], count: int, order: dict[str, int]) -> dict[str, list[float | None]]:
    squares: dict[str, list[float | None]] = {}
    for row in stats:
        if row["l2"] is None or not math.isfinite(row["l2"]) or row["count"] <= 1:  # scalars are counters
            continue
        column = squares.setdefault(group_of(row["key"]), [None] * count)
        index = order[row["name"]]
        column[index] = (column[index] or 0.0) + row["l2"] ** 2
    return {group: [None if v is None else math.sqrt(v) for v in values] for group, values in sorted(squares.items())}


def _jumps(norms: dict[str, list[float | None]], checkpoints: list[dict]) -> list[dict]:
    jumps = []
    for group, values in norms.items():
        pairs = [(index, previous, value) for index, (previous, value) in enumerate(zip(values, values[1:]), 1)
                 if previous and value]  # both present and non-zero
        if len(pairs) < 3:
            continue
        changes = np.array([math.log(value / previous) for _, previous, value in pairs])
        center = float(np.median(changes))
        spread = float(np.median(np.abs(changes - center))) or 1e-12
        for (index, previous, value), change in zip(pairs, changes):
            if abs(change - center) > JUMP_MADS * spread and abs(change) >= math.log(JUMP_FACTOR):
                jumps.append({"group": group, "checkpoint": checkpoints[index]["name"],
                              "step": checkpoints[index]["step"], "norm": value, "previous": previous,
                              "factor": value / previous})
    return sorted(jumps, key=lambda j: (j["checkpoint"], -abs(math.log(j["factor"]))))


def _mostly_zeros(stats: list[dict], share: float) -> list[dict]:
    last: dict[str, dict] = {}
    for row in stats:  # commit order: the last row of a key is its latest checkpoint
        last[row["key"]] = row
    found = [{"key": key, "checkpoint": row["name"], "zeros": row["zeros"], "count": row["count"],
              "share": row["zeros"] / row["count"]}
             for key, row in last.items() if row["count"] and row["zeros"] is not None
             and row["zeros"] / row["count"] >= share]
    return sorted(found, key=lambda f: (-f["share"], f["key"]))


# -- from the chunk hashes --------------------------------------------------------------------------
def _unchanged(tensors: pa.Table, stats: list[dict], order: dict[str, int]) -> list[dict]:
    """Tensors the same in every checkpoint holding them (two at least): by their chunk hashes, or, for
    small tensors packed with others (a pack's hash changes with its neighbours), by statistics equal
    to the last bit in every field."""
    names = {index: name for name, index in order.items()}
    chunks: dict[str, list[tuple[int, tuple]]] = {}
    for name, key, listed, same_as in zip(*(tensors.column(c).to_pylist()
                                            for c in ("name", "key", "chunks", "same_as"))):
        if same_as is None:
            chunks.setdefault(key, []).append((order[name], tuple(listed)))
    figures: dict[str, set[tuple]] = {}
    for row in stats:
        figures.setdefault(row["key"], set()).add(tuple(row[f] for f in _FIGURES))
    found = []
    for key, held in chunks.items():
        if len(held) < 2 or not held[0][1]:
            continue
        if len({listed for _, listed in held}) == 1:
            evidence = "chunks"
        elif len(figures.get(key, ())) == 1 and next(iter(figures[key]))[0] > 1:
            evidence = "statistics"
        else:
            continue
        found.append({"key": key, "since": names[held[0][0]], "checkpoints": len(held), "evidence": evidence})
    return sorted(found, key=lambda f: f["key"])


_FIGURES = ("count", "min", "max", "mean", "l2", "absmax", "nan", "posinf", "neginf", "zeros")


# -- from the steps ---------------------------------------------------------------------------------
def _spikes(steps: pa.Table, checkpoints: list[dict]) -> list[dict]:
    """Each metric's spikes, consecutive spiking steps as one episode."""
    if steps.num_rows == 0:
        return []
    step_column = steps.column("step").to_numpy()
    found = []
    for name in (n for n in steps.column_names if n.startswith("metric_")):
        column = steps.column(name)
        values = column.to_numpy(zero_copy_only=False).astype(float)
        recorded = ~column.is_null().to_numpy(zero_copy_only=False)
        by_step: dict[int, list[float]] = {}
        for step, value in zip(step_column[recorded].tolist(), values[recorded].tolist()):
            by_step.setdefault(step, []).append(value)
        ordered = sorted(by_step)
        # A step's value: the ranks' mean; NaN when a rank recorded NaN (a diverged loss is a value).
        series = np.array([math.nan if any(math.isnan(v) for v in by_step[s]) else float(np.mean(by_step[s]))
                           for s in ordered])
        episode: dict | None = None
        for position, step in enumerate(ordered):
            value = series[position]
            window = series[max(0, position - SPIKE_WINDOW):position]
            window = window[np.isfinite(window)]
            center = float(np.median(window)) if window.size else None
            spiking = math.isnan(value)
            if not spiking and center is not None and window.size >= 5:
                spread = float(np.median(np.abs(window - center))) or 1e-12 * max(abs(center), 1.0)
                spiking = value - center > SPIKE_MADS * spread
            if not spiking:
                episode = None
                continue
            if episode is None:
                episode = _spike(name.removeprefix("metric_"), step, center, checkpoints)
                found.append(episode)
            episode["last_step"] = step
            episode["before"] = _checkpoint_from(step, checkpoints)
            if math.isnan(value):
                episode["non_finite"] = True
            elif episode["peak"] is None or value > episode["peak"]:
                episode["peak"] = float(value)
    return found


def _spike(metric: str, step: int, baseline: float | None, checkpoints: list[dict]) -> dict:
    """An episode starting at ``step``, placed after the last checkpoint before it."""
    after = [c["name"] for c in checkpoints if c["step"] is not None and c["step"] < step]
    return {"metric": metric, "first_step": step, "last_step": step, "peak": None, "non_finite": False,
            "baseline": baseline, "after": after[-1] if after else None, "before": _checkpoint_from(step, checkpoints)}


def _checkpoint_from(step: int, checkpoints: list[dict]) -> str | None:
    """The first checkpoint at or after ``step``: the first that holds the state after it."""
    return next((c["name"] for c in checkpoints if c["step"] is not None and c["step"] >= step), None)


# -- deep: how far each tensor moved ------------------------------------------------------------------
def _updates(run: str, tensors: pa.Table, checkpoints: list[dict], storage_options: dict | None) -> list[dict]:
    rows = tensors.to_pylist()
    by_checkpoint: dict[str, dict[str, dict]] = {}
    for row in rows:
        if row["same_as"] is None:
            by_checkpoint.setdefault(row["name"], {})[row["key"]] = row
    found = []
    for previous, current in zip(checkpoints, checkpoints[1:]):
        before, after = by_checkpoint.get(previous["name"], {}), by_checkpoint.get(current["name"], {})
        changed = [key for key, row in after.items() if key in before and row["chunks"] != before[key]["chunks"]
                   and row["shape"] == before[key]["shape"] and row["dtype"] == before[key]["dtype"]
                   and _is_float(row["dtype"]) and math.prod(row["shape"]) > 1]  # scalars are counters
        if not changed:
            continue
        with open_checkpoint(f"{run.rstrip('/')}/{previous['name']}", storage_options=storage_options) as old, \
                open_checkpoint(f"{run.rstrip('/')}/{current['name']}", storage_options=storage_options) as new:
            for key in changed:
                moved, norm = _movement(old, new, key, after[key]["shape"])
                found.append({"key": key, "group": group_of(key), "checkpoint": current["name"],
                              "previous": previous["name"], "moved_l2": moved, "l2": norm,
                              "ratio": moved / norm if norm and math.isfinite(moved) and math.isfinite(norm)
                              else None})
    return found


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _movement(old, new, key: str, shape: list[int]) -> tuple[float, float]:
    """(||new - old||, ||new||) over row blocks read from both checkpoints (verified reads, bounded memory)."""
    if not shape:
        a, b = old.get_tensor(key).double(), new.get_tensor(key).double()
        return abs(float(b - a)), abs(float(b))
    row_elements = math.prod(shape[1:])
    rows = max(1, UPDATE_BLOCK_BYTES // max(1, row_elements * 8))
    difference = total = 0.0
    for start in range(0, shape[0], rows):
        count = min(rows, shape[0] - start)
        offsets, box = (start, *(0,) * (len(shape) - 1)), (count, *shape[1:])
        a = old.read_box(key, offsets, box).to(torch.float64)
        b = new.read_box(key, offsets, box).to(torch.float64)
        difference += float((b - a).square().sum())
        total += float(b.square().sum())
    return math.sqrt(difference), math.sqrt(total)
