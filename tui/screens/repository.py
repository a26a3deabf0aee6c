"""The repository screen: a sortable table of checkpoints; open one, verify, or mark two to diff."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Header, Static

from ckptfmt.loading.checkpoint import Checkpoint
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.tools import describe
from ckptfmt.tui.screens.base import ErrorPanel, RowTable, WorkerScreen
from ckptfmt.tui.screens.checkpoint import CheckpointScreen
from ckptfmt.tui.screens.diff import DiffScreen
from ckptfmt.tui.screens.run import RunScreen
from ckptfmt.tui.screens.verify import VerifyScreen
from ckptfmt.tui.widgets.formatting import human_bytes, human_time

# column label -> sort key of a commit record (the verified column sorts by its text)
SORT_KEYS = {
    "name": lambda r, _: r.name,
    "step": lambda r, _: (r.step is None, r.step or 0),
    "created": lambda r, _: r.created_ns,
    "size": lambda r, _: describe.real(r.totals.get("stored_bytes")) or 0,  # totals are metadata: any type
    "new bytes": lambda r, _: describe.real(r.totals.get("new_bytes")) or 0,
    "verified": lambda r, verified: verified or "",
}
VERIFIED_STYLE = {"ok": "green", "damaged": "bold red"}
#: Column titles other than their key; commit times show in UTC, said once in the title (80 columns fit).
TITLES = {"created": "created (UTC)"}


class RepositoryScreen(WorkerScreen):
    """Checkpoints of one repository, oldest first until sorted otherwise; the cursor starts on the newest,
    scrolled into view, so that Enter opens the latest state as ``ckptfmt.load(REPO)`` does."""

    HELP = ("Enter opens the checkpoint under the cursor. Space marks it; with two marked, d compares them "
            "(older as A). s sorts by the next column, or click a header; again reverses. v verifies every "
            "checkpoint and fills the verified column. a opens the run's analytics: step times per rank, "
            "stragglers, save timeline.")

    DEFAULT_CSS = """
    RepositoryScreen #summary { padding: 0 1; }
    RepositoryScreen #checkpoints { height: 1fr; }
    """
    # The footer fits 80 columns; the help screen (?) shows each key's longer tooltip.
    BINDINGS = [
        Binding("space", "mark", "Mark", tooltip="Mark for diff (the two latest marks)"),
        Binding("d", "diff", "Diff", tooltip="Diff the two marked checkpoints"),
        Binding("v", "verify", "Verify", tooltip="Verify every checkpoint"),
        Binding("s", "sort", "Sort", tooltip="Sort by the next column (again: reverse)"),
        Binding("a", "analytics", "Analytics", tooltip="Run analytics: step times, stragglers, saves, health"),
    ]

    def __init__(self, url: str, repo: Repository, records: list[CommitRecord]) -> None:
        """``records``: the repository's committed checkpoints, listed by whoever opened it."""
        super().__init__()
        self.url = url.rstrip("/")
        self.repo, self.records = repo, records
        self.marked: list[str] = []
        self.sort_column, self.sort_reverse = "created", False
        self.sub_title = self.url

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Repository {self.url}: {len(self.records)} checkpoints. Enter opens one; space marks two "
                     "to diff (d).", id="summary", markup=False)
        yield ErrorPanel()
        yield RowTable(id="checkpoints", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("", key="mark", width=1)
        for label in SORT_KEYS:
            table.add_column(label, key=label)
        self._fill()
        if self.records:
            newest = max(reversed(self.records), key=lambda r: r.created_ns)  # the last of equal times
            table.move_cursor(row=table.get_row_index(newest.name))

    def on_screen_resume(self) -> None:
        """Coming back from a verify: show its outcome in the verified column."""
        if self.records:
            self._fill()

    def checkpoint_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _fill(self) -> None:
        """(Re)write the table's rows in the current sort order, keeping the cursor on its checkpoint."""
        table = self.query_one(DataTable)
        current = self._current_name()
        verified = {r.name: self.app.verified.get(self.checkpoint_url(r.name)) for r in self.records}
        key = SORT_KEYS[self.sort_column]
        records = sorted(self.records, key=lambda r: key(r, verified[r.name]), reverse=self.sort_reverse)
        table.clear()
        for r in records:
            status = verified[r.name]
            table.add_row(
                "*" if r.name in self.marked else "", r.name, "-" if r.step is None else str(r.step),
                human_time(r.created_ns).removesuffix(" UTC"),
                Text(human_bytes(r.totals.get("stored_bytes")), justify="right"),
                Text(human_bytes(r.totals.get("new_bytes")), justify="right"),
                Text(status or "not verified", style=VERIFIED_STYLE.get(status, "dim")),
                key=r.name,
            )
        for label in SORT_KEYS:
            arrow = (" ▼" if self.sort_reverse else " ▲") if label == self.sort_column else ""
            table.columns[label].label = Text(TITLES.get(label, label) + arrow)
        if current is not None:
            table.move_cursor(row=table.get_row_index(current))

    def _current_name(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def sort_by(self, column: str) -> None:
        """Sort by ``column``; sorting by the same column again reverses the order."""
        self.sort_column, self.sort_reverse = column, (not self.sort_reverse if column == self.sort_column else False)
        self._fill()

    def action_sort(self) -> None:
        """Sort by the next column."""
        labels = list(SORT_KEYS)
        self.sort_by(labels[(labels.index(self.sort_column) + 1) % len(labels)])

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        if event.column_key.value in SORT_KEYS:
            self.sort_by(event.column_key.value)

    def action_select_row(self) -> None:
        """Enter: open the checkpoint under the cursor; what is typed while its manifest is read is meant for it."""
        name = self._current_name()
        if name is not None:
            self.app.hold_keys()
            self.open_checkpoint(name)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """A click on the row under the cursor opens it, as Enter does."""
        self.action_select_row()

    @work(thread=True, exclusive=True, exit_on_error=False, group="open")
    def open_checkpoint(self, name: str) -> None:
        """Read the checkpoint's manifest off the UI thread, then show it."""
        reader = Checkpoint(self.repo, name)
        self.app.call_from_thread(self.app.push_screen, CheckpointScreen(reader, self.checkpoint_url(name)))

    def action_mark(self) -> None:
        """Mark or unmark the checkpoint under the cursor; the two latest marks are diffed."""
        name = self._current_name()
        if name is None:
            return
        if name in self.marked:
            self.marked.remove(name)
        else:
            self.marked = (self.marked + [name])[-2:]
        self._fill()

    def action_diff(self) -> None:
        if len(self.marked) != 2:
            self.notify("Mark two checkpoints with space first.", severity="warning")
            return
        created = {r.name: r.created_ns for r in self.records}
        older, newer = sorted(self.marked, key=lambda n: created.get(n, 0))
        self.app.push_screen(DiffScreen(self.checkpoint_url(older), self.checkpoint_url(newer)))

    def action_analytics(self) -> None:
        self.app.push_screen(RunScreen(self.url))

    def action_verify(self) -> None:
        names = [r.name for r in self.records]
        self.app.push_screen(VerifyScreen(self.url, {n: self.checkpoint_url(n) for n in names}))
