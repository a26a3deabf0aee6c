"""diff(): what changed between two checkpoints, tensors and run metadata.

Tensors whose chunk references are identical are unchanged: that is known from
the manifests alone, without reading any data. Changed tensors are read (one
pair at a time) to measure how far they moved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .hashing import chunk_hash
from .manifest import Manifest, TensorEntry
from .reader import CheckpointReader, open as open_checkpoint
from .values import decode_tree

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


@dataclass
class DiffReport:
    """Tensors added/removed/changed/unchanged (changed sorted by how much they moved) and metadata differences."""

    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    metadata: list[tuple[str, Any, Any]] = field(default_factory=list)

    def by_status(self, status: str) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status == status]


def _signature(entry: TensorEntry, manifest: Manifest) -> tuple:
    """Everything that determines a tensor's bytes, from the manifest alone."""
    return (
        entry.dtype, entry.shape,
        tuple(
            (s.offsets, s.shape, tuple((manifest.chunks[p.chunk].hash, p.offset, p.length) for p in s.pieces))
            for s in entry.shards
        ),
    )


def tensor_difference(a, b) -> tuple[float, float, float]:
    """(max |a-b|, ||a-b|| / ||a||, fraction of elements whose bits differ) for same-shape tensors or arrays."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.numel() == 0:
        return 0.0, 0.0, 0.0
    width = a.element_size()
    if a.dtype == b.dtype and width in _INT_VIEW and not a.is_complex():
        differs = a.reshape(-1).view(_INT_VIEW[width]) != b.reshape(-1).view(_INT_VIEW[width])
    else:
        differs = a.reshape(-1) != b.reshape(-1)
    frac = differs.double().mean().item()
    da = a.to(torch.complex128 if a.is_complex() else torch.float64)
    db = b.to(torch.complex128 if b.is_complex() else torch.float64)
    delta = (da - db).abs()
    norm = da.abs().pow(2).sum().sqrt().item()
    change = delta.pow(2).sum().sqrt().item()
    rel = change / norm if norm else (0.0 if change == 0 else float("inf"))
    return delta.max().item(), rel, frac


def diff(url_a: str | os.PathLike | CheckpointReader, url_b: str | os.PathLike | CheckpointReader, *,
         storage_options: dict | None = None, measure: bool = True) -> DiffReport:
    """Compare two checkpoints. ``measure=False`` skips reading changed tensors."""
    a = url_a if isinstance(url_a, CheckpointReader) else open_checkpoint(url_a, storage_options=storage_options)
    b = url_b if isinstance(url_b, CheckpointReader) else open_checkpoint(url_b, storage_options=storage_options)
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
            item.max_abs_diff, item.rel_l2, item.frac_changed = tensor_difference(a.get_tensor(key), b.get_tensor(key))
            if item.frac_changed == 0:  # same bytes in a different chunk (e.g. a pack of small tensors)
                item.status = "unchanged"
        report.tensors.append(item)
    for key in b.keys():
        if key not in a:
            eb = b.tensor_info(key)
            report.tensors.append(TensorDiff(key, "added", (None, eb.dtype), (None, eb.shape)))
    order = {"changed": 0, "added": 1, "removed": 2, "unchanged": 3}
    report.tensors.sort(key=lambda t: (order[t.status], -(t.rel_l2 or 0.0), t.key))
    report.metadata = metadata_difference(a, b)
    return report


def metadata_difference(a: CheckpointReader, b: CheckpointReader) -> list[tuple[str, Any, Any]]:
    """Differing metadata leaves as (dotted path, value in A, value in B)."""
    def comparable(reader: CheckpointReader) -> dict:
        m = reader.manifest
        return {
            "step": m.step,
            "environment": m.environment,
            "rng": {str(e.get("rank")): e for e in m.rng},
            "topology": m.topology,
            "user": decode_tree(m.user),
        }

    flat_a, flat_b = _flatten(comparable(a)), _flatten(comparable(b))
    return [(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b)) if flat_a.get(k) != flat_b.get(k)]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, bytes):
        return {prefix: f"<{len(value)} bytes, blake3 {chunk_hash(value)[:12]}>"}
    return {prefix: value}
