"""Tensor statistics against numpy on the same values: every float dtype, integers and bools, NaN,
infinities and zeros, blocks smaller than the tensor, and shards merged back to the whole."""

from __future__ import annotations

import math
import pickle
import sys

import numpy as np
import pytest
import torch

from ckptfmt.format.tensor_stats import FLOAT_FIELDS, INTEGER_FIELDS, StatsRow, merge_stats
from ckptfmt.tensors.stats import stats_of_spans, tensor_stats
from tests.support.tensor_values import FLOAT_DTYPES, INTEGER_DTYPES, special
from tests.support.tensor_values import assert_stats_close as assert_close
from tests.support.tensor_values import expected_stats as expected_float


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


def test_float64_near_its_largest_value_neither_overflows_the_mean_nor_loses_the_norm():
    """Sums of float64 elements near 1.8e308 overflow; the mean does not, and a norm above
    float64's range is infinite (as it is), below it exact, whole or merged from parts."""
    from fractions import Fraction

    big = torch.tensor([1.7e308, 1.6e308, -0.9e308, 1.5e308, 1e200, 3e-300] * 1000, dtype=torch.float64)
    exact_mean = float(sum(map(Fraction, big.tolist())) / big.numel())
    for stats in (tensor_stats(big, block=7), merge_stats(tensor_stats(part) for part in big.split(1001))):
        assert stats["mean"] == pytest.approx(exact_mean, rel=1e-12)
        assert stats["l2"] == math.inf and stats["max"] == 1.7e308 and stats["absmax"] == 1.7e308
    large = torch.tensor([3e200, -4e200] * 50, dtype=torch.float64)  # squares overflow, the norm does not
    for stats in (tensor_stats(large, block=3), merge_stats(tensor_stats(part) for part in large.split(33))):
        assert stats["l2"] == pytest.approx(5e200 * math.sqrt(50), rel=1e-13)
        assert stats["mean"] == pytest.approx(-0.5e200, rel=1e-13)


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


# -- the device path (PendingStats): the same figures, computed branch-free where the tensor lives --

@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INTEGER_DTYPES, ids=str)
def test_statistics_reduced_on_the_device_equal_numpys(dtype, monkeypatch):
    """Run here on the CPU device: the reductions are the ones a CUDA device runs (no host pass, no
    branch on the data), in blocks that do not divide the tensor."""
    from ckptfmt.tensors import stats as module

    monkeypatch.setattr(module, "DEVICE_BLOCK", 333)
    generator = torch.Generator().manual_seed(7)
    if dtype.is_floating_point:
        tensor = special(dtype, generator)
    elif dtype == torch.bool:
        tensor = torch.rand(999, generator=generator) > 0.3
    else:
        tensor = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (999,), generator=generator).to(dtype)
    assert_close(expected_float(tensor), module.PendingStats(tensor).result())


def test_the_device_path_handles_extremes_emptiness_and_collects_in_one_transfer():
    from ckptfmt.tensors.stats import PendingStats, collect

    big = torch.tensor([1.7e308, 1.6e308, -0.9e308, 1.5e308, 1e200, 3e-300] * 1000, dtype=torch.float64)
    large = torch.tensor([3e200, -4e200] * 50, dtype=torch.float64)
    nothing = torch.tensor([float("nan"), float("inf")])
    tensors = [big, large, nothing, torch.empty(0), torch.arange(5), torch.zeros(3, dtype=torch.complex64)]
    for device, host in zip(collect([PendingStats(t) for t in tensors]), map(tensor_stats, tensors)):
        assert_close(host, device)
    assert collect([PendingStats(large)])[0]["l2"] == pytest.approx(5e200 * math.sqrt(50), rel=1e-13)


# -- zeros of either sign: -0.0 is below +0.0 (spec 6.10), whatever the order or the cut ---------

