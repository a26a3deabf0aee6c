"""The run screen: a run's step times per rank with its stragglers, the save timeline, its resumes with
their certificates, its training health (norms per tensor group over checkpoints, NaN/Inf, jumps, loss
spikes, unchanged and mostly-zero tensors), and a comparison with its certificate.

Built from ckptfmt.analytics (pyarrow) in a worker thread. The heatmap is text:
one row per rank, one column per step (or per group of steps when they do not
fit), shaded by step time, with a red x where the rank delayed the others. The
charts are ``Fitted``: drawn for the pane's width, so they fit 80 columns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from rich.cells import cell_len
from rich.console import Group as RenderGroup
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import seconds, short, step_range, words
from ckptfmt.tui.screens.base import TAB_BINDINGS, ErrorPanel, WorkerScreen
from ckptfmt.tui.widgets.charts import Fitted, bar_room

if TYPE_CHECKING:  # analytics needs pyarrow: imported when the screen loads
    from ckptfmt.analytics.compare import Comparison, Difference
    from ckptfmt.analytics.stragglers import StragglerReport

#: Heatmap columns at most (fewer where the pane is narrower); more steps are grouped, each column showing
#: its group's longest step.
HEATMAP_COLUMNS = 96
#: Cells at most of a save's bar in the timeline.
TIMELINE_WIDTH = 60
#: Ranks shown at most in the heatmap (the straggler table lists them all).
HEATMAP_RANKS = 64
_SHADES = " ░▒▓█"
_PHASE_STYLES = ["cyan", "green", "yellow", "magenta", "blue", "red", "bright_cyan", "bright_green", "white"]


class RunScreen(WorkerScreen):
    """Analytics of one run (a repository), optionally compared with a second run."""

    HELP = ("Steps: each rank's step time over the steps (darker: longer), a red x where the rank delayed the "
            "others, and the stragglers found. Saves: each checkpoint's save phases, as its slowest rank spent "
            "them. Health: each tensor group's norm over the checkpoints (a red x: a jump off its trend), "
            "NaN/Inf, loss spikes, unchanged and mostly-zero tensors. Resumes: each resume of the run, the "
            "checkpoint it came from, what it did not restore and whether it reproduces (ckptfmt certify RUN). "
            "Compare (with ckptfmt tui RUN --compare RUN_B): whether the runs are identical, where they first "
            "diverge, whether this run reproduces the other step by step, and every recorded difference. "
            "[ and ] switch tabs.")
    BINDINGS = TAB_BINDINGS
    DEFAULT_CSS = """
    RunScreen #summary { padding: 0 1; }
    RunScreen #run-tabs { height: 1fr; }
    RunScreen #stragglers, RunScreen #differences { height: auto; max-height: 20; }
    """

    def __init__(self, url: str, compare_with: str | None = None) -> None:
        super().__init__()
        self.url, self.compare_with = url.rstrip("/"), compare_with
        self.sub_title = f"run {self.url}" + (f" vs {compare_with}" if compare_with else "")

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
            with TabPane("Resumes", id="resumes-tab"), VerticalScroll():
                yield Static("", id="resumes-verdict", markup=False)
                yield DataTable(id="resumes", cursor_type="row", zebra_stripes=True)
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
            import ckptfmt.analytics.tables  # noqa: F401 (pyarrow: the package's names load on first use)
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
        resumes = analytics.certify(self.url, storage_options=options)
        certificate = analytics.certify(self.compare_with, self.url, storage_options=options) \
            if self.compare_with else None
        self.app.call_from_thread(self._show, built, found, comparison, certificate)
        self.app.call_from_thread(self._show_resumes, resumes)
        self.app.call_from_thread(self._show_health, well)

    def _show_resumes(self, resumes) -> None:
        from ckptfmt.analytics.certify import resumes_verdict

        self.query_one("#resumes-verdict", Static).update(Text(resumes_verdict(resumes)))
        table = self.query_one("#resumes", DataTable)
        for column in ("rank", "from", "step", "world", "after", "not restored", "certificate"):
            table.add_column(column, key=column)
        for certificate in resumes:
            place = certificate.lineage()
            table.add_row(str(place["rank"]), str(place["resumed_from"]), str(place["step"]),
                          str(place["world_size"]), "-" if place["after_s"] is None else seconds(place["after_s"]),
                          ", ".join(place["not_restored"]) or "all equal", certificate.summary())

    def _show_health(self, well) -> None:
        first = well.first_non_finite
        self.query_one("#health-verdict", Static).update(Text(
            "NaN/Inf: none in any checkpoint" if first is None else
            f"NaN/Inf: first in {first['checkpoint']} (step {first['step']}): "
            + ", ".join(t["key"] for t in first["tensors"][:8]), style="" if first is None else "bold red"))
        self.query_one("#norms", Static).update(Fitted(lambda width: norm_lines(well, width)))
        table = self.query_one("#findings", DataTable)
        for column in ("finding", "what", "where", "detail"):
            table.add_column(column, key=column)
        for row in findings(well):
            table.add_row(*row)

    def _show(self, built: dict, found: StragglerReport, comparison: Comparison | None, certificate) -> None:
        from ckptfmt.analytics import episode_ranges

        self.query_one("#summary", Static).update(Text(
            f"Run {self.url}: {built['checkpoints'].num_rows} checkpoints, {found.steps} steps recorded on "
            f"{found.ranks} ranks, {len(found.stragglers)} stragglers, {len(found.slow_saves)} slow saves"))
        self.query_one("#heatmap", Static).update(Fitted(lambda width: heatmap(built["steps"], found, width)))
        table = self.query_one("#stragglers", DataTable)
        for column in ("rank", "host", "kind", "steps", "phase", "delay", "x median"):
            table.add_column(column, key=column)
        for s in found.stragglers:
            table.add_row(str(s.rank), str(s.host), s.kind, episode_ranges(s.episodes), s.phase, seconds(s.delay_s),
                          "-" if s.ratio is None else f"{s.ratio:.1f}x")
        self.query_one("#timeline", Static).update(Fitted(lambda width: timeline(built["saves"], width)))
        if comparison is not None:
            self._show_comparison(comparison, certificate)

    def _show_comparison(self, comparison: Comparison, certificate) -> None:
        divergence = comparison.first_divergence
        lines = [f"{self.url} vs {self.compare_with}: the runs are "
                 f"{'identical' if comparison.identical else 'different'}"]
        if divergence:
            amount = "" if divergence.max_abs is None or divergence.max_rel is None else (
                f", max abs difference {divergence.max_abs:.3g}, max relative {divergence.max_rel:.3g}")
            lines.append(f"first divergence: step {divergence.step} ({divergence.checkpoint}), tensor "
                         f"{divergence.tensor}{amount}")
        if certificate is not None:
            lines.append(f"certified: {certificate.summary()}")
        self.query_one("#verdict", Static).update(Text("\n".join(lines)))
        table = self.query_one("#differences", DataTable)
        table.add_columns(*DIFFERENCE_COLUMNS)
        for row in difference_rows(comparison.differences, self.size.width - 2):  # less the scrollbar
            table.add_row(*row)


DIFFERENCE_COLUMNS = ("explains", "kind", "field", "rank", "a", "b", "from step", "evidence")


def difference_rows(differences: list[Difference], width: int) -> list[tuple[str, ...]]:
    """The comparison's differences as rows (those that can explain the divergence first, as compare()
    sorts them), the values a and b cut to share what ``width`` cells the columns before them leave."""
    rows = [(words(d.explains), d.kind, d.field, words(d.rank), words(d.a), words(d.b), words(d.first_step),
             words(d.evidence)) for d in differences]
    before = sum(max(cell_len(cell) for cell in (header, *column)) + 2
                 for header, column in zip(DIFFERENCE_COLUMNS[:4], list(zip(*rows))[:4]))
    room = min(40, max(10, (width - before) // 2 - 2))
    return [(*row[:4], short(row[4], room), short(row[5], room), *row[6:]) for row in rows]


def heatmap(steps, found: StragglerReport, width: int) -> RenderGroup | Text:
    """Ranks x steps as text in ``width`` cells: shades of step time, a red x where the rank delayed the
    others; steps are grouped where there are more than columns."""
    if steps.num_rows == 0:
        return Text("No step records: save with timer=ckptfmt.StepTimer() to record them.")
    from ckptfmt.analytics.grids import StepGrid

    step_grid = StepGrid(steps)
    all_steps, ranks = step_grid.steps.tolist(), step_grid.ranks.tolist()[:HEATMAP_RANKS]
    labels = [f"rank {rank}" for rank in ranks]
    group = max(1, math.ceil(len(all_steps) / bar_room(width, labels, most=HEATMAP_COLUMNS)))
    columns = math.ceil(len(all_steps) / group)
    durations = np.full((columns * group, len(step_grid.ranks)), np.nan)
    durations[:len(all_steps)] = step_grid.values("duration_s")
    with np.errstate(all="ignore"):  # each column: its group's longest step, per rank (NaN: none recorded)
        longest = np.nanmax(durations.reshape(columns, group, -1), axis=1)
    column_of = {step: index // group for index, step in enumerate(all_steps)}
    slow = {(s.rank, column_of[step]) for s in found.stragglers for step in s.steps if step in column_of}
    top = (float(np.nanmax(longest)) if np.isfinite(longest).any() else 0.0) or 1.0
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(no_wrap=True)
    for position, (rank, label) in enumerate(zip(ranks, labels)):
        crossed = [(rank, column) in slow for column in range(columns)]
        grid.add_row(label, _heat_row(longest[:, position], crossed, top))
    steps_per = f", {group} steps a column (the longest shown)" if group > 1 else ""
    caption = f"steps {all_steps[0]}-{all_steps[-1]}{steps_per}; longest step {seconds(top)}"
    return RenderGroup(grid, _indented(caption, max(map(cell_len, labels)) + 1, "dim"))


def _heat_row(longest, crossed: list[bool], top: float) -> Text:
    """One rank's row: a shade per column of its longest step there, an x where it delayed the others."""
    row = Text()
    for value, cross in zip(longest, crossed):
        if cross:
            row.append("x", style="bold red")
        else:
            shade = " " if np.isnan(value) else _SHADES[min(len(_SHADES) - 1, 1 + int(3.999 * value / top))]
            row.append(shade, style="blue")
    return row


