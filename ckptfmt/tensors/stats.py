"""Tensor statistics taken from tensors (spec 6.10): per stored block as a save hashes it, or on the
tensor's own device before its bytes reach the host.

The fields, their meaning and the exact merge of parts are the format's (``format/tensor_stats.py``);
this module computes them with torch. ``StatsAccumulator`` takes a tensor's elements a block at a
time, in any order and from any thread's buffer, so that a save computes them in the pass that
already copies and hashes each block (saving/chunk_writer.py) rather than in a pass of its own.
Sums accumulate in float64 and memory stays bounded whatever the tensor's size.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptfmt import kernels
from ckptfmt.format.tensor_stats import COUNT_FIELDS, FLOAT_FIELDS, INTEGER_FIELDS, StatsRow, higher, lower

#: Elements taken at a time by ``tensor_stats``: 8 MiB of float64 scratch at most per block.
BLOCK_ELEMENTS = 1 << 20
#: Blocks of float64 elements whose sum overflows are summed times this (exact: a power of two).
_SCALE = 2.0**-64
#: A block norm above which its square would lose digits to overflow: kept as a norm (math.hypot).
_LARGE_NORM = 2.0**500


def tensor_stats(tensor: torch.Tensor, *, block: int = BLOCK_ELEMENTS) -> dict[str, Any]:
    """``tensor``'s statistics (the fields above for its kind), from one pass over its elements."""
    flat = tensor.detach().reshape(-1)
    accumulator = StatsAccumulator(tensor.dtype)
    for start in range(0, flat.numel(), block):
        accumulator.add(flat[start:start + block])
    return accumulator.result()


