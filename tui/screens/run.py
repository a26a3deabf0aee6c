"""The run screen: a run's step times per rank with its stragglers, the save timeline, its training health
(norms per tensor group over checkpoints, NaN/Inf, jumps, loss spikes, unchanged and mostly-zero
tensors), and a comparison.

Built from ckptfmt.analytics (pyarrow) in a worker thread. The heatmap is text:
one row per rank, one column per step (or per group of steps when they do not
fit), shaded by step time, with a red x where the rank delayed the others.
"""

from __future__ import annotations

import math

import numpy as np
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import seconds
from ckptfmt.tui.screens.base import TAB_BINDINGS, ErrorPanel, WorkerScreen

#: Heatmap columns at most; more steps are grouped, each column showing its group's longest step.
HEATMAP_COLUMNS = 96
#: Ranks shown at most in the heatmap (the straggler table lists them all).
HEATMAP_RANKS = 64
_SHADES = " ░▒▓█"
_PHASE_STYLES = ["cyan", "green", "yellow", "magenta", "blue", "red", "bright_cyan", "bright_green", "white"]


class RunScreen(WorkerScreen):
    """Analytics of one run (a repository), optionally compared with a second run."""

    HELP = ("Steps: each rank's step time over the steps (darker: longer), a red x where the rank delayed the "
            "others, and the stragglers found. Saves: each checkpoint's save phases, as its slowest rank spent "
            "them. Health: each tensor group's norm over the checkpoints (a red x: a jump off its trend), "
            "NaN/Inf, loss spikes, unchanged and mostly-zero tensors. Compare (with ckptfmt tui RUN --compare "
            "RUN_B): whether the runs are identical, where they first diverge, and every recorded difference. "
            "[ and ] switch tabs.")
    BINDINGS = TAB_BINDINGS
    DEFAULT_CSS = """
    RunScreen #summary { padding: 0 1; }
    RunScreen #stragglers, RunScreen #differences { height: auto; max-height: 20; }
    """

    def __init__(self, url: str, compare_with: str | None = None) -> None:
        super().__init__()
        self.url, self.compare_with = url.rstrip("/"), compare_with

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Run {self.url}: reading its manifests ...", id="summary", markup=False)
        yield ErrorPanel()
        with TabbedContent(id="run-tabs"):
            with TabPane("Steps", id="steps-tab"), VerticalScroll():
                yield Static("", id="heatmap")
                yield DataTable(id="stragglers", cursor_type="row", zebra_stripes=True)
            with TabPane("Saves", id="saves-tab"), VerticalScroll():
                yield Static("", id="timeline")
            with TabPane("Health", id="health-tab"), VerticalScroll():
                yield Static("", id="health-verdict", markup=False)
                yield Static("", id="norms")
                yield DataTable(id="findings", cursor_type="row", zebra_stripes=True)
            if self.compare_with:
                with TabPane("Compare", id="compare-tab"), VerticalScroll():
                    yield Static("comparing ...", id="verdict", markup=False)
                    yield DataTable(id="differences", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.load()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def load(self) -> None:
        try:
            from ckptfmt import analytics
        except ImportError as exc:
            raise CheckpointError(f"the run screen needs pyarrow ({exc}): pip install 'ckptfmt[analytics]'") from None
        options = self.app.storage_options
        built = analytics.tables(self.url, storage_options=options)
        thresholds = analytics.Thresholds() if self.app.min_delay is None \
            else analytics.Thresholds(floor_s=self.app.min_delay)
        found = analytics.stragglers(built, thresholds=thresholds)
        well = analytics.health(self.url, storage_options=options, built=built)
        comparison = analytics.compare(self.url, self.compare_with, storage_options=options) \
            if self.compare_with else None
        self.app.call_from_thread(self._show, built, found, comparison)
        self.app.call_from_thread(self._show_health, well)

    def _show_health(self, well) -> None:
        first = well.first_non_finite
        self.query_one("#health-verdict", Static).update(Text(
            "NaN/Inf: none in any checkpoint" if first is None else
            f"NaN/Inf: first in {first['checkpoint']} (step {first['step']}): "
            + ", ".join(t["key"] for t in first["tensors"][:8]), style="" if first is None else "bold red"))
        self.query_one("#norms", Static).update(norm_lines(well))
        table = self.query_one("#findings", DataTable)
        for column in ("finding", "what", "where", "detail"):
            table.add_column(column, key=column)
        for row in findings(well):
            table.add_row(*row)

    def _show(self, built: dict, found: dict, comparison: dict | None) -> None:
        from ckptfmt.analytics import episode_ranges

        self.query_one("#summary", Static).update(Text(
            f"Run {self.url}: {built['checkpoints'].num_rows} checkpoints, {found['steps']} steps recorded on "
            f"{found['ranks']} ranks, {len(found['stragglers'])} stragglers, {len(found['slow_saves'])} slow saves"))
        self.query_one("#heatmap", Static).update(heatmap(built["steps"], found))
        table = self.query_one("#stragglers", DataTable)
        for column in ("rank", "host", "kind", "steps", "phase", "delay", "x median"):
            table.add_column(column, key=column)
        for s in found["stragglers"]:
            table.add_row(str(s["rank"]), str(s["host"]), s["kind"], episode_ranges(s["episodes"]), s["phase"],
                          seconds(s["delay_s"]), "-" if s["ratio"] is None else f"{s['ratio']:.1f}x")
        self.query_one("#timeline", Static).update(timeline(built["saves"]))
        if comparison is not None:
            self._show_comparison(comparison)

    def _show_comparison(self, comparison: dict) -> None:
        divergence = comparison["first_divergence"]
        lines = [f"{self.url} vs {self.compare_with}: the runs are "
                 f"{'identical' if comparison['identical'] else 'different'}"]
        if divergence:
            lines.append(f"first divergence: step {divergence['step']} ({divergence['checkpoint']}), tensor "
                         f"{divergence['tensor']}, max abs difference {divergence['max_abs']}")
        self.query_one("#verdict", Static).update(Text("\n".join(lines)))
        table = self.query_one("#differences", DataTable)
        for column in ("explains", "kind", "field", "rank", "a", "b", "from step", "evidence"):
            table.add_column(column, key=column)
        for d in comparison["differences"]:  # those that can explain the divergence come first
            table.add_row("yes" if d["explains"] else "no", d["kind"], d["field"], str(d.get("rank", "")),
                          str(d["a"])[:40], str(d["b"])[:40], str(d["first_step"]), d["evidence"])


def heatmap(steps, found: dict) -> Table | Text:
    """Ranks x steps as text: shades of step time, a red x where the rank delayed the others."""
    if steps.num_rows == 0:
        return Text("No step records: save with timer=ckptfmt.StepTimer() to record them.")
    from ckptfmt.analytics.grids import StepGrid

    step_grid = StepGrid(steps)
    all_steps, ranks = step_grid.steps.tolist(), step_grid.ranks.tolist()[:HEATMAP_RANKS]
    group = max(1, math.ceil(len(all_steps) / HEATMAP_COLUMNS))
    columns = math.ceil(len(all_steps) / group)
    durations = np.full((columns * group, len(step_grid.ranks)), np.nan)
    durations[:len(all_steps)] = step_grid.values("duration_s")
    with np.errstate(all="ignore"):  # each column: its group's longest step, per rank (NaN: none recorded)
        longest = np.nanmax(durations.reshape(columns, group, -1), axis=1)
    column_of = {step: index // group for index, step in enumerate(all_steps)}
    slow = {(s["rank"], column_of[step]) for s in found["stragglers"] for step in s["steps"] if step in column_of}
    top = (float(np.nanmax(longest)) if np.isfinite(longest).any() else 0.0) or 1.0
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(no_wrap=True)
    for position, rank in enumerate(ranks):
        row = Text()
        for column in range(columns):
            if (rank, column) in slow:
                row.append("x", style="bold red")
            else:
                value = longest[column, position]
                shade = " " if np.isnan(value) else _SHADES[min(len(_SHADES) - 1, 1 + int(3.999 * value / top))]
                row.append(shade, style="blue")
        grid.add_row(f"rank {rank}", row)
    steps_per = f", {group} steps a column (the longest shown)" if group > 1 else ""
    grid.add_row("", Text(f"steps {all_steps[0]}-{all_steps[-1]}{steps_per}; longest step {seconds(top)}",
                          style="dim"))
    return grid


def timeline(saves) -> Table | Text:
    """Each checkpoint's save as a bar of its phases (the slowest rank's time in each)."""
    if saves.num_rows == 0:
        return Text("No save timings.")
    from ckptfmt.analytics.grids import slowest_save_phases

    names, phase_names, slowest = slowest_save_phases(saves)
    style = {p: _PHASE_STYLES[i % len(_PHASE_STYLES)] for i, p in enumerate(phase_names)}
    totals = slowest.sum(axis=0)
    top = float(totals.max()) or 1.0
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, width=60)
    grid.add_column(justify="right", no_wrap=True)
    for j, name in enumerate(names):
        bar = Text()
        for i, phase in enumerate(phase_names):
            bar.append("█" * round(60 * slowest[i, j] / top), style=style[phase])
        grid.add_row(name, bar, seconds(float(totals[j])))
    legend = Text("  ".join(f"█ {p}" for p in phase_names))
    for phase in phase_names:
        start = legend.plain.index(f"█ {phase}")
        legend.stylize(style[phase], start, start + 1)
    grid.add_row("", legend, "")
    return grid


_SPARKS = "▁▂▃▄▅▆▇█"


def norm_lines(well) -> Table | Text:
    """Each tensor group's norm over the checkpoints as a line of bars (log scale, per group), a red x
    where it jumped off its trend, and its last value."""
    if not well.group_norms:
        return Text("No tensor statistics recorded (checkpoints older than format 1.4, or tensor_stats=False).")
    names = [c["name"] for c in well.checkpoints]
    jumped = {(j["group"], names.index(j["checkpoint"])) for j in well.jumps}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for group, norms in well.group_norms.items():
        logs = [math.log10(v) for v in norms if v]
        low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
        line = Text()
        for index, value in enumerate(norms[-HEATMAP_COLUMNS:], start=max(0, len(norms) - HEATMAP_COLUMNS)):
            if (group, index) in jumped:
                line.append("x", style="bold red")
            elif not value:
                line.append(" ")
            else:
                level = 0 if high == low else int((math.log10(value) - low) / (high - low) * (len(_SPARKS) - 1))
                line.append(_SPARKS[level], style="green")
        last = next((v for v in reversed(norms) if v is not None), None)
        grid.add_row(group, line, "-" if last is None else f"{last:.4g}")
    grid.add_row("", Text(f"{len(names)} checkpoints, norms on a log scale per group", style="dim"), "")
    return grid


def findings(well) -> list[tuple[str, str, str, str]]:
    """The health findings as rows: (finding, what, where, detail)."""
    rows = [("norm jump", j["group"], j["checkpoint"], f"x{j['factor']:.3g} to {j['norm']:.4g}") for j in well.jumps]
    rows += [("metric spike", s["metric"], f"steps {s['first_step']}-{s['last_step']}",
              ("NaN" if s["non_finite"] else f"peak {s['peak']:.4g}") + f", between {s['after']} and {s['before']}")
             for s in well.metric_spikes]
    rows += [("unchanged", u["key"], f"since {u['since']}", f"{u['checkpoints']} checkpoints, by {u['evidence']}")
             for u in well.unchanged]
    rows += [("mostly zeros", z["key"], z["checkpoint"], f"{z['share']:.1%} of {z['count']:,}")
             for z in well.mostly_zeros]
    return rows
