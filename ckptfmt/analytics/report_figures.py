"""The figures of a run's report (``ckptfmt.analytics.report``), drawn off-screen with matplotlib: step
time per rank over steps with the stragglers marked, the delay each rank added, save phases per
checkpoint, checkpoint size and new bytes over time, metrics over steps (both runs' with a second run),
and with a second run, the tensors that differ per checkpoint and tensor group, each tensor group's norm
over checkpoints, the tensors holding NaN or Inf per checkpoint and (``deep``) each group's relative
update. A figure with nothing to draw is ``Omitted``, with the reason the page gives in its place. Text
in the figures is SVG text (``svg``: selectable, found by the browser's search); artists a reader or a
test looks for carry ids (``straggler-marks``, ``metric-<name>-A``, ``divergence-cells``,
``divergence-value-<row>-<column>``).
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: figures are files
import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.ticker import MaxNLocator

from ckptfmt.analytics.compare import Comparison
from ckptfmt.analytics.grids import StepGrid, slowest_save_phases
from ckptfmt.analytics.health import HealthReport
from ckptfmt.analytics.stragglers import StragglerReport, Thresholds, step_delays


@dataclass
class Figure:
    """One figure of the report: its id (a file name), title, caption and the matplotlib figure."""

    id: str
    title: str
    caption: str
    figure: Any


@dataclass
class Omitted:
    """A figure with nothing to draw (no NaN at all, no delay found): the page says why in its place."""

    id: str
    title: str
    reason: str


def figures(built: Mapping[str, pa.Table], found: StragglerReport, well: HealthReport,
            comparison: Comparison | None, *, thresholds: Thresholds,
            other_steps: pa.Table | None) -> list[Figure | Omitted]:
    """The report's figures, in page order, from the run's ``tables()`` and analyses (``other_steps``: the
    steps table of the run compared with); those that do not apply to the run (no step records, no second
    run) are left out."""
    made = (_step_heatmap(built["steps"], found), _delay_heatmap(built["steps"], thresholds, built.get("system")),
            _save_phases(built["saves"]), _sizes(built["checkpoints"]), _metrics(built["steps"], other_steps),
            _norms(well), _non_finite(well), _updates(well), _divergence(comparison))
    return [f for f in made if f is not None]


def close(drawn: list[Figure]) -> None:
    """Free the figures' matplotlib state once they are written."""
    for figure in drawn:
        plt.close(figure.figure)


def svg(figure) -> str:
    """The figure as inline SVG markup (the XML prolog and doctype left out), its text as SVG text."""
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return re.sub(r"^.*?(<svg\b)", r"\1", text, count=1, flags=re.S)


# -- each figure ----------------------------------------------------------------------------------
def _heatmap(title: str, steps: np.ndarray, ranks: np.ndarray, values: np.ndarray, label: str):
    figure, axes = plt.subplots(figsize=(10, max(2.5, min(8, 0.25 * ranks.size + 1.5))))
    image = axes.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, ranks[-1] + 0.5, ranks[0] - 0.5))
    figure.colorbar(image, ax=axes, label=label)
    axes.xaxis.set_major_locator(_whole_numbers())  # steps and ranks
    axes.yaxis.set_major_locator(_whole_numbers())
    axes.set_xlabel("step")
    axes.set_ylabel("rank")
    axes.set_title(title)
    return figure, axes


def _whole_numbers() -> MaxNLocator:
    """Ticks at whole numbers only, even where the axis spans one (a single rank: 0, not -0.5 to 0.5)."""
    return MaxNLocator(integer=True, min_n_ticks=1)


def _step_heatmap(steps: pa.Table, found: StragglerReport) -> Figure | None:
    if steps.num_rows == 0:
        return None
    grid = StepGrid(steps)
    figure, axes = _heatmap("Step time per rank", grid.steps, grid.ranks, grid.values("duration_s").T, "seconds")
    marks = [(step, s.rank) for s in found.stragglers for step in s.steps]
    if marks:
        axes.scatter([m[0] for m in marks], [m[1] for m in marks], marker="x", color="red", s=30,
                     label="straggler (delayed the others)", gid="straggler-marks")
        axes.legend(loc="upper right", fontsize="small")
    return Figure("step-time", "Step time per rank",
                  "In synchronous training every rank's step lasts as long as the slowest rank's, so the rows "
                  "look alike; the red crosses mark the ranks that delayed the others: those that reached the "
                  "end of a phase of their own work last.", figure)


