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

from ckptfmt.errors import quoted

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


#: The words of the Mersenne Twister key that numpy's legacy global state holds (spec 9.1).
NUMPY_KEY_WORDS = 624


def numpy_state_tuple(state: Any) -> tuple:
    """A ``numpy`` field (spec 9.1) as the tuple ``np.random.set_state`` takes, every part checked first:
    numpy checks neither the key's length nor the position (no key words raised IndexError; it reads the
    key word at the position on the next draw, and a position of 10**6 crashed the process). ValueError
    for anything else (a restore names the checkpoint: "malformed RNG state")."""
    import numpy as np

    if type(state) is not dict or not {"bit_generator", "keys", "pos", "has_gauss", "cached_gaussian"} <= set(state):
        raise ValueError("numpy's state must be a map of bit_generator, keys, pos, has_gauss and cached_gaussian")
    keys, pos, has_gauss, cached = state["keys"], state["pos"], state["has_gauss"], state["cached_gaussian"]
    if state["bit_generator"] != "MT19937":
        raise ValueError(f"numpy's bit_generator must be 'MT19937' (its legacy state), "
                         f"not {quoted(state['bit_generator'])}")
    if type(keys) is not bytes or len(keys) != 4 * NUMPY_KEY_WORDS:
        raise ValueError(f"numpy's keys must be a bin of {4 * NUMPY_KEY_WORDS} bytes ({NUMPY_KEY_WORDS} uint32), "
                         f"not {_described(keys)}")
    if type(pos) is not int or not 0 <= pos <= NUMPY_KEY_WORDS:
        raise ValueError(f"numpy's pos must be an int in [0, {NUMPY_KEY_WORDS}], not {_described(pos)}")
    if type(has_gauss) is not int or has_gauss not in (0, 1):
        raise ValueError(f"numpy's has_gauss must be 0 or 1, not {_described(has_gauss)}")
    if type(cached) is not float:
        raise ValueError(f"numpy's cached_gaussian must be a float, not {_described(cached)}")
    return ("MT19937", np.frombuffer(keys, dtype="<u4").astype(np.uint32), pos, has_gauss, cached)


def python_state_tuple(state: Any) -> tuple:
    """A ``python`` field (spec 9.1) as the tuple ``random.setstate`` takes; ValueError for anything else
    (``random.setstate`` checks the version and the position itself, but takes any ``gauss_next``, which the
    next ``random.gauss`` would trip over)."""
    if type(state) is not dict or not {"version", "state", "gauss_next"} <= set(state):
        raise ValueError("python's state must be a map of version, state and gauss_next")
    version, gauss_next = state["version"], state["gauss_next"]
    if type(version) is not int:
        raise ValueError(f"python's version must be an int, not {_described(version)}")
    if gauss_next is not None and type(gauss_next) is not float:
        raise ValueError(f"python's gauss_next must be a float or nil, not {_described(gauss_next)}")
    return version, python_words(state["state"]), gauss_next


def _described(value: Any) -> str:
    """A short account of a stored value, for a message: a bin's length, an int itself, else its type."""
    if type(value) is bytes:
        return f"{len(value)} bytes"
    return str(value) if type(value) is int else f"a {type(value).__name__}"


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
