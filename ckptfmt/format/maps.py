"""Maps with unique keys (spec 6.1, 7.1): JSON objects and msgpack maps are read refusing a key twice,
so that no two readers differ on which value wins."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from ckptfmt.errors import CheckpointError, ManifestError, quoted

T = TypeVar("T")


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


def parse_json(data: bytes, where: str, what: str) -> object:
    """A small repository object stored as JSON (a commit record, a signature, a copy record), with
    unique keys; ManifestError naming ``where`` and ``what`` it should have been otherwise."""
    try:
        return json.loads(data, object_pairs_hook=unique_map)
    except CheckpointError as exc:  # a duplicate key
        raise type(exc)(f"{where}: {exc}") from None
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: deep JSON nesting
        raise ManifestError(f"{where}: malformed {what} ({exc})") from None


def unpack_object(data: bytes, where: str, fmt: str, max_bytes: int) -> dict:
    """A repository object stored as a msgpack map (history, progress): at most ``max_bytes``, unique
    keys, its ``format`` member ``fmt`` and a version this reader reads; errors name ``where``."""
    from ckptfmt.format.features import check_object

    what = fmt.removeprefix("ckptfmt-")
    if len(data) > max_bytes:
        raise ManifestError(f"{where}: {what} object of {len(data)} bytes is over the {max_bytes} limit")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=unique_map)
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    except Exception as exc:
        raise ManifestError(f"{where}: not a valid msgpack {what} object ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ManifestError(f"{where}: not a ckptfmt {what} object")
    try:
        check_object(doc, f"{what} object")
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    return doc


def parse_object(data: bytes, where: str, fmt: str, max_bytes: int, parse: Callable[[dict], T]) -> T:
    """A msgpack object of format ``fmt`` (``unpack_object``) turned into ``parse``'s result, every error
    naming ``where``: a CheckpointError as raised, a missing or mistyped member as a malformed object."""
    doc = unpack_object(data, where, fmt, max_bytes)
    try:
        return parse(doc)
    except CheckpointError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed {fmt.removeprefix('ckptfmt-').replace('-', ' ')} record "
                            f"({exc})") from None