def stats_of_spans(dtype: torch.dtype, whole: torch.Tensor,
                   spans: list[tuple[int, int]]) -> list[Mapping[str, Any]]:
    """The statistics of each span (byte offset, byte length: whole ``dtype`` elements, at offsets its
    size divides, in increasing order, apart) of ``whole``, a 1-D uint8 tensor (a pack of small tensors),
    as ``tensor_stats`` gives them (``mean`` and ``l2`` to binary64 rounding, spec 6.10), by segmented
    reductions over the pack at once: one tensor at a time costs some 30 us of calls whatever its size,
    which made the statistics 40% of a save of 20,000 tensors of 8 floats; and a view of each span, 100
    MiB of short-lived tensors that the writer's threads' memory kept (100,000 tensors). Each segment
    is [start, end) of a span; the padding between them is reduced apart and dropped. A span holding a
    NaN or an infinity, or whose sums overflow, is taken alone. The others' statistics stay the
    reductions' columns, each span's a ``StatsRow`` of them."""
    fields = fields_for(dtype)
    size = dtype.itemsize
    counts = np.array([length // size for _, length in spans], dtype=np.int64)
    if fields is COUNT_FIELDS:
        return _rows({"count": counts})
    if len(spans) < 2 or not counts.all():
        return [_one_part(dtype, whole[offset:offset + length]) for offset, length in spans]
    first, (last, last_length) = spans[0][0], spans[-1]
    region = whole[first:last + last_length].view(dtype)
    bounds = np.array([(offset - first) // size for span in spans for offset in (span[0], span[0] + span[1])])[:-1]
    segments = slice(None, None, 2)  # [start, end) of each span; the odd ones are the padding's

    def reduced(ufunc, column: np.ndarray) -> np.ndarray:
        return ufunc.reduceat(column, bounds)[segments]
    if fields is INTEGER_FIELDS:
        values = (region.view(torch.uint8) if dtype == torch.bool else region).to(torch.int64).numpy()
        nonzero = reduced(np.add, (values != 0).astype(np.int64))
        return _rows({"count": counts, "min": reduced(np.minimum, values), "max": reduced(np.maximum, values),
                      "zeros": counts - nonzero})
    values = region.to(torch.float64).numpy()
    with np.errstate(all="ignore"):  # a span's NaN, infinities or overflow: that span is taken alone
        totals, squares = reduced(np.add, values), reduced(np.add, values * values)
    alone = ~np.isfinite(totals) | ~np.isfinite(squares)
    lows, highs = reduced(np.minimum, values), reduced(np.maximum, values)
    zero = values == 0
    zeros = reduced(np.add, zero.astype(np.int64))
    negative_zeros = reduced(np.add, (zero & np.signbit(values)).astype(np.int64))
    # -0.0 below +0.0 (spec 6.10), whichever of a tie the reduction kept
    lows = np.where(lows == 0, np.where(negative_zeros > 0, -0.0, 0.0), lows)
    highs = np.where(highs == 0, np.where(zeros > negative_zeros, 0.0, -0.0), highs)
    none = np.zeros(len(spans), dtype=np.int64)
    with np.errstate(all="ignore"):  # (the spans taken alone hold anything here: never read)
        found = _rows({"count": counts, "min": lows, "max": highs, "mean": totals / counts, "l2": np.sqrt(squares),
                       "absmax": np.maximum(np.abs(lows), np.abs(highs)), "nan": none, "posinf": none,
                       "neginf": none, "zeros": zeros})
    for at in np.flatnonzero(alone).tolist():
        offset, length = spans[at]
        found[at] = _one_part(dtype, whole[offset:offset + length])
    return found


def _rows(columns: dict[str, np.ndarray]) -> list[Mapping[str, Any]]:
    return [StatsRow(columns, at) for at in range(len(columns["count"]))]


def _one_part(dtype: torch.dtype, part: torch.Tensor) -> dict[str, Any]:
    accumulator = StatsAccumulator(dtype)
    accumulator.add_bytes(part)
    return accumulator.result()


def fields_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The statistics a tensor of ``dtype`` gets."""
    if dtype.is_complex or not _has_arithmetic(dtype):
        return COUNT_FIELDS
    return FLOAT_FIELDS if dtype.is_floating_point else INTEGER_FIELDS


class StatsAccumulator:
    """The statistics of a stream of elements of one dtype, fed a 1-D block at a time (``add``), or
    a block of raw little-endian bytes (``add_bytes``)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.fields = fields_for(dtype)
        self.count = self.zeros = self.nan = self.posinf = self.neginf = self.finite = 0
        #: The sum of the finite elements, and of those of blocks whose sum overflows, times _SCALE.
        self.total = self.scaled_total = 0.0
        #: The sum of the finite elements' squares, and the norms of blocks too large to square.
        self.squares = 0.0
        self.norms: list[float] = []
        self.low: float | int | None = None
        self.high: float | int | None = None

    def add_bytes(self, data: torch.Tensor) -> None:
        """Add the elements held by ``data``, a 1-D uint8 tensor of whole elements."""
        self.add(data.view(self.dtype))

    def add(self, values: torch.Tensor) -> None:
        """Add the elements of ``values``, a 1-D tensor of this accumulator's dtype."""
        self.count += values.numel()
        if self.fields is COUNT_FIELDS or values.numel() == 0:
            return
        if self.fields is INTEGER_FIELDS:
            self._add_integers(values.view(torch.uint8) if values.dtype == torch.bool else values)
            return
        kind = _float_kind(values.dtype) if values.device.type == "cpu" else None
        if kind is not None:
            self._add_floats(values, *kind)
            return
        # On a device: every float dtype converts exactly to float64, in reused scratch, then reductions.
        if values.dtype == torch.float64:
            wide = values
        else:
            wide = _scratch(values.numel())
            wide.copy_(values)
        total = float(wide.sum())
        squares = float(torch.dot(wide, wide))
        if not (math.isfinite(total) and math.isfinite(squares)):  # NaN, infinities, or squares overflowing
            self._add_unusual(wide)
            return
        self.finite += wide.numel()
        self.total += total
        self.squares += squares
        smallest, largest = torch.aminmax(wide)
        self._extremes(*_signed_zeros(float(smallest), float(largest), torch.signbit, wide))
        self.zeros += wide.numel() - int(torch.count_nonzero(wide))

    def _add_integers(self, values: torch.Tensor) -> None:
        if values.device.type == "cpu" and values.dtype in _NUMPY_INTS:
            low, high, zeros = kernels.int_block(values.numpy())
            self.zeros += zeros
            self._extremes(low, high)
            return
        self.zeros += values.numel() - int(torch.count_nonzero(values))
        smallest, largest = torch.aminmax(values)
        self._extremes(int(smallest), int(largest))

    def _add_floats(self, values: torch.Tensor, code: str, width: torch.dtype, table: np.ndarray | None) -> None:
        """A block on the CPU, in one pass of the kernels (C or numpy: the same sums, spec 6.10's binary64)."""
        total, squares, low, high, zeros, negative = kernels.float_block(values.view(width).numpy(), code, table)
        if not (math.isfinite(total) and math.isfinite(squares)):  # NaN, infinities, or overflowing sums
            wide = _scratch(values.numel())
            wide.copy_(values)
            self._add_unusual(wide)
            return
        self.finite += values.numel()
        self.total += total
        self.squares += squares
        # -0.0 below +0.0 (spec 6.10): the kernel's extremes may be either zero of a tie
        self._extremes((-0.0 if negative else 0.0) if low == 0 else low,
                       (0.0 if zeros > negative else -0.0) if high == 0 else high)
        self.zeros += zeros

    def _add_unusual(self, wide: torch.Tensor) -> None:
        """A block holding NaN or infinities, or float64 elements whose sum or squares overflow."""
        self.zeros += wide.numel() - int(torch.count_nonzero(wide))
        values = self._drop_non_finite(wide)
        if values.numel() == 0:
            return
        self.finite += values.numel()
        total = float(values.sum())
        if math.isfinite(total) and math.isfinite(self.total + total):
            self.total += total
        else:  # float64 elements near its largest value: their sum overflows, a scaled one cannot
            self.scaled_total += float((values * _SCALE).sum())
        scale = 2.0 ** -math.frexp(float(values.abs().max()))[1]  # a power of two: exact
        norm = float(torch.linalg.vector_norm(values * scale)) / scale
        if norm < _LARGE_NORM:
            self.squares += norm * norm
        else:  # a square would overflow or lose digits: kept as a norm
            self.norms.append(norm)
        smallest, largest = torch.aminmax(values)
        self._extremes(*_signed_zeros(float(smallest), float(largest), torch.signbit, values))

    def _drop_non_finite(self, values: torch.Tensor) -> torch.Tensor:
        is_nan, is_inf = torch.isnan(values), torch.isinf(values)
        self.nan += int(is_nan.sum())
        self.posinf += int((is_inf & (values > 0)).sum())
        self.neginf += int((is_inf & (values < 0)).sum())
        return values[~(is_nan | is_inf)]

    def _extremes(self, smallest, largest) -> None:
        self.low = smallest if self.low is None else lower(self.low, smallest)
        self.high = largest if self.high is None else higher(self.high, largest)

    def result(self) -> dict[str, Any]:
        """The statistics of every element added so far."""
        if self.fields is COUNT_FIELDS:
            return {"count": self.count}
        if self.fields is INTEGER_FIELDS:
            return {"count": self.count, "min": self.low, "max": self.high, "zeros": self.zeros}
        if self.low is None or self.high is None:  # no finite element
            mean = l2 = absmax = None
        else:
            mean = self.total / self.finite + (self.scaled_total / self.finite) / _SCALE
            l2 = math.hypot(math.sqrt(self.squares), *self.norms)
            absmax = max(abs(self.low), abs(self.high))
        return {"count": self.count, "min": self.low, "max": self.high, "mean": mean, "l2": l2, "absmax": absmax,
                "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf, "zeros": self.zeros}


def _signed_zeros(low: float, high: float, signbit, values) -> tuple[float, float]:
    """A block's extremes with -0.0 below +0.0 (spec 6.10): min and max reductions return either zero
    of a tie, by the elements' order. ``values`` are finite, so a zero ``low`` means no element has its
    sign bit but a -0.0, and a zero ``high`` none lacks it but a +0.0."""
    if low == 0 or high == 0:
        negative = signbit(values)
        if low == 0:
            low = -0.0 if negative.any() else 0.0
        if high == 0:
            high = -0.0 if negative.all() else 0.0
    return low, high


#: Integer dtypes whose elements numpy holds as they are (the kernels take them).
_NUMPY_INTS = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
#: The kernels' float kinds (ckptfmt.kernels): the code and the integer dtype of the element's width.
_FLOAT_CODES = {torch.float64: ("d", torch.int64), torch.float32: ("f", torch.int32),
                torch.bfloat16: ("b", torch.int16), torch.float16: ("e", torch.int16)}


@functools.cache
def _float_kind(dtype: torch.dtype) -> tuple[str, torch.dtype, np.ndarray | None] | None:
    """``dtype``'s kernel kind (code, the width's integer dtype, the table of its values for the 8-bit
    floats: torch's own conversion of every bit pattern, exact); None: no kernel takes it."""
    if dtype in _FLOAT_CODES:
        code, width = _FLOAT_CODES[dtype]
        return code, width, None
    if dtype.is_floating_point and dtype.itemsize == 1 and _has_arithmetic(dtype):
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float64).numpy()
        return "t", torch.uint8, table
    return None


_SCRATCH = threading.local()


def _scratch(count: int) -> torch.Tensor:
    """This thread's float64 scratch of ``count`` elements, grown as needed and reused: fresh memory
    for every block would cost page faults."""
    held = getattr(_SCRATCH, "tensor", None)
    if held is None or held.numel() < count:
        held = _SCRATCH.tensor = torch.empty(max(count, 1 << 18), dtype=torch.float64)
    return held[:count]


@functools.cache
def _arithmetic_in_place(dtype: torch.dtype) -> bool:
    """Whether torch reduces ``dtype`` itself (float8 kinds are converted to float64 first)."""
    try:
        probe = torch.zeros(8, dtype=torch.uint8).view(dtype)
        torch.aminmax(probe), torch.sum(probe, dtype=torch.float64), torch.isfinite(probe)
        torch.linalg.vector_norm(probe, dtype=torch.float64), torch.count_nonzero(probe)
    except (RuntimeError, TypeError):
        return False
    return True


@functools.cache
def _has_arithmetic(dtype: torch.dtype) -> bool:
    """Whether this torch reduces ``dtype`` (itself, or converted to float64 or viewed as uint8):
    packed float4, the bits kinds and some unsigned widths have no such kernels."""
    try:
        probe = torch.zeros(8, dtype=torch.uint8).view(dtype)
        if dtype == torch.bool:
            probe = probe.view(torch.uint8)
        elif dtype.is_floating_point:
            probe = probe.to(torch.float64)
        torch.aminmax(probe), torch.count_nonzero(probe)
    except (RuntimeError, TypeError):
        return False
    return True


# -- on the tensor's own device ----------------------------------------------------------------

#: Elements reduced at a time on a device: bounds the masks and the cleaned copy (float64: 512 MiB).
DEVICE_BLOCK = 1 << 26
#: Where a field's figure lies in a pending float result.
_FLOAT_SLOTS = ("nan", "posinf", "neginf", "zeros", "finite", "total", "scaled_total", "negative_zeros", "l2", "min",
                "max")


class PendingStats:
    """A tensor's statistics being computed where it lives (a CUDA device): every reduction is
    queued on the current stream and nothing waits for it until ``result``, so that an asynchronous
    save's staging launches them beside its copies and waits once for all (``collect``).

    Branch-free, unlike ``StatsAccumulator``: a GPU computes the masks of non-finite elements
    faster than the host could decide whether it needs them.
    """

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self.fields = fields_for(tensor.dtype)
        self.count = tensor.numel()
        flat = tensor.detach().reshape(-1)
        self.figures: torch.Tensor | None = None
        if self.fields is COUNT_FIELDS or self.count == 0:
            return
        if self.fields is INTEGER_FIELDS:
            self.figures = self._integers(flat)
        else:
            self.figures = self._floats(flat)

    def _integers(self, flat: torch.Tensor) -> torch.Tensor:
        parts = []
        for start in range(0, flat.numel(), DEVICE_BLOCK):
            block = flat[start:start + DEVICE_BLOCK]
            block = block.view(torch.uint8) if block.dtype == torch.bool else block.to(torch.int64)
            smallest, largest = torch.aminmax(block)
            parts.append(torch.stack([smallest.to(torch.int64), largest.to(torch.int64),
                                      torch.count_nonzero(block).to(torch.int64)]))
        stacked = torch.stack(parts)
        return torch.stack([stacked[:, 0].min(), stacked[:, 1].max(), stacked[:, 2].sum()])

    def _floats(self, flat: torch.Tensor) -> torch.Tensor:
        f64 = torch.float64
        rows = []
        for start in range(0, flat.numel(), DEVICE_BLOCK):
            block = flat[start:start + DEVICE_BLOCK]
            if not _arithmetic_in_place(block.dtype) or block.dtype in (torch.float16, torch.bfloat16):
                block = block.to(torch.float32)  # exact for every float dtype below 32 bits
            finite = torch.isfinite(block)
            clean = torch.where(finite, block, torch.zeros((), dtype=block.dtype, device=block.device))
            peak = clean.abs().amax().to(f64)
            scale = torch.where(peak > 0, torch.ldexp(torch.ones((), dtype=f64, device=block.device),
                                                      -torch.frexp(peak).exponent), torch.ones_like(peak))
            infinity = torch.full((), float("inf"), dtype=block.dtype, device=block.device)
            rows.append(torch.stack([
                torch.isnan(block).sum().to(f64), torch.isposinf(block).sum().to(f64),
                torch.isneginf(block).sum().to(f64), (block == 0).sum().to(f64), finite.sum().to(f64),
                clean.sum(dtype=f64), (clean.to(f64) * _SCALE).sum(),
                ((block == 0) & torch.signbit(block)).sum().to(f64),  # signs a zero extreme (spec 6.10)
                torch.linalg.vector_norm(clean.to(f64) * scale) / scale,
                torch.where(finite, block, infinity).amin().to(f64),
                torch.where(finite, block, -infinity).amax().to(f64),
            ]))
        table = torch.stack(rows)
        norms = table[:, 8]
        peak = norms.amax()  # the blocks' norms combined scaled by the largest, as math.hypot does
        usable = (peak > 0) & torch.isfinite(peak)
        l2 = torch.where(usable, torch.linalg.vector_norm(norms / torch.where(usable, peak, 1)) * peak, peak)
        return torch.cat([table[:, :8].sum(0), l2.reshape(1), table[:, 9].amin().reshape(1),
                          table[:, 10].amax().reshape(1)])

    def result(self, figures: torch.Tensor | None = None) -> dict[str, Any]:
        """The statistics, from ``figures`` (this tensor's, already on the host) or by waiting for them."""
        if self.figures is None:
            return StatsAccumulator(self.dtype).result() | {"count": self.count}
        values = (figures if figures is not None else self.figures.cpu()).tolist()
        if self.fields is INTEGER_FIELDS:
            low, high, nonzero = (int(v) for v in values)
            return {"count": self.count, "min": low, "max": high, "zeros": self.count - nonzero}
        named = dict(zip(_FLOAT_SLOTS, values))
        finite = int(named["finite"])
        some = finite > 0
        if named["min"] == 0:  # -0.0 below +0.0 (spec 6.10), whatever the reduction's order
            named["min"] = -0.0 if named["negative_zeros"] else 0.0
        if named["max"] == 0:
            named["max"] = 0.0 if named["zeros"] > named["negative_zeros"] else -0.0
        mean = None
        if some:  # float64 elements near its largest value overflow the plain sum, never the scaled one
            mean = (named["total"] / finite if math.isfinite(named["total"])
                    else named["scaled_total"] / finite / _SCALE)
        return {"count": self.count, "min": named["min"] if some else None, "max": named["max"] if some else None,
                "mean": mean, "l2": named["l2"] if some else None,
                "absmax": max(abs(named["min"]), abs(named["max"])) if some else None,
                "nan": int(named["nan"]), "posinf": int(named["posinf"]), "neginf": int(named["neginf"]),
                "zeros": int(named["zeros"])}


def collect(pending: list[PendingStats]) -> list[dict[str, Any]]:
    """The statistics of every pending tensor, brought to the host in one transfer per device and kind."""
    groups: dict[tuple, list[int]] = {}
    for index, item in enumerate(pending):
        if item.figures is not None:
            groups.setdefault((item.figures.device, item.figures.dtype, item.figures.numel()), []).append(index)
    figures: dict[int, torch.Tensor] = {}
    for indexes in groups.values():
        moved = torch.stack([pending[i].figures for i in indexes]).cpu()  # type: ignore[misc]
        figures.update(zip(indexes, moved))
    return [item.result(figures.get(index)) for index, item in enumerate(pending)]
