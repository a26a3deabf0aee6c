"""What every screen shares: the one handler for failed workers, and an error panel."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Static, TabbedContent, TabPane, Tabs
from textual.worker import Worker, WorkerState

from ckptfmt.errors import CheckpointError


def describe_error(exc: BaseException) -> str:
    """One line for the user: ckptfmt errors already name what and where; others get their type."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ErrorPanel(Static):
    """A red panel that says what went wrong; hidden until an error is shown."""

    DEFAULT_CSS = """
    ErrorPanel { display: none; border: round $error; color: $text-error; padding: 0 1; height: auto; }
    ErrorPanel.shown { display: block; }
    """

    def show_error(self, message: str) -> None:
        self.update(Text(f"Error: {message}"))  # plain text: paths and messages may hold [brackets]
        self.add_class("shown")


#: One footer entry for both ("[ ] Tabs"), so that the footer fits 80 columns.
_TABS = Binding.Group("Tabs", compact=True)
TAB_BINDINGS = [
    Binding("left_square_bracket", "switch_tab(-1)", "Prev tab", key_display="[", group=_TABS),
    Binding("right_square_bracket", "switch_tab(1)", "Next tab", key_display="]", group=_TABS),
]


class RowTable(DataTable):
    """A table whose Enter runs its screen's ``select_row`` action: DataTable's own Enter posts a message
    that its screen handles later, after the keys typed next have reached the screen still showing."""

    BINDINGS = [Binding("enter", "screen.select_row", "Select", show=False)]


class WorkerScreen(Screen):
    """A screen whose workers run with ``exit_on_error=False``; their failures land here.

    Every read (storage, manifests, tensors) runs in a thread worker, so a
    damaged chunk, a missing checkpoint or absent credentials become a
    notification and an error panel instead of a traceback.

    A key that switches screens does so in its binding's action, so that the
    keys typed after it are held for the new screen (``CheckpointApp.hold_keys``).
    """

    BINDINGS = [Binding("escape", "back", "Back")]

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Back is offered (and shown in the footer) only where there is a screen to go back to (the
        opening screen at the bottom of the stack does not count)."""
        stack = self.app.screen_stack
        return action != "back" or (self in stack and stack.index(self) > 1)

    def action_back(self) -> None:
        """Escape: back to the screen below."""
        self.app.action_back()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR and event.worker.error is not None:
            self.show_failure(event.worker.error)

    def action_switch_tab(self, step: int) -> None:
        """Show the previous or next tab of the screen's TabbedContent (bound where a screen has one).

        Focus goes to the tab bar first: a focused widget left inside the old,
        now hidden, pane would pull that pane back.
        """
        tabs = self.query_one(TabbedContent)
        tabs.query_one(Tabs).focus()
        panes = [pane.id for pane in tabs.query(TabPane)]
        tabs.active = panes[(panes.index(tabs.active) + step) % len(panes)]

    def show_failure(self, exc: BaseException) -> None:
        """Say what failed; keys typed ahead for a screen that could not open are dropped with it."""
        self.app.discard_keys()
        message = describe_error(exc)
        self.notify(message, title="error", severity="error", timeout=15, markup=False)
        for panel in self.query(ErrorPanel):
            panel.show_error(message)
