"""Plain-text formatting of sizes, times, shapes and numbers, shared by the CLI and the TUI.

Every function takes whatever a checkpoint's metadata holds (metadata is never
validated, spec section 9) and returns text: a value of an unexpected type is
shown as it is, never raised on.
"""

from __future__ import annotations

import datetime
import math
from typing import Any


def _real(value: object) -> float | None:
    """``value`` as a number, or None for bools and non-numbers (metadata may hold anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def short(value: object, limit: int = 200) -> str:
    """``str(value)`` cut to ``limit`` characters, for values of unknown type and size."""
    text = "-" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def human_bytes(n: object) -> str:
    """1536 -> '1.5 KiB'; None -> '-'; anything that is not a number is shown as it is."""
    value = _real(n)
    if value is None:
        return short(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value} B"  # pragma: no cover - the loop returns at TiB


def human_time(created_ns: object, *, utc: bool = False) -> str:
    """A wall-clock stamp in nanoseconds as local time (the CLI) or UTC (the TUI: the same everywhere)."""
    value = _real(created_ns)
    if not value:
        return short(created_ns) if created_ns else "-"
    try:
        if utc:
            stamp = datetime.datetime.fromtimestamp(value / 1e9, tz=datetime.timezone.utc)
            return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")
        return datetime.datetime.fromtimestamp(value / 1e9).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # a year beyond 9999, a negative stamp on some platforms
        return f"{created_ns} ns"


def shape_text(shape: object) -> str:
    """(512, 256) -> '(512, 256)'; None -> '-'."""
    if shape is None:
        return "-"
    if isinstance(shape, (list, tuple)):
        return "(" + ", ".join(str(d) for d in shape) + ")"
    return short(shape)


def number(value: object) -> str:
    """Four significant digits; None -> '-'."""
    real = _real(value)
    return f"{real:.4g}" if real is not None else short(value)


def seconds(value: object) -> str:
    """A duration: milliseconds below 10 s, seconds above."""
    real = _real(value)
    if real is None:
        return short(value)
    return f"{real * 1000:.1f} ms" if real < 10 else f"{real:.1f} s"


def text(value: Any, default: str = "-") -> str:
    """A metadata leaf as text; None (absent) as ``default``."""
    return default if value is None else short(value)


def words(value: Any) -> str:
    """A value as a reader says it, not as Python prints it: yes/no, - for nothing, NaN and Inf, lists and
    maps spelt out (the report's tables, compare's a and b in the CLI and the TUI)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    if isinstance(value, (list, tuple)):
        return ", ".join(words(item) for item in value) or "(none)"
    if isinstance(value, dict):
        return ", ".join(f"{key}: {words(item)}" for key, item in value.items()) or "(none)"
    return str(value)


def step_range(first: int, last: int) -> str:
    """Steps ``first`` to ``last`` as text: ``4-7``, and one step as itself, ``12``."""
    return str(first) if first == last else f"{first}-{last}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 checkpoint', '3 checkpoints': a count with its noun, plural unless it is one (``plural`` where
    adding an s is wrong: 'entries')."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


__all__ = ["counted", "human_bytes", "human_time", "number", "seconds", "shape_text", "short", "step_range",
           "text", "words"]


def world_sizes(sizes: Any) -> str:
    """A resume's world sizes then and now: ``4``, or ``4 to 2`` where it changed; ``-`` unknown."""
    sizes = list(sizes or [])
    return "-" if not sizes else str(sizes[0]) if len(set(sizes)) == 1 else " to ".join(map(str, sizes))
