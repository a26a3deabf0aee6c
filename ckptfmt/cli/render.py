"""Formatting helpers shared by the CLI commands (sizes, times, shapes)."""

from __future__ import annotations

import datetime

from rich import box
from rich.table import Table


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_time(created_ns: int | None) -> str:
    if not created_ns:
        return "-"
    stamp = datetime.datetime.fromtimestamp(created_ns / 1e9).astimezone()
    return stamp.strftime("%Y-%m-%d %H:%M:%S")


def shape_text(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")" if shape is not None else "-"


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def new_table(title: str, **options) -> Table:
    """A table in the CLI's style: light borders, so more width goes to keys and names."""
    return Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", **options)
