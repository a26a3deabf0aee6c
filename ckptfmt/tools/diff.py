"""diff(): what changed between two checkpoints: tensors, plain values and run metadata.

Tensors whose chunk references are identical are unchanged: that is known from
the manifests alone, without reading any data. Changed tensors are read (one
pair at a time) to measure how far they moved. The state's plain values (an
optimizer's learning rate, a scheduler's state, a user's counter) are in the
manifest's value tree and are compared without reading any tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.format.dtypes import numeric
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.manifest import Manifest, TensorEntry
from ckptfmt.format.plain_values import plain_values
from ckptfmt.format.rng_states import comparable_entry
from ckptfmt.format.values import decode_tree
from ckptfmt.loading.checkpoint import Checkpoint

if TYPE_CHECKING:
    import numpy as np


@dataclass
class TensorDiff:
    """One tensor's fate between checkpoint A and B."""

    key: str
    status: str  # "added", "removed", "changed", "unchanged"
    dtype: tuple[str | None, str | None] = (None, None)
    shape: tuple[tuple | None, tuple | None] = (None, None)
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    frac_changed: float | None = None

    @property
    def layout_changed(self) -> bool:
        return self.status == "changed" and (self.dtype[0] != self.dtype[1] or self.shape[0] != self.shape[1])


class _Absent:
    """The side of a value difference where the key does not exist (None is a value a state can hold)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


@dataclass
class DiffReport:
    """Tensors added/removed/changed/unchanged (changed sorted by how much they moved), the state's plain values
    that differ as (key, value in A, value in B), ``ABSENT`` where a side lacks the key, and metadata differences."""

    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[tuple[str, Any, Any]] = field(default_factory=list)
    metadata: list[tuple[str, Any, Any]] = field(default_factory=list)

    def by_status(self, status: str) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status == status]

    @property
    def differs(self) -> bool:
        """Whether the saved states differ: a tensor or a plain value (metadata, such as when each was saved,
        always differs and does not count)."""
        return bool(self.values) or any(t.status != "unchanged" for t in self.tensors)


def _signature(entry: TensorEntry, manifest: Manifest) -> tuple:
    """Everything that determines a tensor's bytes, from the manifest alone."""
    return (
        entry.dtype, entry.shape,
        tuple(
            (s.offsets, s.shape, tuple((manifest.chunks[p.chunk].hash, p.offset, p.length) for p in s.pieces))
            for s in entry.shards
        ),
    )


def array_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(max |a-b|, ||a-b|| / ||a||, fraction of elements whose bits differ) of two same-shape numeric arrays."""
    import numpy as np  # measuring moved tensors: the manifests alone need no numpy

    if a.size == 0:
        return 0.0, 0.0, 0.0
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype == b.dtype and a.dtype.kind in "biuf" and a.dtype.itemsize in (1, 2, 4, 8):
        bits = np.dtype(f"u{a.dtype.itemsize}")
        frac = float(np.mean(a.view(bits) != b.view(bits)))  # bit for bit: NaN equals NaN, -0.0 is not 0.0
    else:
        frac = float(np.mean(a != b))
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as it is in the figures
        da, db = a.astype(wide), b.astype(wide)
        delta = np.abs(da - db)
        norm = float(np.sqrt(np.sum(np.abs(da) ** 2)))
        change = float(np.sqrt(np.sum(delta**2)))
    rel = change / norm if norm else (0.0 if change == 0 else float("inf"))
    return float(delta.max()), rel, frac


def _measure(a: Checkpoint, b: Checkpoint, key: str,
             dtypes: tuple[str | None, str | None]) -> tuple[float, float, float]:
    """How far tensor ``key`` moved from ``a`` to ``b``: read as numpy arrays, no torch; the dtypes numpy
    lacks (float8, float4, complex32) through torch, loaded then."""
    left, right = (numeric(c.read_array(key), str(dtype)) for c, dtype in ((a, dtypes[0]), (b, dtypes[1])))
    if left is not None and right is not None:
        return array_difference(left, right)
    import torch

    from ckptfmt.loading.reader import CheckpointReader

    tensors = [CheckpointReader.from_parts(c.repository, c.name).get_tensor(key) for c in (a, b)]
    return array_difference(*(t.detach().cpu().to(torch.complex128 if t.is_complex() else torch.float64).numpy()
                              for t in tensors))


@renamed_arguments(url_a="a", url_b="b")
def diff(a: str | os.PathLike | Checkpoint, b: str | os.PathLike | Checkpoint, *,
         storage_options: dict | None = None, measure: bool = True) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (URLs or open checkpoints). ``measure=False`` skips reading
    changed tensors."""
    a = a if isinstance(a, Checkpoint) else Checkpoint.open(a, storage_options=storage_options)
    b = b if isinstance(b, Checkpoint) else Checkpoint.open(b, storage_options=storage_options)
    report = DiffReport(a.url, b.url)
    keys_b = set(b.keys())
    for key in a.keys():
        ea = a.tensor_info(key)
        if key not in keys_b:
            report.tensors.append(TensorDiff(key, "removed", (ea.dtype, None), (ea.shape, None)))
            continue
        eb = b.tensor_info(key)
        item = TensorDiff(key, "changed", (ea.dtype, eb.dtype), (ea.shape, eb.shape))
        if _signature(ea, a.manifest) == _signature(eb, b.manifest):
            item.status = "unchanged"
        elif measure and not item.layout_changed:
            item.max_abs_diff, item.rel_l2, item.frac_changed = _measure(a, b, key, item.dtype)
            if item.frac_changed == 0:  # same bytes in a different chunk (e.g. a pack of small tensors)
                item.status = "unchanged"
        report.tensors.append(item)
    for key in b.keys():
        if key not in a:
            eb = b.tensor_info(key)
            report.tensors.append(TensorDiff(key, "added", (None, eb.dtype), (None, eb.shape)))
    order = {"changed": 0, "added": 1, "removed": 2, "unchanged": 3}
    report.tensors.sort(key=lambda t: (order[t.status], -(t.rel_l2 or 0.0), t.key))
    report.values = value_difference(plain_values(a.manifest), plain_values(b.manifest))
    report.metadata = metadata_difference(a, b)
    return report


def value_difference(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The keys of two ``plain_values`` whose values differ, as (key, value in A, value in B), in A's order
    then B's; ``ABSENT`` where a side lacks the key."""
    keys = list(a) + [key for key in b if key not in a]
    return [(key, a.get(key, ABSENT), b.get(key, ABSENT)) for key in keys
            if key not in a or key not in b or not same_value(a[key], b[key])]


def same_value(a: Any, b: Any) -> bool:
    """Type-exact equality of plain values, NaN equal to NaN (a state holding NaN equals itself)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):  # of scalars, as plain_leaves makes them
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)


def metadata_difference(a: Checkpoint, b: Checkpoint) -> list[tuple[str, Any, Any]]:
    """Differing metadata leaves as (dotted path, value in A, value in B)."""
    def comparable(reader: Checkpoint) -> dict:
        m = reader.manifest
        return {
            "step": m.step,
            "environment": m.environment,
            "rng": {str(e.get("rank")): comparable_entry(e) for e in m.rng},
            "topology": m.topology,
            "user": decode_tree(m.user),
        }

    flat_a, flat_b = _flatten(comparable(a)), _flatten(comparable(b))
    return [
        (k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b)) if flat_a.get(k) != flat_b.get(k)
    ]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, bytes):
        return {prefix: f"<{len(value)} bytes, blake3 {chunk_hash(value)[:12]}>"}
    return {prefix: value}
