"""A run's report: figures and tables in one self-contained HTML file (and the figures as PNG files).

The page embeds its figures as inline SVG and its style inline: it opens from
a file, offline, in any browser. Figures (matplotlib, drawn off-screen):
step time per rank over steps with the stragglers marked, the delay each rank
added, save phases per checkpoint, checkpoint size and new bytes over time,
metrics over steps (both runs' with a second run), and with a second run, the
tensors that differ per checkpoint and tensor group, each tensor group's norm
over checkpoints, the tensors holding NaN or Inf per checkpoint and (``deep``)
each group's relative update. A figure with nothing to draw (a run without
NaN or Inf, runs whose tensors never differ) is left out, and the page says so
in its place. Tables: the run's health, stragglers and why they straggled,
slow saves, and the recorded differences between the runs, their cells in
words (yes/no, -, NaN), never Python's reprs. Text in the figures is
SVG text (selectable, found by the browser's search); artists a reader or a
test looks for carry ids (``straggler-marks``, ``metric-<name>-A``,
``divergence-cells``, ``divergence-value-<row>-<column>``).
"""

from __future__ import annotations

import html
import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import matplotlib

matplotlib.use("Agg")  # no display: figures are files
import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.ticker import MaxNLocator

from ckptfmt.analytics._keyed import KeyedResult
from ckptfmt.analytics.certify import Certificate, certify, certify_resumes, resumes_verdict
from ckptfmt.analytics.compare import Comparison, compare
from ckptfmt.analytics.goodput import CATEGORY_NAMES, Goodput, goodput
from ckptfmt.analytics.grids import StepGrid, slowest_save_phases
from ckptfmt.analytics.health import HealthReport, health
from ckptfmt.analytics.stragglers import StragglerReport, Thresholds, episode_ranges, step_delays, stragglers
from ckptfmt.analytics.tables import tables
from ckptfmt.tools.formatting import counted, step_range, words, world_sizes


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


@dataclass(frozen=True)
class RunReport(KeyedResult):
    """What went into a run's report: the figures drawn and the analyses its tables show.

    ``made["figures"]`` (the dict ``report`` returned before) still works, with a DeprecationWarning."""

    figures: list[str]  # the ids of the figures drawn, in page order (those with nothing to draw left out)
    stragglers: StragglerReport  # judged by the report's thresholds, with their explanations
    comparison: Comparison | None  # with a run to compare with
    health: HealthReport
    certificate: Certificate | None  # does the run reproduce the one compared with, step by step
    resumes: list[Certificate]  # each resume of the run, certified
    goodput: Goodput

    _returned_by = "report()"

    def to_json(self) -> dict:
        return {"figures": self.figures, "stragglers": self.stragglers.to_json(),
                "comparison": None if self.comparison is None else self.comparison.to_json(),
                "health": self.health.to_json(),
                "certificate": None if self.certificate is None else self.certificate.to_json(),
                "resumes": [c.to_json() for c in self.resumes], "goodput": self.goodput.to_json()}

    def _as_dict(self) -> dict[str, Any]:
        return {"figures": self.figures, "stragglers": self.stragglers.to_json(), "comparison": self.comparison,
                "health": self.health, "certificate": self.certificate, "resumes": self.resumes,
                "goodput": self.goodput}


