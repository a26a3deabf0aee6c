"""The dtype table: the names the format uses for every torch dtype it stores.

Names are torch's own (``torch.float32`` -> ``"float32"``). Quantized dtypes carry
scales and zero points outside their bytes and are not storable as plain bytes.
"""

from __future__ import annotations

import torch

from .errors import ManifestError, UnsupportedValueError

_NAMES = (
    "bool",
    "uint8", "uint16", "uint32", "uint64",
    "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
    "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)

#: format name -> torch dtype, for the dtypes this torch build has.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for a torch dtype; raises for dtypes it cannot store."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedValueError(f"dtype {dtype} cannot be stored (quantized dtypes are not supported)") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a format dtype name; raises ManifestError for unknown names."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ManifestError(f"unknown dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a format dtype name."""
    return dtype_from_name(name).itemsize