def _delay_heatmap(steps: pa.Table, thresholds: Thresholds, system: pa.Table | None = None) -> Figure | Omitted | None:
    if steps.num_rows == 0 or not any(c.startswith("phase_") for c in steps.column_names):
        return None
    delays = step_delays(steps, thresholds, system)
    if not (delays.delay_s > 0).any():
        return Omitted("delays", "Delay each rank added", "No rank delayed the others beyond the jitter in any step.")
    figure, _ = _heatmap("Delay each rank added", delays.steps, delays.ranks, delays.delay_s.T, "seconds")
    return Figure("delays", "Delay each rank added",
                  "Seconds a rank reached the end of a phase of its own work after the other ranks' median, "
                  "beyond what it was late at its step's start, where that exceeds the run's jitter (0 "
                  "elsewhere).", figure)


def _save_phases(saves: pa.Table) -> Figure | None:
    if saves.num_rows == 0:
        return None
    names, phases, slowest = slowest_save_phases(saves)
    figure, axes = plt.subplots(figsize=(10, 4))
    bottom = np.zeros(len(names))
    for i, phase in enumerate(phases):
        axes.bar(range(len(names)), slowest[i], bottom=bottom, label=phase)
        bottom += slowest[i]
    axes.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize="small")
    axes.set_ylabel("seconds (slowest rank per phase)")
    axes.set_title("Save phases per checkpoint")
    axes.legend(fontsize="small", ncol=4)
    return Figure("save-phases", "Save phases per checkpoint",
                  "Each phase of the save as its slowest rank spent it; join, plan and wait_ranks are waits "
                  "for the other ranks.", figure)


def _sizes(checkpoints: pa.Table) -> Figure | None:
    if checkpoints.num_rows == 0:
        return None
    rows = checkpoints.to_pylist()
    x = [r["step"] if r["step"] is not None else i for i, r in enumerate(rows)]
    stored, new = ([r[column] or 0 for r in rows] for column in ("stored_bytes", "new_bytes"))
    size, unit = _byte_unit(max(stored + new))
    figure, axes = plt.subplots(figsize=(10, 3.5))
    axes.plot(x, [b / size for b in stored], marker="o", label="checkpoint size")
    axes.bar(x, [b / size for b in new], width=max(1, (max(x) - min(x)) / 60 or 1),
             color="orange", label="new bytes (not shared with earlier checkpoints)")
    axes.set_xlabel("step")
    axes.set_ylabel(unit)
    axes.set_title("Checkpoint size and new bytes")
    axes.legend(fontsize="small")
    return Figure("sizes", "Checkpoint size and new bytes",
                  "What each checkpoint holds, and what it added to storage: unchanged chunks are stored once.",
                  figure)


