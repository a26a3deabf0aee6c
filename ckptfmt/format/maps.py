"""Maps with unique keys (spec 6.1, 7.1): JSON objects and msgpack maps are read refusing a key twice,
so that no two readers differ on which value wins."""

from __future__ import annotations

from typing import Any

from ckptfmt.errors import ManifestError, quoted


def unique_map(pairs: list[tuple]) -> dict:
    """A map as a dict, refusing duplicate keys: readers must not differ on which one wins.

    Keys are the same when they are equal as Python values (spec 7.1): ``1``, ``True``, ``1.0`` and
    ``np.int64(1)`` are one key, ``0.0`` and ``-0.0`` too; a NaN equals nothing, not even a NaN.
    """
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ManifestError(f"map has the key {quoted(first_repeat(k for k, _ in pairs))} twice")
    return value


def first_repeat(items) -> Any:
    """The first item equal to an earlier one (in one pass: a hostile map may hold millions)."""
    seen = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    raise AssertionError("no item repeats")
