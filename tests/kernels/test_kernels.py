"""The C kernels against the numpy ones (ckptfmt/kernels/, issue 49 part 1): the same sums, extremes and
counts for every float and integer kind, odd lengths, NaN payloads, infinities, signed zeros, denormals and
sums that overflow; the same planes; and the statistics of whole tensors identical whichever runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckptfmt import kernels
from ckptfmt.kernels import numpy_kernels
from ckptfmt.tensors.stats import _float_kind, tensor_stats

pytestmark = pytest.mark.skipif(not kernels.NATIVE, reason="the C kernels are not built here")
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4095, 4096, 4097, 4161, 65537]
FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def native():
    from ckptfmt.kernels import c_kernels

    return c_kernels


def vector_sets() -> list[str]:
    """The C kernels' vector loops this CPU runs: "base" (16-byte vectors) always, "avx2" where it can."""
    if not kernels.NATIVE:
        return ["base"]
    chosen = native().vectors()
    try:
        native().vectors("avx2")
    except ValueError:
        return ["base"]
    finally:
        native().vectors(chosen)
    return ["base", "avx2"]


@pytest.fixture(params=vector_sets())
def vectors(request):
    """Each vector set in turn, the one chosen at import restored after."""
    chosen = native().vectors()
    native().vectors(request.param)
    yield request.param
    native().vectors(chosen)


