"""The application: opens a repository, a checkpoint, or two checkpoints to compare.

``main(targets)`` runs it; ``create_app(targets)`` builds it for tests. The
first screen opens the target in a worker thread, then pushes the repository,
checkpoint or diff screen over itself; where that fails it shows why.
"""

from __future__ import annotations

import sys

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Footer, Header, Static

from ckptfmt.errors import CheckpointNotFoundError
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.repository.repository import Repository
from ckptfmt.tui.screens.base import ErrorPanel, WorkerScreen
from ckptfmt.tui.screens.checkpoint import CheckpointScreen
from ckptfmt.tui.screens.diff import DiffScreen
from ckptfmt.tui.screens.help import HelpScreen
from ckptfmt.tui.screens.repository import RepositoryScreen
from ckptfmt.tui.screens.run import RunScreen


class OpenScreen(WorkerScreen):
    """The bottom screen: 'opening TARGET', then the real screen on top, or the error."""

    HELP = "ckptfmt tui TARGET opens a repository or a checkpoint; ckptfmt tui A B compares two checkpoints."

    def __init__(self, targets: list[str]) -> None:
        super().__init__()
        self.targets = targets

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield Static(f"Opening {' and '.join(self.targets)} ...", id="opening", markup=False)
            yield ErrorPanel()
        yield Footer()

    def on_mount(self) -> None:
        if len(self.targets) == 2:
            self.app.push_screen(DiffScreen(*self.targets))
        else:
            self.open_target(self.targets[0])

    @work(thread=True, exclusive=True, exit_on_error=False)
    def open_target(self, target: str) -> None:
        """A repository URL opens its table of checkpoints; anything else is read as a checkpoint."""
        options = self.app.storage_options
        try:
            Repository.open(target, options)
        except CheckpointNotFoundError:
            reader = CheckpointReader(target, storage_options=options)
            self.app.call_from_thread(self.app.push_screen, CheckpointScreen(reader, target))
        else:
            self.app.call_from_thread(self.app.push_screen, RepositoryScreen(target))
            if self.app.compare_with is not None:  # ckptfmt tui RUN --compare RUN_B: straight to the comparison
                self.app.call_from_thread(self.app.push_screen, RunScreen(target, self.app.compare_with))


class CheckpointApp(App):
    """Browse, verify and compare ckptfmt checkpoints."""

    TITLE = "ckptfmt"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("escape", "back", "Back"),
    ]

    def __init__(self, targets: list[str], storage_options: dict | None = None,
                 compare_with: str | None = None, min_delay: float | None = None) -> None:
        if len(targets) not in (1, 2):
            raise ValueError(f"give one target (a repository or checkpoint) or two to compare, not {len(targets)}")
        if compare_with is not None and len(targets) != 1:
            raise ValueError("--compare takes one run (a repository) to compare with the target run")
        if min_delay is not None and not min_delay >= 0:
            raise ValueError(f"--min-delay must be 0 or more seconds, not {min_delay}")
        super().__init__()
        self.targets = list(targets)
        self.storage_options = storage_options
        self.compare_with = compare_with
        self.min_delay = min_delay  # the run screen's least reported straggler delay (None: the default)
        self.verified: dict[str, str] = {}  # checkpoint URL -> "ok" or "damaged", from verifies run in this session

    def get_default_screen(self) -> OpenScreen:
        return OpenScreen(self.targets)

    def action_help(self) -> None:
        """Show the keys of this screen and of the app (as in the footer), and the screen's HELP text."""
        if not isinstance(self.screen, HelpScreen):
            bindings = [(b.binding.key_display or b.binding.key, b.binding.description)
                        for b in self.active_bindings.values()
                        if b.binding.show and b.binding.description and b.node in (self, self.screen)]
            self.push_screen(HelpScreen(bindings, self.screen.HELP or ""))

    def action_back(self) -> None:
        """Close the current screen, keeping the first real one (the opening screen lies below it)."""
        if len(self.screen_stack) > 2:
            self.pop_screen()


def create_app(targets: list[str], storage_options: dict | None = None,
               compare_with: str | None = None, min_delay: float | None = None) -> CheckpointApp:
    """The app for ``targets``: one repository or checkpoint URL, or two checkpoints to diff; with
    ``compare_with``, the run screen comparing the target run with that one; ``min_delay``: the least
    straggler delay the run screen reports, in seconds."""
    return CheckpointApp(targets, storage_options, compare_with, min_delay)


def main(targets: list[str], storage_options: dict | None = None, compare_with: str | None = None,
         min_delay: float | None = None) -> int:
    """Run the TUI until the user quits; returns the exit code (2 for bad arguments)."""
    try:
        app = create_app(targets, storage_options, compare_with, min_delay)
    except ValueError as exc:
        print(f"ckptfmt tui: error: {exc}", file=sys.stderr)  # noqa: T201 - before the app runs: one line
        return 2
    app.run()
    return app.return_code or 0
