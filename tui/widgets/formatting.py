"""Text formatting for the TUI: the core's (ckptfmt.tools.formatting), plus key paths and counts."""

from __future__ import annotations

import re
from functools import partial

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

from ckptfmt.tools.formatting import human_bytes, number, seconds, shape_text
from ckptfmt.tools.formatting import human_time as _human_time
from ckptfmt.tools.output import shorten

__all__ = ["KeyText", "human_bytes", "human_time", "number", "seconds", "shape_text", "shorten_key", "split_key",
           "tensor_count", "wrap_key"]

_SEPARATORS = re.compile(r"[/.]")
#: A key's names, each with the separator after it: 'model/', 'h.', '11.', 'weight'.
_KEY_PIECES = re.compile(r"[^/.]*[/.]|[^/.]+")

#: Commit times in UTC, the same on every machine (the CLI prints local time).
human_time = partial(_human_time, utc=True)


def split_key(key: str) -> list[str]:
    """A tensor key's name path: 'model/layers.0.attn.weight' -> model, layers, 0, attn, weight."""
    return [part for part in _SEPARATORS.split(key) if part] or [key]


def tensor_count(n: int) -> str:
    return f"{n} tensor{'s' * (n != 1)}"


def wrap_key(key: str, width: int) -> str:
    """``key`` in lines of at most ``width`` cells, broken only after a separator ('/', '.') so that no
    name in it is split; a single name longer than a line stays whole (its renderer folds it)."""
    lines = [""]
    for piece in _KEY_PIECES.findall(key):
        if lines[-1] and cell_len(lines[-1] + piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def shorten_key(key: str, width: int) -> str:
    """``key`` in at most ``width`` cells: its first name, '…' and as many of its last names as fit
    ('model/…h.11.mlp.c_proj.weight'), so that where it lives, its layer and its own name stay; shortened
    in the middle where not even its last name fits."""
    if cell_len(key) <= width:
        return key
    pieces = _KEY_PIECES.findall(key)
    head, tail = pieces[0] + "…", ""
    for piece in reversed(pieces[1:]):
        if cell_len(head + piece + tail) > width:
            break
        tail = piece + tail
    return head + tail if tail else shorten(key, width)


class KeyText:
    """A tensor key that wraps at whatever width it is drawn, only after its separators (``wrap_key``)."""

    def __init__(self, key: str, style: str = "") -> None:
        self.key, self.style = key, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(wrap_key(self.key, options.max_width), style=self.style, overflow="fold")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max(cell_len(piece) for piece in _KEY_PIECES.findall(self.key) or [self.key])
        return Measurement(min(longest, options.max_width), min(cell_len(self.key), options.max_width))
