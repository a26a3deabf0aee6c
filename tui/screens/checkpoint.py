"""The checkpoint screen: the tensor tree with a detail pane, and one tab per kind of metadata.

Statistics of a tensor are computed when it is selected (Enter), in a worker
that reads only that tensor's chunks through ``Checkpoint.get_tensor``.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Group as RenderGroup
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.timer import Timer
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane, Tree
from textual.worker import get_current_worker

from ckptfmt.format.dtypes import numeric
from ckptfmt.format.shards import chunk_rows
from ckptfmt.loading.checkpoint import Checkpoint
from ckptfmt.tools import describe
from ckptfmt.tui.screens.base import TAB_BINDINGS, ErrorPanel, WorkerScreen
from ckptfmt.tui.screens.verify import VerifyScreen
from ckptfmt.tui.stats import TensorStats, tensor_statistics
from ckptfmt.tui.widgets import metadata
from ckptfmt.tui.widgets.charts import histogram
from ckptfmt.tui.widgets.formatting import (
    KeyText,
    human_bytes,
    human_time,
    number,
    shape_text,
    tensor_count,
)
from ckptfmt.tui.widgets.tensor_tree import Group, TensorTree

# tab id (also the name of its renderer in widgets.metadata) -> title
METADATA_TABS = {
    "environment": "Environment", "rng": "RNG", "topology": "Topology", "timing": "Timing", "user": "User",
    "provenance": "Provenance",
}
FILTER_DELAY_S = 0.15


def recorded_stats_rows(stats: Mapping | None) -> list[tuple[str, str]]:
    """The statistics the writer recorded (spec 6.10), as the detail pane's rows; none when absent."""
    if not isinstance(stats, Mapping):
        return [("statistics", "not recorded")]
    labels = (("min", "min"), ("max", "max"), ("mean", "mean"), ("l2", "norm (l2)"), ("absmax", "absmax"))
    rows = [(label, number(stats[name])) for name, label in labels if name in stats]
    counts = (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"), ("zeros", "zeros"))
    rows += [(label, f"{stats[name]:,}" if isinstance(stats[name], int) else str(stats[name]))
             for name, label in counts if name in stats]
    return rows


def statistics_grid(stats: TensorStats) -> Table:
    """The statistics of a tensor's values read, two to a row."""
    of = " |x|" if stats.magnitude else ""  # complex values: of their magnitude
    cells = [("min" + of, number(stats.minimum)), ("max" + of, number(stats.maximum)),
             ("mean" + of, number(stats.mean)), ("std" + of, number(stats.std)),
             ("NaN", f"{stats.nan:,}"), ("Inf", f"{stats.inf:,}"), ("zeros", f"{stats.zero_fraction:.2%}")]
    table = Table.grid(padding=(0, 1))
    for _ in range(2):
        table.add_column(style="bold", no_wrap=True)
        table.add_column(no_wrap=True)
    for left, right in zip(cells[::2], [*cells[1::2], ("", "")]):
        table.add_row(*left, *right)
    return table


class CheckpointScreen(WorkerScreen):
    """One opened checkpoint: tensors (tree, filter, detail, statistics) and its metadata tabs."""

    HELP = ("Tensors are grouped by name path; Enter or space opens a group. Enter on a tensor reads it "
            "(only its chunks, verified) and computes statistics and a histogram. / filters by name. "
            "[ and ] switch between the tensor tree and the metadata tabs. v verifies this checkpoint.")

    DEFAULT_CSS = """
    CheckpointScreen #filter { display: none; }
    CheckpointScreen #filter.shown { display: block; }
    CheckpointScreen TensorTree { width: 3fr; }
    CheckpointScreen #detail-pane { width: 2fr; border-left: solid $primary; padding: 0 1; }
    CheckpointScreen.-narrow TensorTree, CheckpointScreen.-narrow #detail-pane { width: 1fr; }
    CheckpointScreen #info { margin-bottom: 1; }
    CheckpointScreen #summary { padding: 0 1; }
    CheckpointScreen #tabs { height: 1fr; }
    """
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]  # narrow: the detail pane gets half
    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("v", "verify", "Verify"),
        *TAB_BINDINGS,
    ]

    def __init__(self, reader: Checkpoint, url: str | None = None) -> None:
        super().__init__()
        self.reader = reader
        self.url = url or reader.url
        self.entries = [reader.tensor_info(k) for k in reader.keys()]
        self.meta = reader.metadata
        self._filter_timer: Timer | None = None
        self.sub_title = self.url

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(self._summary(), id="summary")
        yield ErrorPanel()
        with TabbedContent(id="tabs"):
            with TabPane("Tensors", id="tensors"):
                yield Input(placeholder="filter tensors by name (Enter: to the tree, Escape: clear)", id="filter")
                with Horizontal():
                    yield TensorTree(id="tree")
                    with VerticalScroll(id="detail-pane"):
                        yield Static("Select a tensor.", id="info")
                        yield Static("", id="stats")
            for tab, title in METADATA_TABS.items():
                with TabPane(title, id=tab), VerticalScroll():
                    yield Static(self._render_tab(tab), id=f"{tab}-body")
        yield Footer()

    def _summary(self, shown: int | None = None, text: str = "") -> Text:
        """The line above the tabs: what this checkpoint is, or how many tensors the filter matches."""
        stats = describe.mapping(self.meta.get("stats"))
        if text:
            detail = f"filter '{text}': {shown} of {len(self.entries)} tensors"
        else:
            detail = (f"step {self.meta.get('step')}  {human_time(self.meta.get('created_ns'))}  "
                      f"{tensor_count(len(self.entries))}, {human_bytes(stats.get('tensor_bytes'))}; "
                      f"stored {human_bytes(stats.get('stored_bytes'))} in {describe.text(stats.get('chunk_count'))} "
                      "chunk(s)")
        return Text.assemble((self.url, "bold"), "  ", detail)

    def _render_tab(self, tab: str):
        if tab == "topology":
            return metadata.topology(self.meta, self.entries)
        return getattr(metadata, tab)(self.meta)

    def on_mount(self) -> None:
        tree = self.query_one(TensorTree)
        tree.show(self.entries)
        tree.focus()

    # -- tree and detail pane --------------------------------------------------
    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted[Group]) -> None:
        group = event.node.data
        if group is not None:
            self._show_info(group)

    def on_tree_node_selected(self, event: Tree.NodeSelected[Group]) -> None:
        group = event.node.data
        if group is not None and group.tensor is not None:
            self.query_one("#stats", Static).update(Text("computing statistics ...", style="dim"))
            self.compute_stats(group.tensor)

    def _show_info(self, group: Group) -> None:
        info = self.query_one("#info", Static)
        if group.tensor is None:
            totals = f"\n{tensor_count(group.count)}, {human_bytes(group.nbytes)}"
            info.update(Text.assemble((group.name, "bold"), totals))
            self.query_one("#stats", Static).update("")
            return
        info.update(RenderGroup(KeyText(group.tensor, "bold"), self._tensor_rows(group.tensor)))
        self.query_one("#stats", Static).update(Text("Enter: compute the histogram", style="dim"))

    def _tensor_rows(self, key: str) -> Table:
        """What the manifest says of a tensor, and the statistics its writer recorded."""
        entry = self.reader.tensor_info(key)
        chunks = sorted({self.reader.manifest.chunks[row].hash[:12] for row in set(chunk_rows(entry.shards))})
        rows = [
            ("dtype", entry.dtype), ("shape", shape_text(entry.shape)), ("elements", f"{entry.numel:,}"),
            ("size", human_bytes(entry.nbytes)), ("kind", entry.kind), ("requires grad", str(entry.requires_grad)),
            ("shards", str(len(entry.shards))), ("chunks", ", ".join(chunks) or "-"),
        ]
        if entry.same_as is not None:
            rows.append(("same data as", KeyText(self.reader.manifest.tensors[entry.same_as].key)))
        rows += recorded_stats_rows(self.reader.tensor_stats(key))
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for row in rows:
            table.add_row(*row)
        return table

    @work(thread=True, exclusive=True, exit_on_error=False, group="stats")
    def compute_stats(self, key: str) -> None:
        """Read one tensor (only its chunks, verified) and summarise it, off the UI thread."""
        stats = tensor_statistics(values_of(self.reader, key))
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show_stats, key, stats)

    def _show_stats(self, key: str, stats: TensorStats) -> None:
        """The statistics and histogram, scrolled into view (at 80x24 they fill the pane), unless the cursor
        has moved on to another tensor meanwhile."""
        node = self.query_one(TensorTree).cursor_node
        if node is None or node.data is None or node.data.tensor != key:
            return
        parts = [Text(f"statistics of {stats.numel:,} values", style="bold underline"), statistics_grid(stats)]
        if stats.histogram:
            parts += [Text("histogram of finite values", style="bold"), histogram(stats, width=20)]
        box = self.query_one("#stats", Static)
        box.update(RenderGroup(*parts))
        self.call_after_refresh(box.scroll_visible, top=True, animate=False)

    # -- filter ------------------------------------------------------------------
    def action_filter(self) -> None:
        self.query_one(TabbedContent).active = "tensors"
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Refilter once typing pauses: rebuilding a large tree on every key would lag behind the keys."""
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(FILTER_DELAY_S, lambda: self._apply_filter(event.value.strip()))

    def _apply_filter(self, text: str) -> None:
        needle = text.lower()
        shown = [e for e in self.entries if needle in e.key.lower()] if needle else self.entries
        self.query_one(TensorTree).show(shown)
        self.query_one("#summary", Static).update(self._summary(len(shown), text))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(TensorTree).focus()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Escape also closes an open filter, even where there is no screen to go back to."""
        if action == "back" and self.query_one("#filter", Input).has_class("shown"):
            return True
        return super().check_action(action, parameters)

    def action_back(self) -> None:
        """Escape: clear an open filter first; otherwise go back."""
        box = self.query_one("#filter", Input)
        if box.has_class("shown"):
            box.value = ""
            box.remove_class("shown")
            self.query_one(TensorTree).focus()
        else:
            super().action_back()

    # -- other actions -----------------------------------------------------------
    def action_verify(self) -> None:
        self.app.push_screen(VerifyScreen(self.url, {self.reader.name: self.url}))

    def show_failure(self, exc: BaseException) -> None:
        """A tensor that cannot be read (a damaged chunk) leaves no stale 'computing' line behind."""
        super().show_failure(exc)
        self.query_one("#stats", Static).update("")

    def on_unmount(self) -> None:
        self.reader.close()


def values_of(checkpoint: Checkpoint, key: str):
    """Tensor ``key``'s values as a numpy array (no torch); the dtypes numpy lacks (float8, float4,
    complex32) through torch, loaded then."""
    values = numeric(checkpoint.read_array(key), checkpoint.tensor_info(key).dtype)
    if values is not None:
        return values
    from ckptfmt.loading.reader import CheckpointReader

    return CheckpointReader.from_parts(checkpoint.repository, checkpoint.name).get_tensor(key)
