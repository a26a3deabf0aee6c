"""One state from every rank's: what a collective save's coordinator stores as the value tree.

Each rank encodes its own state; the coordinator decodes them with tensors as
``TensorRef`` (their keys) and merges them: maps take the union of their keys
(pipeline stages hold different layers), lists and tuples merge item by item,
``PerRank`` values gather every rank's, and any other value is kept as the
lowest rank that has it holds it. Values that differ between ranks are
reported, never silently dropped (wrap them in ``ckptfmt.PerRank`` to keep each
rank's).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ckptfmt.format.per_rank import PerRankValues
from ckptfmt.format.values import TensorRef, encode_tree, state_path

#: Paths of differing values named in the report, at most.
MAX_REPORTED = 8


def merge_states(trees: list[tuple[int, Any]]) -> tuple[Any, list[str]]:
    """Merge ``(rank, decoded state)`` pairs (rank order); returns the state and a line per difference."""
    differences: list[str] = []
    merged = _merge(trees, (), differences)
    return merged, differences


def _merge(values: list[tuple[int, Any]], path: tuple, differences: list[str]) -> Any:
    first_rank, first = values[0]
    kind = type(first)
    if all(type(v) is kind for _, v in values):
        if kind is PerRankValues:
            return PerRankValues({r: v for _, values_of_rank in values for r, v in values_of_rank.items()})
        if kind in (dict, OrderedDict):
            keys = list(dict.fromkeys(k for _, v in values for k in v))
            return kind((k, _merge([(r, v[k]) for r, v in values if k in v], (*path, k), differences))
                        for k in keys)
        if kind in (list, tuple) and all(len(v) == len(first) for _, v in values):
            return kind(_merge([(r, v[i]) for r, v in values], (*path, i), differences) for i in range(len(first)))
        if kind not in (list, tuple) and all(_same(first, v) for _, v in values[1:]):
            return first
    differing = [r for r, v in values[1:] if type(v) is not kind or not _same(first, v)]
    differences.append(
        f"{state_path(path)} differs between ranks (rank {first_rank} has {_brief(first)}, "
        f"rank {differing[0]} has {_brief(dict(values)[differing[0]])}"
        + (f", {len(differing) - 1} more rank(s) differ" if len(differing) > 1 else "") + ")"
    )
    return first


def _same(a: Any, b: Any) -> bool:
    """Equal as stored: the same msgpack bytes (nan equals nan, 1 differs from 1.0 and True)."""
    if isinstance(a, TensorRef) or isinstance(b, TensorRef):
        return a == b
    return encode_tree(a, lambda path, ref: 0) == encode_tree(b, lambda path, ref: 0)



def _brief(value: Any) -> str:
    if isinstance(value, TensorRef):
        return f"tensor {value.key!r}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"
