"""Driving the Textual app in tests: the terminal size, reading a widget's text or a table's cells,
waiting for workers to settle, and running an async Pilot test from a plain pytest function."""

from __future__ import annotations

import asyncio
import functools
import io

from rich.console import Console
from textual.worker import WorkerFailed

SIZE = (120, 40)


def text_of(app, selector: str) -> str:
    """The plain text a Static shows (its content rendered by rich, 1000 columns wide)."""
    console = Console(width=1000, record=True, file=io.StringIO())
    console.print(app.screen.query_one(selector).content)
    return console.export_text()


def cells(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def async_test(function):
    """Run an async test body with asyncio.run (the suite has no asyncio plugin for pytest)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        asyncio.run(function(*args, **kwargs))
    return wrapper


async def settle(app, pilot) -> None:
    """Wait for every worker (of every screen) and for the UI to process what they posted."""
    for _ in range(3):
        try:
            await app.workers.wait_for_complete()
        except WorkerFailed:  # the app shows the failure; tests check how
            pass
        await pilot.pause()
