"""Text for people, fitted to where it goes: every ``ckptfmt`` command, the core CLI's and the converters',
writes through an ``Output``.

A terminal gets styled lines that fit its width: a table's key (a tensor key, a
checkpoint name) moves to a line of its own when the other columns need the
room, other names are shortened in the middle, prose wraps between values,
never inside one: a size ('996.5 KiB'), a shape ('(10, 256)'), a date or a
number stays whole on one line; a path wider than the line is printed whole on a
line of its own (the one kind of line that may overflow the terminal: a user
copies it to act on it). A pipe or a file gets plain lines: one record
per line, every value whole, no trailing spaces, no escape codes, no box
drawing. ``--json`` output is printed as is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

#: What a column's cells hold, which decides how they fit a terminal (see ``Column``).
KEY, NAME, VALUE, TEXT = "key", "name", "value", "text"

#: Spaces between columns, and before a wrapped line's continuation.
_GAP = _INDENT = 2
#: The least width a shortened name or wrapped text column is given in a terminal; a key column narrower than
#: ``_MIN_KEY`` gives up its room and every key goes on a line of its own.
_MIN_NAME, _MIN_TEXT, _MIN_KEY = 24, 24, 16
#: Into a pipe, text columns are aligned up to this width; a longer cell pushes the rest of its row right
#: (one long metadata value must not push every row's next column hundreds of columns out).
_PIPE_TEXT_ALIGN = 40

#: A word that is a number (or a date, a time, a tuple's first number) and ends no phrase (no ',' or ':' after
#: it): the word after it (its unit, the time of a date) stays on its line.
_NUMBER_WORD = re.compile(r"[(\[]?[-+]?\d(?:[\d.:-]*\d)?")
#: A shape or tuple of numbers, '(10, 256)': never broken.
_TUPLE = re.compile(r"\((?:[-+]?\d+, )+[-+]?\d*,?\)")


@dataclass(frozen=True)
class Column:
    """A table column: its header, what its cells hold, and whether they align right (numbers).

    ``kind``: KEY, the row's identity (first column), kept whole and moved to a line of its own when the
    row needs the room; NAME, a name shortened in the middle when the room is short; VALUE, a number,
    size, shape or date, always whole on one line; TEXT, prose wrapped between values.
    """

    header: str
    kind: str = VALUE
    right: bool = False
    style: str = ""


def shorten(name: str, width: int) -> str:
    """``name`` in at most ``width`` cells: its start and end, an ellipsis for its middle."""
    if cell_len(name) <= width:
        return name
    if width <= 1:
        return "…"[:width]
    head_cells = (width - 1) // 2
    head = _prefix(name, head_cells)
    tail = _prefix(name[::-1], width - 1 - cell_len(head))[::-1]
    return f"{head}…{tail}"


def _prefix(text: str, cells: int) -> str:
    """The longest start of ``text`` that takes at most ``cells`` cells."""
    taken = 0
    for index, char in enumerate(text):
        taken += cell_len(char)
        if taken > cells:
            return text[:index]
    return text


def _pieces(plain: str) -> list[tuple[int, int]]:
    """(start, end) of the parts of ``plain`` a line may not break inside: words, with a number kept with
    the word after it ('996.5 KiB', '12 changed') and a tuple of numbers kept whole."""
    protected = {m.start() + i for m in _TUPLE.finditer(plain) for i, char in enumerate(m.group()) if char == " "}
    pieces: list[tuple[int, int]] = []
    glue = False
    for word in re.finditer(r"\S+", plain):
        if pieces and (glue or word.start() - 1 in protected):
            pieces[-1] = (pieces[-1][0], word.end())
        else:
            pieces.append((word.start(), word.end()))
        glue = _NUMBER_WORD.fullmatch(word.group()) is not None
    return pieces


def wrap(text: str | Text, width: int, indent: int = 0) -> list[Text]:
    """``text`` as lines of at most ``width`` cells, broken only between values; continuation lines are
    indented by ``indent``. A part longer than a line is shortened in the middle (a long name), or, a path,
    left whole on a line of its own."""
    text = Text(text) if isinstance(text, str) else text
    lines: list[Text] = []
    line = Text()
    for start, end in _pieces(text.plain):
        piece = text[start:end]
        room = width - (indent if lines else 0)
        if line.plain and cell_len(line.plain) + 1 + piece.cell_len <= room:
            line.append(" ")
            line.append_text(piece)
            continue
        if line.plain:
            lines.append(line)
            room = width - indent
        whole = piece.cell_len <= room or is_path(piece.plain)
        line = piece if whole else Text(shorten(piece.plain, room), style=_style_at(piece))
    lines.append(line)
    return [lines[0], *(Text(" " * indent) + line for line in lines[1:])]


def is_path(word: str) -> bool:
    """Whether a word is a path or URL (a chunk's, a checkpoint's): something a user copies to act on,
    so printed whole on a line of its own, wider than the terminal if it must be, never shortened."""
    return "/" in word.strip("'\"(),:;")


def _style_at(text: Text) -> str:
    """The style of a piece's first character, kept when the piece is shortened."""
    return next((str(span.style) for span in text.spans if span.start == 0), str(text.style))