def _indented(text: str, indent: int, style: str) -> Text:
    """A caption under a chart's bars, starting where they start."""
    return Text.assemble(" " * indent, (text, style))


def timeline(saves, width: int) -> RenderGroup | Text:
    """Each checkpoint's save as a bar of its phases (the slowest rank's time in each), in ``width`` cells,
    with a legend of the phases' colours."""
    if saves.num_rows == 0:
        return Text("No save timings.")
    from ckptfmt.analytics.grids import slowest_save_phases

    names, phase_names, slowest = slowest_save_phases(saves)
    style = {p: _PHASE_STYLES[i % len(_PHASE_STYLES)] for i, p in enumerate(phase_names)}
    totals = [seconds(float(total)) for total in slowest.sum(axis=0)]
    top = float(slowest.sum(axis=0).max()) or 1.0
    cells = bar_room(width, names, totals, most=TIMELINE_WIDTH)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, width=cells)
    grid.add_column(justify="right", no_wrap=True)
    for j, (name, total) in enumerate(zip(names, totals)):
        bar = Text()
        for i, phase in enumerate(phase_names):
            bar.append("█" * round(cells * slowest[i, j] / top), style=style[phase])
        grid.add_row(name, bar, total)
    indent = max(map(cell_len, names)) + 1
    return RenderGroup(grid, legend(style, indent, max(1, width - indent)))