def _byte_unit(largest: float) -> tuple[int, str]:
    """The largest binary unit in which ``largest`` bytes is 1 or more (bytes up to TiB): 68 bytes are not
    6.5e-5 MiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = max((p for p in range(len(units)) if largest >= 1024**p), default=0)
    return 1024**power, units[power]


def _metrics(steps: pa.Table, other_steps: pa.Table | None) -> Figure | Omitted | None:
    """Each metric averaged over ranks, per step: this run's solid (A), the compared run's dashed (B)."""
    runs = [("A", "-", steps)] + ([("B", "--", other_steps)] if other_steps is not None else [])
    names = list(dict.fromkeys(c for _, _, table in runs for c in table.column_names if c.startswith("metric_")))
    if not names or not any(table.num_rows for _, _, table in runs):
        return None
    if not any(np.isfinite(table.column(name).to_numpy(zero_copy_only=False).astype(float)).any()
               for _, _, table in runs for name in names if name in table.column_names):
        return Omitted("metrics", "Metrics", "Every recorded metric value is NaN or infinite: nothing to draw.")
    figure, axes = plt.subplots(figsize=(10, 3.5))
    for run, style, table in runs:
        if table.num_rows == 0:
            continue
        grid = StepGrid(table)
        for number, name in enumerate(names):  # a metric keeps its colour in both runs
            if name not in table.column_names:
                continue
            label = name[len("metric_"):]
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a step where every rank's value is NaN
                axes.plot(grid.steps, np.nanmean(grid.values(name), axis=1), style, color=f"C{number}",
                          label=f"{label} ({run})" if other_steps is not None else label, gid=f"metric-{label}-{run}")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_title("Metrics (mean over ranks)")
    axes.legend(fontsize="small")
    caption = "The scalars the training loop recorded, averaged over ranks."
    if other_steps is not None:
        caption += " Solid: this run (A); dashed: the run compared with (B)."
    return Figure("metrics", "Metrics", caption, figure)


def _norms(well: HealthReport) -> Figure | Omitted | None:
    """Each tensor group's norm over checkpoints (log scale), the jumps circled."""
    if not well.group_norms:
        return None
    if not any(v for norms in well.group_norms.values() for v in norms):
        return Omitted("norms", "Norm per tensor group", "Every tensor group's norm is zero in every checkpoint.")
    x = _checkpoint_axis(well)
    figure, axes = plt.subplots(figsize=(10, 4))
    for number, (group, norms) in enumerate(well.group_norms.items()):
        values = np.array([np.nan if v is None or v <= 0 else v for v in norms], dtype=float)
        axes.plot(x, values, marker=".", color=f"C{number % 10}", label=group, gid=f"norm-{group}")
    jumps = [(x[[c["name"] for c in well.checkpoints].index(j["checkpoint"])], j["norm"]) for j in well.jumps
             if j["norm"] > 0]
    if jumps:
        axes.scatter([x for x, _ in jumps], [y for _, y in jumps], s=120, facecolors="none", edgecolors="red",
                     linewidths=1.5, label="jump (off the group's trend)", gid="norm-jumps")
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("l2 norm")
    axes.set_title("Norm per tensor group")
    axes.legend(fontsize="x-small", ncol=3)
    return Figure("norms", "Norm per tensor group",
                  "The root of the summed squared norms of each group's tensors (a layer, an optimizer moment), "
                  "from the statistics each checkpoint records; circled: a change far off the group's own trend.",
                  figure)


def _non_finite(well: HealthReport) -> Figure | Omitted | None:
    """How many tensors hold NaN or infinite values, per checkpoint."""
    if not well.group_norms and not well.non_finite:
        return None  # no statistics recorded
    if not well.non_finite:
        return Omitted("non-finite", "NaN and Inf per checkpoint",
                       "No tensor holds a NaN or an infinite value in any checkpoint.")
    x = _checkpoint_axis(well)
    counts = {entry["checkpoint"]: entry["tensors"] for entry in well.non_finite}
    values = [counts.get(c["name"], 0) for c in well.checkpoints]
    figure, axes = plt.subplots(figsize=(10, 2.5))
    axes.bar(x, values, color="red", width=max(1, (max(x) - min(x)) / 60 or 1), gid="non-finite-bars")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_ylabel("tensors")
    first = well.non_finite[0]  # the checkpoints holding any, in commit order
    where = f"at step {first['step']}" if first["step"] is not None else f"in {first['checkpoint']}"
    axes.set_title(f"Tensors holding NaN or Inf: first {where}")
    return Figure("non-finite", "NaN and Inf per checkpoint",
                  "Tensors whose recorded statistics count a NaN or an infinite element.", figure)


