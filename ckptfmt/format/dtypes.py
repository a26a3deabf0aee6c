"""The dtype table: the format's names for tensor element types, and their torch dtypes.

Names are torch's own (``torch.float32`` -> ``"float32"``). The table is part of
the format, so a manifest parses even where the installed torch lacks a dtype;
only reading such a tensor needs a torch that has it. Quantized dtypes carry
scales and zero points outside their bytes and are not storable as plain bytes.
"""

from __future__ import annotations

import torch

from ckptfmt.errors import CheckpointError, ManifestError, UnsupportedValueError, quoted

#: format dtype name -> bytes per element (format version 1.0).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}

#: format name -> torch dtype, for the dtypes this torch build has.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ITEMSIZES if isinstance(getattr(torch, name, None), torch.dtype)
}
_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for a torch dtype; raises for dtypes it cannot store."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"dtype {dtype} cannot be stored (quantized and sub-byte integer dtypes are not in format 1.0)"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of a format dtype name; raises ManifestError for unknown names."""
    try:
        return ITEMSIZES[name]
    except (KeyError, TypeError):
        raise ManifestError(f"unknown dtype {quoted(name)} (written by a newer ckptfmt?)") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a format dtype name."""
    itemsize(name)
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name} needs a newer torch than {torch.__version__}") from None
