"""The application: opens a repository, a checkpoint, or two checkpoints to compare.

``main(targets)`` runs it; ``create_app(targets)`` builds it for tests. The
first screen opens the target in a worker thread, then pushes the repository,
checkpoint or diff screen over itself; where that fails it shows why.

Keys typed while a screen opens are held, then sent to that screen (see
``CheckpointApp.hold_keys``): a terminal delivers ``Enter ]`` faster than a
checkpoint's manifest is read, and the ``]`` is meant for the checkpoint.
"""

from __future__ import annotations

import sys

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from ckptfmt.errors import CheckpointNotFoundError
from ckptfmt.loading.checkpoint import Checkpoint
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
            self.app.hold_keys()
            self.open_target(self.targets[0])

    @work(thread=True, exclusive=True, exit_on_error=False)
    def open_target(self, target: str) -> None:
        """A repository URL opens its table of checkpoints, listed here so that the keys typed meanwhile find
        them; anything else is read as a checkpoint."""
        options = self.app.storage_options
        try:
            repo = Repository.open(target, options)
        except CheckpointNotFoundError:
            reader = Checkpoint.open(target, storage_options=options)
            self.app.call_from_thread(self.app.push_screen, CheckpointScreen(reader, target))
        else:
            screen = RepositoryScreen(target, repo, repo.commits())
            self.app.call_from_thread(self.app.push_screen, screen)
            if self.app.compare_with is not None:  # ckptfmt tui RUN --compare RUN_B: straight to the comparison
                self.app.call_from_thread(self.app.push_screen, RunScreen(target, self.app.compare_with))


#: Keys that act at once, even while keys are held: quitting never waits for a screen to open.
IMMEDIATE_KEYS = frozenset({"q", "ctrl+q"})


class CheckpointApp(App):
    """Browse, verify and compare ckptfmt checkpoints."""

    TITLE = "ckptfmt"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
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
        self._held_keys: list[events.Key] | None = None

    def get_default_screen(self) -> OpenScreen:
        return OpenScreen(self.targets)

    def on_mount(self) -> None:
        self.screen_change_signal.subscribe(self, self._screen_changed, immediate=True)

    async def on_event(self, event: events.Event) -> None:
        """Hold the keys that come back from the focused widget while keys are held; the rest as Textual does.

        Keys are held where Textual resolves their bindings: after the focused widget has seen them, in the
        order typed, and after the key whose binding started the screen switch."""
        if (self._held_keys is not None and isinstance(event, events.Key) and event.is_forwarded
                and event.key not in IMMEDIATE_KEYS):
            self._held_keys.append(events.Key(event.key, event.character))
            return
        await super().on_event(event)

    def hold_keys(self) -> None:
        """Keep the keys typed from now on for the screen being opened, until ``release_keys``.

        Without this they reach the screen still showing (a screen read in a worker thread is pushed
        later), or the new screen before it has set its focus, where its widgets cannot take them."""
        if self._held_keys is None:
            self._held_keys = []

    def release_keys(self) -> None:
        """Send the held keys, in the order typed, to the screen now showing."""
        held, self._held_keys = self._held_keys or [], None
        for key in held:
            self.post_message(key)

    def discard_keys(self) -> None:
        """Forget the held keys: the screen they were typed for could not be opened."""
        self._held_keys = None

    def _screen_changed(self, screen: Screen) -> None:
        """A screen was pushed, popped or switched to: hold keys until it has mounted, focused and drawn."""
        self.hold_keys()
        screen.call_after_refresh(self.release_keys)

    def action_help(self) -> None:
        """Show the keys of this screen and of the app (as in the footer), and the screen's HELP text."""
        if not isinstance(self.screen, HelpScreen):
            bindings = [(b.binding.key_display or b.binding.key, b.binding.tooltip or b.binding.description)
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
