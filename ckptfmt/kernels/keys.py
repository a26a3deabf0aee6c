"""Checks of a manifest's keys at the speed of decoding them: C where the package's build compiled
``c_keys.c``, Python otherwise, with the same answers (tests/kernels/test_keys.py). ``CKPTFMT_KERNELS=numpy``
chooses Python here too.

A reader proves a 100,000-key table's keys are strings of the right lengths and distinct on every open;
in Python that took as long as msgpack's decoding of the whole manifest (a set of fresh strings, each
hashed, the set resized as it grows).
"""

from __future__ import annotations

import os

try:
    from ckptfmt.kernels import c_keys as _native  # type: ignore[attr-defined]  # built, not in the source
except ImportError:  # an sdist built without a C compiler (ckptfmt --version names the kernels)
    _native = None
if os.environ.get("CKPTFMT_KERNELS") == "numpy":
    _native = None


def key_scan(keys: list, limit: int) -> tuple[int, int, int]:
    """(the index of the first item of ``keys`` that is not a str, or -1; how many keys before it are
    empty; the index of the first key before it of more than ``limit`` bytes of UTF-8, a lone surrogate
    as 3 bytes, or -1)."""
    if _native is not None:
        return _native.key_scan(keys, limit)
    stray = -1 if set(map(type, keys)) <= {str} else next(i for i, key in enumerate(keys) if type(key) is not str)
    strings = keys if stray < 0 else keys[:stray]
    over = -1
    if max(map(len, strings), default=0) > limit // 4:  # at most 4 bytes a character: only long keys measured
        over = next((index for index, key in enumerate(strings)
                     if len(key) > limit // 4 and len(key.encode("utf-8", "surrogatepass")) > limit), -1)
    return stray, strings.count(""), over


def first_repeat(keys: list[str]) -> int | None:
    """The index of the first of ``keys`` (a list of str) equal to an earlier one, None if all differ."""
    index = _native.first_repeat(keys) if _native is not None else -2
    if index != -2:  # -2: many keys of one hash tag, perhaps chosen to collide: the set decides
        return None if index < 0 else index
    if len(set(keys)) == len(keys):
        return None
    seen: set[str] = set()
    for index, key in enumerate(keys):
        if key in seen:
            return index
        seen.add(key)
    return None