class Output:
    """A command's stdout (or the CLI's stderr): prose lines and tables, fitted to a terminal's width or
    written as plain lines into a pipe (see the module's docstring)."""

    def __init__(self, console: Console):
        self.console = console
        self.terminal = console.is_terminal
        self._printed = False

    @property
    def width(self) -> int | None:
        """The terminal's width; None into a pipe (lines are as long as their record)."""
        return self.console.width if self.terminal else None

    def line(self, text: str | Text = "") -> None:
        """One record of prose; in a terminal, wrapped between values (continuation lines indented)."""
        text = Text(text) if isinstance(text, str) else text
        if not self.width:
            self._emit([Text(" ".join(text.plain.splitlines()))])  # a message's line breaks too: one record
        else:
            self._emit(wrap(text, self.width, _INDENT) if text.plain else [text])

    def json(self, value: Any) -> None:
        """``value`` as indented JSON, written as is: rich's ``print_json`` highlights token by token, and
        took 2-13 s for the 126,000 lines of one hostile checkpoint's ``show --json`` (10 s for ``ls --json``
        of 10,000 checkpoints)."""
        self.console.file.write(json.dumps(value, indent=1) + "\n")
        self._printed = True

    def table(self, title: str | None, columns: Sequence[Column], rows: Iterable[Sequence[str]], *,
              header: bool = True) -> None:
        """A titled table of plain-text cells (data, never markup); a cell may hold several lines ('\\n').

        Nothing but the title is printed when there are no rows; nothing at all without a title.
        """
        cells = [[str(cell) for cell in row] for row in rows]
        if title is None and not cells:
            return
        lines = [Text()] if self._printed else []  # a blank line between sections
        if title is not None:
            lines += wrap(Text(title, style="bold"), self.width, _INDENT) if self.width else [Text(title)]
        if cells:
            head = [c.header for c in columns] if header else None
            lines += _Layout(columns, cells, head, self.width).lines()
        self._emit(lines)

    def _emit(self, lines: list[Text]) -> None:
        for line in lines:
            line.rstrip()
        self.console.print(Text("\n").join(lines), soft_wrap=True)
        self._printed = True


#: A label and its value: the fields of a record.
_LABELLED = (Column("field", style="bold"), Column("value", TEXT))


