"""Text formatting for the TUI; sizes, shapes and numbers are shared with the CLI."""

from __future__ import annotations

import datetime
import re

from ...cli.render import human_bytes, number, shape_text

__all__ = ["human_bytes", "human_time", "number", "seconds", "shape_text", "split_key", "tensor_count"]

_SEPARATORS = re.compile(r"[/.]")


def split_key(key: str) -> list[str]:
    """A tensor key's name path: 'model/layers.0.attn.weight' -> model, layers, 0, attn, weight."""
    return [part for part in _SEPARATORS.split(key) if part] or [key]


def human_time(created_ns: int | None) -> str:
    """A commit time in UTC, the same on every machine (the CLI prints local time)."""
    if not created_ns:
        return "-"
    stamp = datetime.datetime.fromtimestamp(created_ns / 1e9, tz=datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def tensor_count(n: int) -> str:
    return f"{n} tensor{'s' * (n != 1)}"


def seconds(value: float) -> str:
    """A duration: milliseconds below 10 s, seconds above."""
    return f"{value * 1000:.1f} ms" if value < 10 else f"{value:.1f} s"
