"""Statistics of one tensor for the detail pane: range, moments, NaN/Inf counts and a histogram.

Kept free of textual so it can be computed in a worker thread and tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
    """Compute ``TensorStats`` of a tensor (or numpy array) as float64."""
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
    flat = tensor.detach().reshape(-1)
    magnitude = flat.is_complex()
    if magnitude:
        flat = flat.abs()
    flat = flat.to(torch.float64)
    numel = flat.numel()
    if numel == 0:
        return TensorStats(0, 0, 0, 0.0, None, None, None, None, ())
    nan = int(torch.isnan(flat).sum())
    inf = int(torch.isinf(flat).sum())
    zero_fraction = float((flat == 0).double().mean())
    finite = flat[torch.isfinite(flat)]
    if finite.numel() == 0:
        return TensorStats(numel, nan, inf, zero_fraction, None, None, None, None, (), magnitude)
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        histogram = (finite.numel(),)
    else:
        histogram = tuple(int(c) for c in torch.histc(finite, bins=bins, min=lo, max=hi))
    return TensorStats(
        numel, nan, inf, zero_fraction, lo, hi, float(finite.mean()),
        float(finite.std(unbiased=False)), histogram, magnitude,
    )
