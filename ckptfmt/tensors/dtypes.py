"""The torch dtype of each format dtype name (spec 8), for the dtypes this torch build has.

The names and item sizes are the format's (``format/dtypes.py``) and need no torch; a manifest
parses even where the installed torch lacks a dtype, and only reading such a tensor needs a
torch that has it. Quantized dtypes carry scales and zero points outside their bytes and are
not storable as plain bytes.
"""

from __future__ import annotations

import torch

from ckptfmt.errors import CheckpointError, UnsupportedValueError
from ckptfmt.format.dtypes import ITEMSIZES, itemsize

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


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a format dtype name."""
    found = DTYPES.get(name) if isinstance(name, str) else None  # once per tensor a load builds
    if found is not None:
        return found
    itemsize(name)
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name} needs a newer torch than {torch.__version__}") from None
