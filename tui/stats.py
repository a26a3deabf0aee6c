"""Statistics of one tensor for the detail pane: range, moments, NaN/Inf counts and a histogram.

Kept free of textual so it can be computed in a worker thread and tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorStats:
    """Summary of a tensor's values; moments and the histogram cover finite values only."""

    numel: int
    nan: int
    inf: int
    zero_fraction: float
    minimum: float | None
    maximum: float | None
    mean: float | None
    std: float | None
    histogram: tuple[int, ...]
    magnitude: bool = False  # complex values are summarised by their magnitude


def tensor_statistics(value, bins: int = 12) -> TensorStats:
    """Compute ``TensorStats`` of a numpy array (or a tensor) as float64, with numpy: torch is not loaded
    for it (a tensor given converts itself)."""
    if type(value).__module__.split(".")[0] == "torch":  # only a caller that already has torch passes one
        value = value.detach().cpu()
        value = (value.float() if value.dtype.is_floating_point and value.element_size() < 4 else value).numpy()
    flat = np.asarray(value).reshape(-1)
    magnitude = np.iscomplexobj(flat)
    flat = (np.abs(flat) if magnitude else flat).astype(np.float64)
    numel = flat.size
    if numel == 0:
        return TensorStats(0, 0, 0, 0.0, None, None, None, None, ())
    nan = int(np.isnan(flat).sum())
    inf = int(np.isinf(flat).sum())
    zero_fraction = float(np.mean(flat == 0))
    finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        return TensorStats(numel, nan, inf, zero_fraction, None, None, None, None, (), magnitude)
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        histogram: tuple[int, ...] = (finite.size,)
    else:
        histogram = tuple(int(c) for c in np.histogram(finite, bins=bins, range=(lo, hi))[0])
    return TensorStats(numel, nan, inf, zero_fraction, lo, hi, float(finite.mean()), float(finite.std()), histogram,
                       magnitude)