SIGNED_ZERO_CASES = [  # elements, then the min and max spec 6.10 gives them
    ([0.0, -0.0], -0.0, 0.0), ([-0.0, 0.0], -0.0, 0.0), ([-0.0, -0.0], -0.0, -0.0), ([0.0, 0.0], 0.0, 0.0),
    ([0.0, 2.0, -0.0], -0.0, 2.0), ([2.0, 0.0], 0.0, 2.0), ([-2.0, -0.0, 0.0], -2.0, 0.0), ([-0.0, -2.0], -2.0, -0.0),
    ([float("nan"), -0.0, float("inf"), 0.0], -0.0, 0.0),
]


def _same_float(a: float, b: float) -> bool:
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2],
                         ids=str)
def test_a_zero_extreme_has_the_sign_spec_6_10_gives_it_whatever_the_order_or_the_cut(dtype):
    from ckptfmt.tensors.stats import PendingStats

    for elements, low, high in SIGNED_ZERO_CASES:
        for order in (elements, elements[::-1]):
            tensor = torch.tensor(order, dtype=torch.float64).to(dtype)
            parts = [tensor_stats(tensor), tensor_stats(tensor, block=1), PendingStats(tensor).result(),
                     merge_stats([tensor_stats(tensor[:1]), tensor_stats(tensor[1:])]),
                     merge_stats([tensor_stats(tensor[1:]), tensor_stats(tensor[:1])])]
            for stats in parts:
                assert _same_float(stats["min"], low) and _same_float(stats["max"], high), (order, stats)
                assert _same_float(stats["absmax"], abs(high) if abs(high) > abs(low) else abs(low))


def test_zero_extremes_of_a_large_tensor_do_not_depend_on_where_its_zeros_are():
    """Blocks of 1 M elements reduced by numpy (float32, float64) and by torch (float16): the sign of a
    zero extreme comes from the elements, never from which block or which position held which zero."""
    for dtype in (torch.float32, torch.float64, torch.float16):
        for first, second in ((0.0, -0.0), (-0.0, 0.0)):
            tensor = torch.full((3 << 19,), first, dtype=dtype)  # 1.5 blocks
            tensor[-5:] = second
            stats = tensor_stats(tensor)
            assert _same_float(stats["min"], -0.0) and _same_float(stats["max"], 0.0), (dtype, first)
        positive = torch.zeros(3 << 19, dtype=dtype).abs()
        assert _same_float(tensor_stats(positive)["min"], 0.0)
        assert _same_float(tensor_stats(-positive)["max"], -0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.complex64], ids=str)
def test_a_packs_statistics_read_and_pickle_as_the_dicts_each_tensor_alone_gets(dtype):
    """``stats_of_spans`` keeps a pack's statistics as columns, each span's a row of them: a row reads as
    ``tensor_stats`` of that span alone (fields in order, Python numbers, counts and extremes exactly,
    a zero extreme's sign too, mean and norm to binary64 rounding: the sums' order differs), pickles as
    a dict of its fields and nothing of the columns, and holds none of its own values."""
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn(1 + index % 5, generator=generator).mul(10).to(dtype) for index in range(40)]
    tensors[3] = torch.tensor([0.0, -0.0]).to(dtype)
    if dtype.is_floating_point:
        tensors[7][0] = float("nan")  # a span taken alone: a plain dict among the rows
    spans, packed, offset = [], b"", 0
    for tensor in tensors:
        padding = -offset % 16
        packed += b"\xff" * padding + tensor.view(torch.uint8).numpy().tobytes()
        spans.append((offset + padding, tensor.nbytes))
        offset = len(packed)
    rows = stats_of_spans(dtype, torch.frombuffer(bytearray(packed), dtype=torch.uint8), spans)
    for tensor, row in zip(tensors, rows):
        alone = tensor_stats(tensor)
        assert_close(alone, row, str(tensor))
        assert [type(value) for value in row.values()] == [type(value) for value in alone.values()]
        copied = pickle.loads(pickle.dumps(row))
        assert type(copied) is dict and list(copied.items()) == list(row.items())
        assert len(pickle.dumps(row)) < len(pickle.dumps(alone)) + 40  # not the columns: 320 bytes a field
    row = rows[0]
    assert isinstance(row, StatsRow) and sys.getsizeof(row) < 64 and not hasattr(row, "__dict__")
    with pytest.raises(TypeError):
        row["count"] = 0  # type: ignore[index]
