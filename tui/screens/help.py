"""The '?' help screen: the keys active where it was opened, and what the screen is for."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


class HelpScreen(ModalScreen):
    """A modal list of (key, what it does) and the screen's HELP; any of escape, q or ? closes it."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 64; height: auto; max-height: 100%; border: round $accent; background: $surface; padding: 1 2;
    }
    HelpScreen #help-text { margin-top: 1; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, bindings: list[tuple[str, str]], text: str) -> None:
        super().__init__()
        self.key_help = bindings
        self.text = text

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 3))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, description in self.key_help:
            table.add_row(key, description)
        with VerticalScroll():  # scrolls where the terminal is lower than the help
            yield Static("[b]Keys[/b]")
            yield Static(table, id="help-keys")
            yield Static(self.text, id="help-text", markup=False)  # "[ and ]" is text