class _Layout:
    """A table's lines: into a pipe, one line per row at the columns' natural widths; into a terminal,
    at widths that fit it, or, where even the least widths do not, each row as a record of labelled lines."""

    def __init__(self, columns: Sequence[Column], rows: list[list[str]], head: list[str] | None,
                 width: int | None):
        self.columns = columns
        self.rows = rows
        self.head = head
        self.natural = [max([cell_len(line) for row in self._all_rows() for line in row[i].split("\n")])
                        for i in range(len(columns))]
        self.width = width
        self.widths = self._fit(width) if width else None

    def _all_rows(self) -> list[list[str]]:
        return ([self.head] if self.head else []) + self.rows

    def lines(self) -> list[Text]:
        width, widths = self.width, self.widths
        if width is None:
            return [Text(self._plain_row(row)) for row in self._all_rows()]
        if widths is None:
            return [line for i, row in enumerate(self.rows) for line in [Text()] * bool(i) + self._record(row, width)]
        lines = []
        if self.head:
            lines += [Text(line.plain, style="bold") for line in self._terminal_row(self.head, width, widths)]
            lines.append(Text("─" * max(line.cell_len for line in lines), style="dim"))
        for row in self.rows:
            lines += self._terminal_row(row, width, widths)
        return lines

    # -- into a pipe: one line per row --------------------------------------------------------------------
    def _plain_row(self, row: list[str]) -> str:
        cells = []
        for column, natural, cell in zip(self.columns, self.natural, row):
            width = min(natural, _PIPE_TEXT_ALIGN) if column.kind == TEXT else natural
            cells.append(_pad(cell.replace("\n", ", "), width, column.right))
        return (" " * _GAP).join(cells)

    # -- into a terminal ----------------------------------------------------------------------------------
    def _fit(self, width: int) -> list[int] | None:
        """Column widths that fit ``width``: text columns wrap and names shorten down to their least
        widths, widest first; if that is not enough, the key column gives up its room (every key on a
        line of its own). None when even that does not fit: the rows are printed as records."""
        least = [self._least(i) for i in range(len(self.columns))]
        widths = _shrink(list(self.natural), least, width)
        if _total(widths) > width and self.columns[0].kind == KEY:
            widths = [0, *_shrink(list(self.natural[1:]), least[1:], width - _GAP)]
        return widths if _total(widths) <= width else None

    def _least(self, index: int) -> int:
        column, natural = self.columns[index], self.natural[index]
        floor = {KEY: _MIN_KEY, NAME: _MIN_NAME, TEXT: _MIN_TEXT}.get(column.kind)
        if floor is None:
            return natural
        return max(cell_len(column.header) if self.head else 0, min(natural, floor))

    def _terminal_row(self, row: list[str], total: int, widths: list[int]) -> list[Text]:
        """A row's lines at column ``widths``; a key too wide for its column first, on a line of its own."""
        lines: list[Text] = []
        cells = []
        for column, width, cell in zip(self.columns, widths, row):
            if column.kind == KEY and cell_len(cell) > width:
                lines.append(Text(shorten(cell, total), style=column.style))
                cell = ""
            cells.append(self._cell_lines(column, width, cell))
        for depth in range(max(len(c) for c in cells)):
            line, paths = Text(), []
            for i, (column, width, lines_of_cell) in enumerate(zip(self.columns, widths, cells)):
                cell = lines_of_cell[depth] if depth < len(lines_of_cell) else ""
                if cell_len(cell) > width:  # a path wider than its column (``wrap``): whole, on a line of its own
                    paths.append(cell)
                    cell = ""
                line.append(" " * _GAP * bool(i))
                line.append(_pad(cell, width, column.right), style=column.style)
            if line.plain.strip() or not paths:
                lines.append(line)
            lines += [Text(" " * _INDENT + path) for path in paths]
        return lines

    def _record(self, row: list[str], total: int) -> list[Text]:
        """A row too wide for the terminal: its key on a line, then each other cell under its header."""
        keyed = self.columns[0].kind == KEY
        lines = [Text(shorten(row[0], total), style=self.columns[0].style)] if keyed else []
        labelled = [(column.header, cell.replace("\n", ", ")) for column, cell in zip(self.columns, row)][keyed:]
        indent = _GAP if keyed else 0
        fields = _Layout(_LABELLED, [list(pair) for pair in labelled], None, total - indent)
        return lines + [Text(" " * indent) + line for line in fields.lines()]

    @staticmethod
    def _cell_lines(column: Column, width: int, cell: str) -> list[str]:
        lines = cell.split("\n")
        if column.kind == TEXT:
            return [wrapped.plain for line in lines for wrapped in wrap(line, width)]
        if column.kind == NAME:
            return [shorten(line, width) for line in lines]
        return lines


def _shrink(widths: list[int], least: list[int], width: int) -> list[int]:
    """Narrow the widest column that may still narrow, one cell at a time, until the row fits ``width``."""
    while _total(widths) > width:
        narrowable = [i for i, (w, floor) in enumerate(zip(widths, least)) if w > floor]
        if not narrowable:
            break
        widths[max(narrowable, key=lambda i: widths[i])] -= 1
    return widths


def _total(widths: list[int]) -> int:
    return sum(widths) + _GAP * (len(widths) - 1)


def _pad(cell: str, width: int, right: bool) -> str:
    room = " " * max(0, width - cell_len(cell))
    return room + cell if right else cell + room
