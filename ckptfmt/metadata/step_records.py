"""The stored form of a timer's steps (spec 9.4): a count, and one msgpack bin of little-endian numbers
per column (``encode_steps``), read back as numpy arrays (``decode_steps``, ``StepColumns``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt.errors import ManifestError
from ckptfmt.metadata.column_records import column_reader, record_count
from ckptfmt.metadata.rng_digests import RNG_DIGEST_BYTES

#: Bytes of a batch digest (BLAKE3 of the indices as little-endian int64).
BATCH_DIGEST_BYTES = 16
#: What a step's batch digest was taken of (spec 9.4 ``batch_kind``).
BATCH_NONE, BATCH_INDICES, BATCH_TENSORS = 0, 1, 2
_I64, _F64 = np.dtype("<i8"), np.dtype("<f8")


@dataclass
class StepColumns:
    """One rank's stored steps, decoded: numpy arrays of ``count`` rows each."""

    count: int
    step: np.ndarray  # int64
    start_ns: np.ndarray  # int64, wall clock
    duration_s: np.ndarray  # float64
    batch: np.ndarray  # uint8, count x 16
    batch_size: np.ndarray  # int64, -1: no batch recorded
    phases: dict[str, np.ndarray]  # float64 seconds, NaN: the step had none
    metrics: dict[str, np.ndarray]  # float64
    metrics_missing: dict[str, np.ndarray]  # bool: the step recorded no such metric
    #: uint8 per step: what ``batch`` digests (0 nothing, 1 sample indices, 2 the batch's tensors; 1.8).
    batch_kind: np.ndarray
    #: Generator name -> uint8, count x 16: its state's digest at the step's start, zeros where not read (1.8).
    rng: dict[str, np.ndarray]


def encode_steps(columns: dict) -> dict:
    """The stored form of a timer's columns: a count, and one bin of little-endian numbers per column."""
    count = len(columns["step"])

    def floats(values: list) -> bytes:  # float(): a metric may be a device tensor, read only now
        return np.array([np.nan if v is None else float(v) for v in values], dtype=_F64).tobytes()
    record = {
        "count": count,
        "step": np.array(columns["step"], dtype=_I64).tobytes(),
        "start_ns": np.array(columns["start_ns"], dtype=_I64).tobytes(),
        "duration_s": np.array(columns["duration_s"], dtype=_F64).tobytes(),
        "batch": b"".join(bytes(BATCH_DIGEST_BYTES) if d is None else d for d in columns["batch"]),
        "batch_size": np.array([-1 if n is None else n for n in columns["batch_size"]], dtype=_I64).tobytes(),
        "phases": {name: floats(values) for name, values in columns["phases"].items()},
        "metrics": {name: floats(values) for name, values in columns["metrics"].items()},
    }
    missing = {name: np.array([v is None for v in values], dtype=np.uint8).tobytes()
               for name, values in columns["metrics"].items() if None in values}
    if missing:
        record["metrics_missing"] = missing
    if any(kind == BATCH_TENSORS for kind in columns.get("batch_kind", ())):
        record["batch_kind"] = bytes(columns["batch_kind"])
    if columns.get("rng"):
        zeros = bytes(RNG_DIGEST_BYTES)
        record["rng"] = {name: b"".join(zeros if d is None else d for d in values)
                         for name, values in columns["rng"].items()}
    return record


def decode_steps(record: Any, where: str) -> StepColumns:
    """A stored step record as arrays, or a ManifestError naming ``where`` and what is wrong."""
    count = record_count(record, where)
    column = column_reader(count, where)

    def named(value: Any, what: str, dtype: np.dtype) -> dict[str, np.ndarray]:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(type(k) is str for k in value):
            raise ManifestError(f"{where}: {what} is not a map of names")
        return {name: column(v, f"{what}.{name}", dtype) for name, v in value.items()}
    step = column(record.get("step"), "step", _I64)
    batch_size = column(record.get("batch_size"), "batch_size", _I64)
    kind = record.get("batch_kind")
    batch_kind = (batch_size >= 0).astype(np.uint8) if kind is None else column(kind, "batch_kind", np.dtype(np.uint8))
    if kind is not None and (batch_kind > BATCH_TENSORS).any():
        raise ManifestError(f"{where}: batch_kind holds a value other than 0, 1 and 2")
    rng = record.get("rng")
    if rng is not None and (not isinstance(rng, dict) or not all(type(k) is str for k in rng)):
        raise ManifestError(f"{where}: rng is not a map of names")
    return StepColumns(
        count=count,
        step=step,
        start_ns=column(record.get("start_ns"), "start_ns", _I64),
        duration_s=column(record.get("duration_s"), "duration_s", _F64),
        batch=column(record.get("batch"), "batch", np.dtype(np.uint8), BATCH_DIGEST_BYTES),
        batch_size=batch_size,
        phases=named(record.get("phases"), "phases", _F64),
        metrics=named(record.get("metrics"), "metrics", _F64),
        metrics_missing={k: v.astype(bool) for k, v in
                         named(record.get("metrics_missing"), "metrics_missing", np.dtype(np.uint8)).items()},
        batch_kind=batch_kind,
        rng={name: column(value, f"rng.{name}", np.dtype(np.uint8), RNG_DIGEST_BYTES)
             for name, value in (rng or {}).items()},
    )