def _updates(well: HealthReport) -> Figure | Omitted | None:
    """Relative update ||W_t - W_prev|| / ||W_t|| per group and checkpoint (``deep`` only)."""
    if not well.updates:
        return None
    names = [c["name"] for c in well.checkpoints]
    groups = sorted({u["group"] for u in well.updates})
    sums = np.zeros((len(groups), len(names), 2))
    for update in well.updates:
        if update["moved_l2"] is not None and update["l2"] is not None:
            cell = sums[groups.index(update["group"]), names.index(update["checkpoint"])]
            cell += (update["moved_l2"] ** 2, update["l2"] ** 2)
    with np.errstate(all="ignore"):
        ratios = np.where(sums[..., 1] > 0, np.sqrt(sums[..., 0] / sums[..., 1]), np.nan)
    positive = ratios[np.isfinite(ratios) & (ratios > 0)]
    if not positive.size:
        return Omitted("updates", "Relative update per tensor group",
                       "No tensor moved between consecutive checkpoints.")
    figure, axes = plt.subplots(figsize=(10, max(2.5, 0.35 * len(groups) + 1.5)))
    norm = matplotlib.colors.LogNorm(vmin=positive.min(), vmax=positive.max())
    cells = axes.pcolormesh(np.ma.masked_invalid(np.where(ratios > 0, ratios, np.nan)), cmap="magma", norm=norm,
                            edgecolors="white", linewidth=1)
    cells.set_gid("update-cells")
    figure.colorbar(cells, ax=axes, label="||W_t - W_prev|| / ||W_t||")
    steps = [str(c["step"]) for c in well.checkpoints]
    axes.set_xticks(np.arange(len(names)) + 0.5, steps, fontsize="small")
    axes.set_yticks(np.arange(len(groups)) + 0.5, groups, fontsize="small")
    axes.invert_yaxis()
    axes.set_xlabel("step")
    axes.set_title("Relative update per tensor group")
    return Figure("updates", "Relative update per tensor group",
                  "How far each group's tensors moved since the previous checkpoint, relative to their size "
                  "(blank: unchanged, not finite, or the first checkpoint).", figure)


def _checkpoint_axis(well: HealthReport) -> list[float]:
    """Each checkpoint's step, or its position where it recorded none."""
    return [c["step"] if c["step"] is not None else index for index, c in enumerate(well.checkpoints)]


#: Divergence cells are annotated with their counts up to this many (beyond, the colours say it).
ANNOTATED_CELLS = 400


def _divergence(comparison: Comparison | None) -> Figure | Omitted | None:
    if not comparison or not comparison.checkpoints:
        return None
    entries = comparison.checkpoints
    groups = sorted({g for e in entries for g in e.groups_differing})
    if not groups:
        return Omitted("divergence", "Divergence per checkpoint and tensor group",
                       "No tensor's bytes differ between the runs at any common step.")
    counts = np.array([[e.groups_differing.get(g, 0) for e in entries] for g in groups], dtype=float)
    figure, axes = plt.subplots(figsize=(10, max(2.5, 0.4 * len(groups) + 1.5)))
    top = max(1.0, counts.max())
    cells = axes.pcolormesh(counts, cmap="Reds", vmin=0, vmax=top, edgecolors="white", linewidth=2)
    cells.set_gid("divergence-cells")  # white edges: equal neighbours still read as separate cells
    figure.colorbar(cells, ax=axes, label="tensors whose bytes differ", ticks=MaxNLocator(integer=True))
    if counts.size <= ANNOTATED_CELLS:
        for (row, column), value in np.ndenumerate(counts):
            axes.text(column + 0.5, row + 0.5, f"{value:.0f}", ha="center", va="center", fontsize="small",
                      color="white" if value > top / 2 else "black", gid=f"divergence-value-{row}-{column}")
    axes.set_xticks(np.arange(len(entries)) + 0.5, [str(e.step) for e in entries], fontsize="small")
    axes.set_yticks(np.arange(len(groups)) + 0.5, groups)
    axes.invert_yaxis()
    axes.set_xlabel("step")
    axes.set_title("Divergence per checkpoint and tensor group")
    return Figure("divergence", "Divergence per checkpoint and tensor group",
                  "Tensors whose chunk hashes differ between the two runs' checkpoints of a step, by the first "
                  "segment of their key.", figure)