def values(dtype: torch.dtype, n: int, seed: int, special: str) -> torch.Tensor:
    """``n`` elements of ``dtype``: normal values over many magnitudes, with ``special`` ones mixed in."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)
    out = torch.from_numpy(wide).to(dtype)
    at = torch.from_numpy(rng.integers(0, n, max(1, n // 5)))
    raw = out.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])
    if special == "zeros":  # both signs
        out[at] = 0.0
        raw[at[: len(at) // 2]] = raw[at[: len(at) // 2]] | torch.iinfo(raw.dtype).min
    elif special == "denormals":
        raw[at] = 1 + torch.arange(len(at), dtype=raw.dtype) % 3
    elif special == "nan":  # payloads of every kind: the NaN bit patterns of the dtype, signed
        nans = [b for b in range(256) if math.isnan(_as_float(dtype, b))] if dtype.itemsize == 1 else [-1, -2, 2**(
            8 * dtype.itemsize - 2) * 2 - 1]  # all bits set, or all but the sign's and the lowest: NaNs
        raw[at] = torch.tensor(nans * (len(at) // len(nans) + 1), dtype=raw.dtype)[: len(at)]
    elif special == "inf" and dtype != torch.float8_e4m3fn:
        out[at] = float("inf")
        out[at[::2]] = float("-inf")
    elif special == "huge" and dtype == torch.float64:  # squares overflow, sums do not
        out[at] = 1e300
    return out


def _as_float(dtype: torch.dtype, bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.uint8).view(dtype).to(torch.float64))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("special", ["plain", "zeros", "denormals", "nan", "inf", "huge"])
def test_float_blocks_agree_with_numpy(dtype, special, vectors):
    code, width, table = _float_kind(dtype)
    table = kernels.fp16_table() if code == "e" else table
    for seed, n in enumerate(LENGTHS):
        raw = values(dtype, n, seed, special).view(width).numpy()
        got = native().float_block(raw, code, table)
        want = numpy_kernels.float_block(raw, code, table)
        assert same(got[0], want[0]) and same(got[1], want[1]), (n, got, want)
        assert got[4:] == want[4:], (n, got, want)  # zeros, negative zeros: exact
        if math.isfinite(want[0]) and math.isfinite(want[1]):
            assert got[2] == want[2] and got[3] == want[3], (n, got, want)  # extremes by value


def sum_by_definition(values) -> float:
    """The kernels' order written out element by element (c_kernels.c's header): lanes i mod 64, each
    summed from +0.0, folded in halves, then +0.0 + lane 0."""
    lanes = [0.0] * 64
    for i, x in enumerate(values):
        lanes[i % 64] += x
    half = 32
    while half:
        lanes[:half] = [lanes[k] + lanes[k + half] for k in range(half)]
        half //= 2
    return 0.0 + lanes[0]


def test_the_sums_follow_the_lanes_order_and_the_zero_sum_is_positive(vectors):
    wide = np.random.default_rng(3).standard_normal(100_003) * 10.0 ** (np.arange(100_003) % 13)
    total, squares, *_ = native().float_block(wide, "d", None)
    assert total == sum_by_definition(wide.tolist()) and squares == sum_by_definition((wide * wide).tolist())
    assert total != math.fsum(wide) or squares != math.fsum(wide * wide)  # an order that rounds, tested as one
    assert math.copysign(1, native().float_block(np.full(9, -0.0), "d", None)[0]) == 1.0
    assert math.copysign(1, numpy_kernels.float_block(np.full(200, -0.0), "d", None)[0]) == 1.0


def test_numpy_sums_its_lanes_in_order_on_large_blocks(vectors):
    """numpy's add.reduce over the first axis adds row after row however many rows (no pairwise or
    buffered reordering): checked where the lanes are 50,000 rows deep."""
    wide = np.random.default_rng(5).standard_normal(64 * 50_000 + 5) * 1e3
    assert native().float_block(wide, "d", None)[:2] == numpy_kernels.float_block(wide, "d", None)[:2]
    assert numpy_kernels.float_block(wide, "d", None)[0] == sum_by_definition(wide.tolist())


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64])
def test_integer_blocks_agree_with_numpy(dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        raw = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        raw[rng.integers(0, n, n // 3)] = 0
        assert kernels.int_block(raw) == numpy_kernels.int_block(raw), n


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 65535, 65537, 200_001])
def test_planes_split_and_join_as_numpy_does(width, count):
    dtype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    data = np.random.default_rng(count).integers(0, np.iinfo(dtype).max, count, dtype=dtype, endpoint=True)
    planes, expected = np.empty((width, count), np.uint8), np.empty((width, count), np.uint8)
    native().split_planes(data, width, planes)
    numpy_kernels.split_planes(data, expected)
    assert np.array_equal(planes, expected)
    back = np.empty(count, dtype)
    native().join_planes(list(planes), width, back)
    assert np.array_equal(back, data)


def test_bad_arguments_are_refused_not_read_past():
    with pytest.raises(ValueError, match="whole elements"):
        native().float_block(b"\x00" * 7, "f", None)
    with pytest.raises(ValueError, match="whole elements"):
        native().float_block(b"", "d", None)
    with pytest.raises(ValueError, match="table of 65536"):
        native().float_block(b"\x00\x00", "e", np.zeros(3))
    with pytest.raises(ValueError, match="base. or .avx2"):
        native().vectors("avx512")
    with pytest.raises(ValueError, match="unknown float kind"):
        native().float_block(b"\x00" * 8, "x", None)
    with pytest.raises(ValueError, match="split_planes"):
        native().split_planes(b"\x00" * 6, 4, bytearray(6))
    with pytest.raises(ValueError, match="every plane"):
        native().join_planes([b"\x00", b"\x00\x00"], 2, bytearray(4))
    with pytest.raises(TypeError):
        native().split_planes(b"\x00" * 8, 4, b"\x00" * 8)  # a read-only output


@pytest.mark.parametrize("dtype", [*FLOATS, torch.int64, torch.int8, torch.uint8, torch.bool], ids=str)
def test_tensor_statistics_are_identical_whichever_kernels_run(dtype, monkeypatch):
    rng = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        tensor = (torch.randn(3_000_001, generator=rng) * 100).to(dtype)
        tensor[::1000] = 0.0
        tensor[1::1000] = -0.0
    else:
        tensor = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (1_000_003,), generator=rng).to(dtype)
    with_c = tensor_stats(tensor)
    monkeypatch.setattr(kernels, "_native", None)
    with_numpy = tensor_stats(tensor)
    assert with_c.keys() == with_numpy.keys()
    for field, value in with_c.items():
        assert value == with_numpy[field] and type(value) is type(with_numpy[field]), field
        if isinstance(value, float) and value == 0:
            assert math.copysign(1, value) == math.copysign(1, with_numpy[field]), field
