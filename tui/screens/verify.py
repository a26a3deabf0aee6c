"""The verify screen: a progress bar with throughput and ETA, then the damage found, if any.

``ckptfmt.tools.verify`` reports progress to an fsspec ``Callback`` from its reader
threads; this screen polls that counter ten times a second instead of being
called from those threads.
"""

from __future__ import annotations

import threading
import time

from fsspec.callbacks import Callback
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Header, ProgressBar, Static

from ckptfmt.tools.verify import VerifyReport, verify
from ckptfmt.tui.screens.base import ErrorPanel, RowTable, WorkerScreen
from ckptfmt.tui.widgets.formatting import human_bytes


class ByteCounter(Callback):
    """Thread-safe totals of bytes to check and bytes checked; read by the screen's timer."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def set_size(self, size) -> None:
        with self._lock:
            self.size = size

    def relative_update(self, inc=1) -> None:
        with self._lock:
            self.value += inc


class VerifyScreen(WorkerScreen):
    """Verify a checkpoint or a whole repository; Escape cancels a running verify, then goes back."""

    HELP = ("Every chunk is read once and hashed with BLAKE3. Escape cancels while running; the table lists "
            "each damaged or missing chunk with the tensors it damages.")

    DEFAULT_CSS = """
    VerifyScreen #title, VerifyScreen #rate, VerifyScreen #result { padding: 0 1; }
    VerifyScreen #progress { margin: 1 1 0 1; }
    VerifyScreen #problems { height: 1fr; display: none; }
    VerifyScreen #problems.shown { display: block; }
    """
    BINDINGS = [
        Binding("escape", "back", "Cancel / back"),
        Binding("enter", "select_row", "Back"),
    ]

    def __init__(self, url: str, checkpoints: dict[str, str]) -> None:
        """``checkpoints`` maps the names verified to their URLs, to record each one's outcome."""
        super().__init__()
        self.url = url
        self.checkpoints = checkpoints
        self.counter = ByteCounter()
        self.cancel = threading.Event()
        self.started = 0.0
        self.report: VerifyReport | None = None
        self.sub_title = f"verify {url}"

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Verifying {self.url}", id="title", markup=False)
        yield ProgressBar(id="progress", show_eta=False)
        yield Static("", id="rate")
        yield ErrorPanel()
        yield Static("", id="result")
        yield RowTable(id="problems", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for column in ("checkpoint", "problem", "chunk", "tensors", "detail"):
            table.add_column(column, key=column)
        self.started = time.perf_counter()
        self._poll = self.set_interval(0.1, self._tick)
        self.run_verify()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def run_verify(self) -> None:
        try:
            report = verify(self.url, storage_options=self.app.storage_options, callback=self.counter,
                            cancel=self.cancel)
        finally:
            self.app.call_from_thread(self._poll.stop)
        self.app.call_from_thread(self._finish, report)

    def _tick(self) -> None:
        """Show bytes checked, bytes per second and the time left."""
        size, done = self.counter.size, self.counter.value
        if size is None:
            return
        self.query_one(ProgressBar).update(total=max(size, 1), progress=done)
        elapsed = time.perf_counter() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(size - done) / rate:.0f} s" if rate > 0 else "-"
        self.query_one("#rate", Static).update(
            f"{human_bytes(done)} of {human_bytes(size)}  {human_bytes(rate)}/s  ETA {eta}"
        )

    def _finish(self, report: VerifyReport) -> None:
        self.report = report
        self._tick()
        if not report.cancelled:  # a cancelled verify proves nothing
            for name, url in self.checkpoints.items():
                damaged = any(p.checkpoint == name for p in report.problems)
                self.app.verified[url] = "damaged" if damaged else "ok"
        self.query_one("#result", Static).update(outcome(report))
        self.refresh_bindings()  # Enter now goes back
        if report.problems:
            self._show_problems(report)

    def _show_problems(self, report: VerifyReport) -> None:
        """List each damaged or missing chunk; the table shows only then (an intact verify has none)."""
        table = self.query_one(DataTable)
        for p in report.problems:
            table.add_row(p.checkpoint, p.kind, (p.chunk or "-")[:16], "\n".join(p.tensors) or "-", p.message,
                          height=max(1, len(p.tensors)))
        table.add_class("shown")
        table.focus()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Enter goes back once the verify has ended (a verify always has a screen below it)."""
        return action != "select_row" or self.report is not None

    def action_back(self) -> None:
        """Cancel a running verify; once it has ended, go back."""
        if self.report is None:
            self.cancel.set()
            self.query_one("#title", Static).update(f"Cancelling verify of {self.url} ...")
        else:
            super().action_back()

    def action_select_row(self) -> None:
        """Enter, on the problems or anywhere: go back."""
        super().action_back()


def outcome(report: VerifyReport) -> Text:
    """The verify's result in a line: cancelled, OK, or the damaged tensors."""
    rate = report.bytes_checked / report.seconds if report.seconds else 0.0
    summary = (f"{len(report.checkpoints)} checkpoint(s), {report.chunks_checked} chunks, "
               f"{human_bytes(report.bytes_checked)} in {report.seconds:.2f} s ({human_bytes(rate)}/s)")
    if report.cancelled:
        return Text(f"CANCELLED after {summary}", style="bold yellow")
    if report.ok:
        return Text(f"OK: {summary}", style="bold green")
    return Text(f"DAMAGED: {len(report.problems)} problem(s); damaged tensors: "
                f"{', '.join(report.damaged_tensors) or '-'}", style="bold red")
