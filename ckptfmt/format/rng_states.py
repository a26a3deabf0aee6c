"""A rank's RNG states as a manifest holds them (spec 9.1), read whichever form a field was written in.

Python's generator state is 625 ints. As a msgpack array they cost a decoded int
each: 640,000 for a checkpoint of 1,024 ranks, a fifth of its manifest's parse.
From format 1.13 they are one bin of little-endian uint32, and every reader of
the state takes it through ``python_words``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

#: The ints of ``random.getstate()[1]``: the Mersenne Twister's 624 key words, then its position.
PYTHON_WORDS = 625
_WORDS = struct.Struct(f"<{PYTHON_WORDS}I")


def pack_python_words(words: Sequence[int]) -> bytes:
    """The bin form (format 1.13) of Python's generator state ``words``."""
    return _WORDS.pack(*words)


def python_words(state: Any) -> tuple[int, ...]:
    """The 625 ints of a ``python.state`` field: a bin of little-endian uint32 (1.13), or an array of ints;
    ValueError for anything else (a restore names the checkpoint: "malformed RNG state")."""
    if type(state) is bytes and len(state) == _WORDS.size:
        return _WORDS.unpack(state)
    if type(state) in (list, tuple) and len(state) == PYTHON_WORDS and {type(word) for word in state} <= {int}:
        return tuple(state)
    raise ValueError(f"python state must be {PYTHON_WORDS} ints or a bin of {_WORDS.size} bytes")


def comparable_entry(entry: Any) -> Any:
    """An ``rng`` entry with its Python state as a tuple of ints, so that entries written in either form
    compare equal when their states are (an entry whose state is neither is given back as it is)."""
    python = entry.get("python") if isinstance(entry, dict) else None
    if not isinstance(python, dict) or "state" not in python:
        return entry
    try:
        return {**entry, "python": {**python, "state": python_words(python["state"])}}
    except ValueError:
        return entry
