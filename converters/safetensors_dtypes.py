"""safetensors' dtypes and torch's: what the reader (safetensors_format) and the writer
(safetensors_writer) both translate by.
"""

from __future__ import annotations

import torch

#: safetensors dtype -> (torch dtype name, bytes per torch element). F4 packs two
#: 4-bit values per byte: safetensors counts the 4-bit values in the shape's last
#: dimension, torch's float4_e2m1fn_x2 counts the bytes.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2": ("float8_e5m2", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1), "F4": ("float4_e2m1fn_x2", 1),
}
#: safetensors dtypes that torch has no dtype for.
NO_TORCH_DTYPE = {"F6_E2M3", "F6_E3M2"}
PACKED = {"F4": 2}  # values per torch element
#: torch dtype -> safetensors dtype, for the export writer.
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    getattr(torch, name): st for st, (name, _) in SAFETENSORS_DTYPES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
