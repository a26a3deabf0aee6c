"""Text formatting for the TUI: the core's (ckptfmt.tools.formatting), plus key paths and counts."""

from __future__ import annotations

import re
from functools import partial

from ckptfmt.tools.formatting import human_bytes, number, seconds, shape_text
from ckptfmt.tools.formatting import human_time as _human_time

__all__ = ["human_bytes", "human_time", "number", "seconds", "shape_text", "split_key", "tensor_count"]

_SEPARATORS = re.compile(r"[/.]")

#: Commit times in UTC, the same on every machine (the CLI prints local time).
human_time = partial(_human_time, utc=True)


def split_key(key: str) -> list[str]:
    """A tensor key's name path: 'model/layers.0.attn.weight' -> model, layers, 0, attn, weight."""
    return [part for part in _SEPARATORS.split(key) if part] or [key]


def tensor_count(n: int) -> str:
    return f"{n} tensor{'s' * (n != 1)}"
