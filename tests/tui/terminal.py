"""Driving the TUI as a terminal does: the screen's text as a user sees it, keys typed faster than the app
handles them, a tensor's node in the tree, and the snapshot helpers (pytest-textual-snapshot)."""

from __future__ import annotations

import html
import re

import pytest
from textual import events
from textual.worker import WorkerFailed

#: The terminal of many users: the size every screen must work at.
SMALL = (80, 24)

#: A key's character, where it has one that is not its name.
_CHARACTERS = {"enter": "\r", "escape": "\x1b", "space": " ", "right_square_bracket": "]",
               "left_square_bracket": "[", "question_mark": "?", "slash": "/"}
#: One run of text in an exported screenshot: its x (cells of _CELL_X) and row.
_SVG_TEXT = re.compile(r'<text [^>]*?x="([\d.]+)"[^>]*?clip-path="url\(#terminal-(?:\d+-)?line-(\d+)\)">([^<]*)</text>')
#: The width of a cell in rich's SVG export (its font size, 20, times 0.61).
_CELL_X = 12.2

try:
    import pytest_textual_snapshot  # noqa: F401
except ImportError:  # pragma: no cover - an optional test dependency
    HAVE_SNAPSHOTS = False
else:
    HAVE_SNAPSHOTS = True
snapshot = pytest.mark.skipif(not HAVE_SNAPSHOTS, reason="pytest-textual-snapshot is not installed")


def screen_lines(app) -> list[str]:
    """The rows of the terminal as the user sees them (read from the app's SVG screenshot, which
    snapshots compare), trailing spaces removed."""
    width, height = app.size
    rows = [[" "] * width for _ in range(height)]
    for x, row, text in _SVG_TEXT.findall(app.export_screenshot()):
        column = round(float(x) / _CELL_X)
        for offset, char in enumerate(html.unescape(text).replace("\xa0", " ")):  # spaces are exported as &#160;
            if column + offset < width:
                rows[int(row)][column + offset] = char
    return ["".join(row).rstrip() for row in rows]


def region_lines(app, widget) -> list[str]:
    """The rows of the terminal within ``widget``'s content (less its scrollbars), as the user sees them."""
    region = widget.scrollable_content_region
    lines = [line.ljust(region.right) for line in screen_lines(app)]
    return [line[region.x:region.right].rstrip() for line in lines[region.y:region.bottom]]


def find_node(tree, key: str):
    """The tree node of tensor ``key`` among the nodes built so far."""
    pending = list(tree.root.children)
    while pending:
        node = pending.pop()
        if node.data.tensor == key:
            return node
        pending.extend(node.children)
    raise AssertionError(f"{key} is not in the tree")


def type_ahead(app, *keys: str) -> None:
    """Send ``keys`` at once, as a terminal delivers keys typed faster than the app handles them (Pilot's
    ``press`` waits for the app after each key, which hides what such typing meets)."""
    for key in keys:
        app.post_message(events.Key(key, _CHARACTERS.get(key, key if len(key) == 1 else None)))


async def wait_for_workers(pilot) -> None:
    for _ in range(3):
        try:
            await pilot.app.workers.wait_for_complete()
        except WorkerFailed:
            pass
        await pilot.pause()


def pressing(*keys: str):
    """A run_before for snap_compare: wait for the app's workers, press keys, wait again."""
    async def run_before(pilot) -> None:
        await wait_for_workers(pilot)
        for key in keys:
            await pilot.press(key)
            await wait_for_workers(pilot)
    return run_before