def legend(styles: dict[str, str], indent: int, width: int) -> Text:
    """'█ phase' for each phase in its colour, in lines of at most ``width`` cells after ``indent`` spaces,
    never split between a colour and its name."""
    text, used = Text(" " * indent), 0
    for name, style in styles.items():
        item = 2 + cell_len(name)
        if used and used + 2 + item > width:
            text.append("\n" + " " * indent)
            used = 0
        elif used:
            text.append("  ")
            used += 2
        text.append("█", style)
        text.append(f" {name}")
        used += item
    return text


_SPARKS = "▁▂▃▄▅▆▇█"


def norm_lines(well, width: int) -> RenderGroup | Text:
    """Each tensor group's norm over its latest checkpoints (as many as ``width`` cells hold) as a line of
    bars (log scale, per group), a red x where it jumped off its trend, and its last value."""
    if not well.group_norms:
        return Text("No tensor statistics recorded (checkpoints older than format 1.4, or tensor_stats=False).")
    names = [c["name"] for c in well.checkpoints]
    jumped = {(j["group"], names.index(j["checkpoint"])) for j in well.jumps}
    lasts = {group: next((v for v in reversed(norms) if v is not None), None)
             for group, norms in well.group_norms.items()}
    values = ["-" if last is None else f"{last:.4g}" for last in lasts.values()]
    cells = bar_room(width, list(lasts), values, most=HEATMAP_COLUMNS)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for (group, norms), value in zip(well.group_norms.items(), values):
        first = max(0, len(norms) - cells)
        grid.add_row(group, _sparkline(norms[first:], first, {i for g, i in jumped if g == group}), value)
    caption = f"{len(names)} checkpoints, norms on a log scale per group"
    return RenderGroup(grid, _indented(caption, max(map(cell_len, lasts)) + 1, "dim"))


def _sparkline(norms: list, first: int, jumped: set[int]) -> Text:
    """Bars of ``norms`` (checkpoints ``first`` on) on a log scale, an x at the checkpoints in ``jumped``."""
    logs = [math.log10(v) for v in norms if v]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    line = Text()
    for index, value in enumerate(norms, start=first):
        if index in jumped:
            line.append("x", style="bold red")
        elif not value:
            line.append(" ")
        else:
            level = 0 if high == low else int((math.log10(value) - low) / (high - low) * (len(_SPARKS) - 1))
            line.append(_SPARKS[level], style="green")
    return line


def _steps(first: int, last: int) -> str:
    """'step 30', 'steps 4-7'."""
    return f"step {first}" if first == last else f"steps {step_range(first, last)}"


def findings(well) -> list[tuple[str, str, str, str]]:
    """The health findings as rows: (finding, what, where, detail)."""
    rows = [("norm jump", j["group"], j["checkpoint"], f"x{j['factor']:.3g} to {j['norm']:.4g}") for j in well.jumps]
    rows += [("metric spike", s["metric"], _steps(s["first_step"], s["last_step"]),
              ("NaN" if s["non_finite"] else f"peak {s['peak']:.4g}") +
              f", between {s['after'] or 'the start'} and {s['before'] or 'the end'}")
             for s in well.metric_spikes]
    rows += [("unchanged", u["key"], f"since {u['since']}", f"{u['checkpoints']} checkpoints, by {u['evidence']}")
             for u in well.unchanged]
    rows += [("mostly zeros", z["key"], z["checkpoint"], f"{z['share']:.1%} of {z['count']:,}")
             for z in well.mostly_zeros]
    return rows
