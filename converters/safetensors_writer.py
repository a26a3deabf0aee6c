"""Write safetensors files (for export): the file safetensors' own writer makes of the same tensors
and metadata, reading one tensor at a time (the format: converters/safetensors_format.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckptfmt.converters.safetensors_dtypes import PACKED, TORCH_TO_SAFETENSORS
from ckptfmt.errors import CheckpointError

_ALIGN = 8
#: safetensors' Dtype enum order, narrowest first: its writer puts the highest first, then sorts by name.
_WRITE_RANK = {st: rank for rank, st in enumerate((
    "BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"))}


@dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its name, torch dtype and shape, and how to read it when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header_bytes(tensors: list[OutTensor], metadata: dict[str, str] | None) -> bytes:
    """The length and JSON header as safetensors writes them: compact, padded with spaces to 8 bytes."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    position = 0
    for t in tensors:
        st = TORCH_TO_SAFETENSORS[t.dtype]
        shape = list(t.shape)
        if st in PACKED:
            if not shape:
                raise CheckpointError(f"tensor {t.name!r}: a 0-d {t.dtype} tensor has no safetensors shape")
            shape[-1] *= PACKED[st]
        header[t.name] = {"dtype": st, "shape": shape, "data_offsets": [position, position + t.nbytes]}
        position += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % _ALIGN)  # the buffer starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: str, tensors: Iterable[OutTensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file reading one tensor at a time; returns the bytes written.

    The file is the one safetensors' own writer makes of the same tensors and metadata:
    tensors ordered by dtype, widest first (so each is aligned to its element size),
    then by name, and the same header bytes.
    """
    if sys.byteorder != "little":  # pragma: no cover
        raise CheckpointError("writing safetensors on a big-endian machine is not supported")
    ordered = sorted(tensors, key=_write_order)
    names = [t.name for t in ordered]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise CheckpointError(f"{path}: tensor name(s) given twice: {', '.join(map(repr, repeated))}")
    if "__metadata__" in names:
        raise CheckpointError(f"{path}: a tensor cannot be named '__metadata__' in safetensors")
    header = _header_bytes(ordered, metadata)
    written = len(header)
    with open(path, "wb") as f:
        f.write(header)
        for t in ordered:
            value = t.load()
            tensor = torch.from_numpy(value) if not isinstance(value, torch.Tensor) else value.detach()
            if tensor.dtype != t.dtype or tuple(tensor.shape) != t.shape:
                raise CheckpointError(
                    f"tensor {t.name!r}: read {tensor.dtype} {tuple(tensor.shape)}, expected {t.dtype} {t.shape}"
                )
            if tensor.numel():
                tensor = tensor.cpu().resolve_conj().resolve_neg().contiguous()
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            written += t.nbytes
            del value, tensor
        f.flush()
        os.fsync(f.fileno())
    return written


def _write_order(t: OutTensor) -> tuple[int, str]:
    """safetensors' writer order: the widest dtype first (by its enum), then the name."""
    st = TORCH_TO_SAFETENSORS.get(t.dtype)
    if st is None:
        raise CheckpointError(f"tensor {t.name!r}: dtype {t.dtype} has no safetensors equivalent")
    return -_WRITE_RANK[st], t.name