def report(repo: str | os.PathLike, *, html_path: str | os.PathLike | None = None,
           png_dir: str | os.PathLike | None = None, compare_with: str | os.PathLike | None = None,
           thresholds: Thresholds = Thresholds(), storage_options: dict | None = None,
           deep: bool = False) -> RunReport:
    """Write the report of run ``repo`` (compared with run ``compare_with`` if given) as ``html_path``
    and/or PNG files in ``png_dir``; returns what went in: figure ids, stragglers (judged by
    ``thresholds``), the comparison, the run's health (``deep``: with each tensor group's relative
    updates between checkpoints, which reads the tensors that changed)."""
    built = tables(repo, storage_options=storage_options)
    found = stragglers(built, thresholds=thresholds, explain=True)
    well = health(repo, deep=deep, storage_options=storage_options, built=built)
    comparison = compare(repo, compare_with, storage_options=storage_options) if compare_with else None
    resumes = certify_resumes(repo, storage_options=storage_options)
    spent = goodput(repo, storage_options=storage_options, built=built)
    certificate = cast(Certificate, certify(compare_with, repo, storage_options=storage_options)) \
        if compare_with else None
    other_steps = tables(compare_with, storage_options=storage_options)["steps"] if compare_with else None
    shown = [f for f in (_step_heatmap(built["steps"], found),
                         _delay_heatmap(built["steps"], thresholds, built.get("system")),
                         _save_phases(built["saves"]), _sizes(built["checkpoints"]),
                         _metrics(built["steps"], other_steps), _norms(well), _non_finite(well),
                         _updates(well), _divergence(comparison)) if f is not None]
    figures = [f for f in shown if isinstance(f, Figure)]
    try:
        if png_dir is not None:
            folder = Path(png_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for figure in figures:
                figure.figure.savefig(folder / f"{figure.id}.png", dpi=110, bbox_inches="tight")
        if html_path is not None:
            Path(html_path).write_text(_page(os.fspath(repo), built, found, well, comparison, compare_with,
                                             shown, certificates=(certificate, resumes), spent=spent),
                                       encoding="utf-8")
    finally:
        for figure in figures:
            plt.close(figure.figure)
    return RunReport(figures=[f.id for f in figures], stragglers=found, comparison=comparison, health=well,
                     certificate=certificate, resumes=resumes, goodput=spent)


# -- figures ---------------------------------------------------------------------------------------
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


# -- the page --------------------------------------------------------------------------------------
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; }
th { background: #f3f3f3; text-align: left; } .verdict { font-size: 1.1em; font-weight: bold; }
svg { max-width: 100%; height: auto; }
"""


def _page(repo: str, built: dict, found: StragglerReport, well: HealthReport, comparison: Comparison | None, other,
          figures: list[Figure | Omitted], *, certificates: tuple[Certificate | None, list[Certificate]],
          spent: Goodput) -> str:
    e = html.escape
    checkpoints = built["checkpoints"]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>ckptfmt report: {e(repo)}</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>Run report: {e(repo)}</h1>",
             f"<p>{counted(checkpoints.num_rows, 'checkpoint')}, {counted(found.steps, 'recorded step')} on "
             f"{counted(found.ranks, 'rank')}.</p>"]
    certificate, resumes = certificates
    if comparison is not None:
        parts += _comparison_section(comparison, other, certificate)
    parts += _goodput_section(spent)
    parts += _resumes_section(resumes)
    parts += _health_section(well)
    parts += _stragglers_section(found)
    for figure in figures:
        parts.append(f"<h2>{e(figure.title)}</h2>")
        if isinstance(figure, Omitted):
            parts.append(f"<p id='figure-{figure.id}-omitted'>{e(figure.reason)}</p>")
        else:
            parts.append(f"<figure id='figure-{figure.id}'>{_svg(figure.figure)}"
                         f"<figcaption>{e(figure.caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _comparison_section(comparison: Comparison, other, certificate: Certificate | None) -> list[str]:
    """The verdict, the certificate (does this run reproduce the other step by step), the first
    divergence and every recorded difference between the runs."""
    e = html.escape
    verdict = "identical" if comparison.identical else "different"
    parts = [f"<h2>Compared with {e(os.fspath(other))}</h2><p class='verdict' id='verdict'>The runs are "
             f"{verdict}.</p>"]
    if certificate is not None:
        parts.append(f"<p id='certificate'>Certified against it: {e(certificate.summary())}.</p>")
    divergence = comparison.first_divergence
    if divergence:
        how = (e(divergence.reason) if divergence.max_abs is None or divergence.max_rel is None else
               f"max abs difference {divergence.max_abs:.3g}, max relative {divergence.max_rel:.3g}")
        parts.append(f"<p>First divergence: step {divergence.step} ({e(divergence.checkpoint)}), "
                     f"tensor <code>{e(divergence.tensor)}</code>, {how}.</p>")
    differences = [d.to_json() for d in comparison.differences]
    columns = list(dict.fromkeys(key for d in differences for key in d))  # whatever compare records
    parts += ["<h3>Recorded differences</h3>",
              _table("differences", [c.replace("_", " ") for c in columns],
                     [[d.get(c) for c in columns] for d in differences])]
    return parts


def _goodput_section(spent: Goodput) -> list[str]:
    """Where the run's wall time went (``ckptfmt goodput``), and its restarts."""
    if not spent.ranks:
        return ["<h2>Where the time went</h2>", "<p id='goodput'>No training steps on record.</p>"]
    shares = spent.shares
    parts = ["<h2>Where the time went</h2>",
             f"<p id='goodput-summary'>{spent.wall_s:.1f} s of wall time on {counted(spent.ranks, 'rank')} "
             f"(the mean of the ranks): {shares['productive']:.1%} productive, "
             f"{counted(len(spent.restarts), 'restart')}, {counted(spent.steps_recomputed, 'step')} computed "
             "again.</p>",
             _table("goodput", ["share", "seconds", "of wall time"],
                    [[CATEGORY_NAMES[name], f"{value:.2f}", f"{shares[name]:.1%}"]
                     for name, value in spent.seconds.items()])]
    if spent.restarts:
        parts.append(_table("restarts", ["rank", "resumed from", "step", "down (s)", "world size"],
                            [[r["rank"], r["from"], r["from_step"], f"{r['seconds']:.2f}",
                              world_sizes(r["world_size"])] for r in spent.restarts]))
    return parts


def _resumes_section(resumes: list[Certificate]) -> list[str]:
    """The run's lineage: each resume, the checkpoint it came from, the world sizes, what it did not
    restore, and its certificate (the resume's own record, and the steps computed again)."""
    rows = []
    for certificate in resumes:
        place = certificate.lineage()
        rows.append([place["rank"], place["resumed_from"], place["step"], place["world_size"],
                     "-" if place["after_s"] is None else f"{place['after_s']:.1f}",
                     ", ".join(place["not_restored"]) or "all equal", certificate.summary()])
    return ["<h2>Resumes</h2>", f"<p id='resumes-verdict'>{resumes_verdict(resumes)}.</p>",
            _table("resumes", ["rank", "resumed from", "step", "world size", "seconds after the save",
                               "parts not restored", "certificate"], rows)]


def _stragglers_section(found: StragglerReport) -> list[str]:
    """The stragglers, why they straggled and the slow saves."""
    parts = ["<h2>Stragglers</h2>",
             _table("stragglers", ["rank", "host", "kind", "steps", "phase", "delay (s)", "x median"],
                    [[s.rank, s.host, s.kind, episode_ranges(s.episodes), s.phase, f"{s.delay_s:.3f}",
                      "-" if s.ratio is None else f"{s.ratio:.1f}"] for s in found.stragglers])]
    if found.explanations:
        parts.append("<h2>Why they straggled</h2>")
        parts.append(_table("straggler-causes", ["rank", "host", "steps", "cause", "evidence", "what to do"],
                            [[e["rank"], e["host"], step_range(e["first_step"], e["last_step"]), c["cause"],
                              c["evidence"], c["action"]] for e in found.explanations for c in e["causes"]]))
    if found.slow_saves:
        parts.append("<h2>Slow saves</h2>")
        parts.append(_table("slow-saves", ["rank", "host", "checkpoints", "phases", "delay (s)"],
                            [[s.rank, s.host, ", ".join(s.checkpoints), ", ".join(sorted(set(s.phases))),
                              f"{s.delay_s:.3f}"] for s in found.slow_saves]))
    return parts


def _health_section(well: HealthReport) -> list[str]:
    """The run's health as the page says it: NaN/Inf, norm jumps, metric spikes, unchanged, mostly zeros."""
    e = html.escape
    first = well.first_non_finite
    step = "" if first is None or first["step"] is None else f" (step {first['step']})"
    verdict = ("No NaN or Inf in any checkpoint" if first is None else
               f"NaN or Inf first in {e(first['checkpoint'])}{step}: "
               + ", ".join(f"<code>{e(t['key'])}</code>" for t in first["tensors"][:8]))
    return [
        "<h2>Training health</h2>", f"<p id='health-verdict'>{verdict}.</p>",
        "<h3>Norm jumps</h3>",
        _table("norm-jumps", ["group", "checkpoint", "step", "norm", "change"],
               [[j["group"], j["checkpoint"], j["step"], f"{j['norm']:.4g}", f"x{j['factor']:.3g}"]
                for j in well.jumps]),
        "<h3>Metric spikes</h3>",
        _table("metric-spikes", ["metric", "steps", "peak", "baseline", "between checkpoints"],
               [[s["metric"], step_range(s["first_step"], s["last_step"]),
                 "NaN" if s["non_finite"] else f"{s['peak']:.4g}",
                 "-" if s["baseline"] is None else f"{s['baseline']:.4g}",
                 f"{s['after'] or 'the start'} and {s['before'] or 'the end'}"] for s in well.metric_spikes]),
        "<h3>Unchanged tensors</h3>",
        _table("unchanged", ["tensor", "since", "checkpoints", "by"],
               [[u["key"], u["since"], u["checkpoints"], u["evidence"]] for u in well.unchanged]),
        "<h3>Mostly zeros</h3>",
        _table("mostly-zeros", ["tensor", "checkpoint", "zeros"],
               [[z["key"], z["checkpoint"], f"{z['share']:.1%}"] for z in well.mostly_zeros]),
    ]


def _table(table_id: str, header: list[str], rows: list[list]) -> str:
    if not rows:
        return f"<p id='{table_id}'>None.</p>"
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(words(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table id='{table_id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _svg(figure) -> str:
    """The figure as inline SVG markup (the XML prolog and doctype left out), its text as SVG text."""
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return re.sub(r"^.*?(<svg\b)", r"\1", text, count=1, flags=re.S)
