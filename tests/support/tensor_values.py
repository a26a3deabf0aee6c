"""Tensors with the values statistics must get right (zeros of either sign, NaN, infinities), and
numpy's figures for them: the reference every statistics test compares against."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def special(dtype: torch.dtype, generator: torch.Generator, count: int = 5000) -> torch.Tensor:
    """Random values with zeros of either sign, and NaN and infinities where the dtype has them."""
    values = torch.randn(count, generator=generator, dtype=torch.float64) * 3
    values[::97] = 0.0
    values[1::97] = -0.0
    info = torch.finfo(dtype)
    values = values.clamp(-info.max, info.max)
    tensor = values.to(dtype)
    with_nan = torch.tensor([float("nan")]).to(dtype)
    if torch.isnan(with_nan.to(torch.float64)).all():
        tensor[7::501] = with_nan
    with_inf = torch.tensor([float("inf"), float("-inf")]).to(dtype).to(torch.float64)
    if torch.isinf(with_inf).all():  # the fn/fnuz float8 kinds have no infinity
        tensor[11::703] = float("inf")
        tensor[13::907] = float("-inf")
    return tensor


def expected_stats(tensor: torch.Tensor) -> dict:
    """numpy's figures for the tensor's values (every float dtype's values are exact in float64)."""
    if not tensor.dtype.is_floating_point:
        values = tensor.numpy().astype(np.int64).reshape(-1)
        some = values.size > 0
        return {"count": values.size, "min": int(values.min()) if some else None,
                "max": int(values.max()) if some else None, "zeros": int((values == 0).sum())}
    values = tensor.to(torch.float64).numpy().reshape(-1)
    finite = values[np.isfinite(values)]
    some = finite.size > 0
    low, high = (float(finite.min()), float(finite.max())) if some else (None, None)
    zero_signs = np.signbit(finite[finite == 0])
    if low == 0:  # -0.0 below +0.0 (spec 6.10)
        low = -0.0 if zero_signs.any() else 0.0
    if high == 0:
        high = -0.0 if zero_signs.all() else 0.0
    return {"count": values.size, "min": low, "max": high,
            "mean": float(finite.mean()) if some else None,
            "l2": float(np.sqrt(np.sum(finite ** 2))) if some else None,
            "absmax": float(np.abs(finite).max()) if some else None,
            "nan": int(np.isnan(values).sum()), "posinf": int(np.isposinf(values).sum()),
            "neginf": int(np.isneginf(values).sum()), "zeros": int((values == 0).sum())}


def assert_stats_close(expected: dict, actual: dict | None, where: str = "") -> None:
    """Equal fields in the same order: counts and extremes exactly, mean and norm to float64 rounding."""
    assert actual is not None, f"{where}: no statistics"
    assert list(actual) == list(expected), where
    for name, value in expected.items():
        if value is None or isinstance(value, int) or name in ("min", "max", "absmax"):
            assert actual[name] == value, f"{where}: {name}"
            if isinstance(value, float):  # a zero extreme's sign too
                assert math.copysign(1, actual[name]) == math.copysign(1, value), f"{where}: {name}'s sign"
        else:
            assert actual[name] == pytest.approx(value, rel=1e-12, abs=1e-300), f"{where}: {name}"
