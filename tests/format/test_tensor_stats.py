"""Tensor statistics against numpy on the same values: every float dtype, integers and bools, NaN,
infinities and zeros, blocks smaller than the tensor, and shards merged back to the whole."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckptfmt.format.tensor_stats import FLOAT_FIELDS, INTEGER_FIELDS, merge_stats, tensor_stats

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def expected_float(tensor: torch.Tensor) -> dict:
    """numpy's figures for the tensor's values (exactly representable in float64)."""
    values = tensor.to(torch.float64).numpy().reshape(-1)
    finite = values[np.isfinite(values)]
    some = finite.size > 0
    return {"count": values.size,
            "min": float(finite.min()) if some else None, "max": float(finite.max()) if some else None,
            "mean": float(finite.mean()) if some else None,
            "l2": float(np.sqrt(np.sum(finite.astype(np.float64) ** 2))) if some else None,
            "absmax": float(np.abs(finite).max()) if some else None,
            "nan": int(np.isnan(values).sum()), "posinf": int(np.isposinf(values).sum()),
            "neginf": int(np.isneginf(values).sum()), "zeros": int((values == 0).sum())}


def assert_close(expected: dict, actual: dict) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        if value is None or isinstance(value, int):
            assert actual[name] == value, name
        else:
            assert actual[name] == pytest.approx(value, rel=1e-12, abs=1e-300), name


def special(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values with zeros of either sign, and NaN and infinities where the dtype has them."""
    values = torch.randn(5000, generator=generator, dtype=torch.float64) * 3
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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_float_statistics_equal_numpys_with_nan_infinities_and_zeros(dtype):
    tensor = special(dtype, torch.Generator().manual_seed(1))
    expected = expected_float(tensor)
    assert expected["zeros"] > 0 and (dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) or expected["nan"])
    assert_close(expected, tensor_stats(tensor))
    assert_close(expected, tensor_stats(tensor, block=333))  # blocks that do not divide it


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_shards_merged_equal_the_whole_tensor(dtype):
    tensor = special(dtype, torch.Generator().manual_seed(2)).reshape(50, 100)
    shards = [tensor[:7], tensor[7:8], tensor[8:31], tensor[31:]]
    assert_close(tensor_stats(tensor), merge_stats(tensor_stats(shard) for shard in shards))


def test_a_tensor_without_finite_values_has_no_extremes_and_merges_with_one_that_has():
    nothing = torch.tensor([float("nan"), float("inf"), float("-inf")])
    stats = tensor_stats(nothing)
    assert stats == {"count": 3, "min": None, "max": None, "mean": None, "l2": None, "absmax": None,
                     "nan": 1, "posinf": 1, "neginf": 1, "zeros": 0}
    merged = merge_stats([stats, tensor_stats(torch.tensor([-2.0, 0.0, 4.0]))])
    assert merged == {"count": 6, "min": -2.0, "max": 4.0, "mean": 2.0 / 3, "l2": math.sqrt(20.0),
                      "absmax": 4.0, "nan": 1, "posinf": 1, "neginf": 1, "zeros": 1}
    assert tensor_stats(torch.empty(0))["count"] == 0 and tensor_stats(torch.empty(0))["mean"] is None


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_integer_and_bool_statistics_are_exact(dtype):
    generator = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        tensor = torch.rand(999, generator=generator) > 0.3
    else:
        info = torch.iinfo(dtype)
        tensor = torch.randint(max(info.min, -10**6), min(info.max, 10**6), (999,), generator=generator, dtype=dtype)
        tensor[::50] = 0
        tensor[1] = info.max  # exact at the extremes of int64 too
        tensor[2] = info.min
    values = tensor.numpy().astype(np.int64) if dtype != torch.int64 else tensor.numpy()
    expected = {"count": 999, "min": int(values.min()), "max": int(values.max()), "zeros": int((values == 0).sum())}
    assert tensor_stats(tensor, block=100) == expected
    assert list(expected) == list(INTEGER_FIELDS)
    assert merge_stats([tensor_stats(tensor[:400]), tensor_stats(tensor[400:])]) == expected


def test_dtypes_without_arithmetic_get_the_count_alone():
    packed = torch.zeros(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert tensor_stats(packed) == {"count": 6}
    assert tensor_stats(torch.zeros(4, dtype=torch.complex64)) == {"count": 4}


def test_parts_of_different_kinds_are_not_merged():
    with pytest.raises(ValueError, match="different fields"):
        merge_stats([tensor_stats(torch.ones(2)), tensor_stats(torch.ones(2, dtype=torch.int32))])
    with pytest.raises(ValueError, match="at least one"):
        merge_stats([])
    assert list(tensor_stats(torch.ones(2))) == list(FLOAT_FIELDS)


def test_memory_stays_bounded_by_the_block_whatever_the_tensor():
    """A 64 M-element float32 tensor (256 MiB) is read a block at a time: the float64 scratch is one
    block (8 MiB), not the whole tensor in float64 (512 MiB)."""
    import resource

    tensor = torch.ones(64 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = tensor_stats(tensor)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert stats["count"] == 64 << 20 and stats["mean"] == 1.0 and stats["l2"] == 8192.0
    assert grown_mib < 128, f"peak memory grew {grown_mib:.0f} MiB"
