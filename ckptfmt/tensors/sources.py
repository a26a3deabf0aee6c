"""Turning tensor-like leaves into raw little-endian C-order bytes, and back.

torch tensors (parameters included) and numpy arrays are stored; sparse,
quantized, meta and subclassed tensors are refused with the offending path.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from ckptfmt.errors import UnsupportedValueError
from ckptfmt.format.limits import MAX_DIMS
from ckptfmt.tensors.dtypes import dtype_from_name, dtype_name

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckptfmt stores little-endian bytes and supports little-endian hosts only")


@dataclass(slots=True)
class TensorSource:
    """A tensor ready to be written: its CPU bytes and what the manifest says about it."""

    tensor: torch.Tensor  # CPU, contiguous; owns or views the bytes below
    dtype: str
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    #: True when ``tensor`` views the caller's memory (stable address across saves).
    borrowed: bool
    #: True when that memory cannot change until the save ends (an asynchronous save's staging buffers).
    frozen: bool = False
    #: The tensor's statistics when taken before its bytes reached ``tensor`` (on its CUDA device);
    #: None: the save takes them as it hashes the bytes.
    stats: dict | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    @property
    def itemsize(self) -> int:
        return self.tensor.element_size()

    def byte_view(self) -> memoryview:
        """The raw bytes, without copying."""
        return byte_view(self.tensor)

    def bytes_tensor(self) -> torch.Tensor:
        """The raw bytes as a 1-D uint8 tensor, without copying."""
        return self.tensor.reshape(-1).view(torch.uint8)


def prepare(value: torch.Tensor | np.ndarray, where: object) -> TensorSource:
    """Check a leaf and bring it to contiguous CPU memory (copying only when needed); errors name it as
    ``str(where)``, spelled out only then."""
    if value.ndim > MAX_DIMS:
        raise UnsupportedValueError(f"{where}: {value.ndim} dimensions, more than the format holds ({MAX_DIMS})")
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.byteorder == ">":
            raise UnsupportedValueError(f"{where}: numpy arrays of dtype {value.dtype} cannot be stored")
        # Not np.ascontiguousarray alone: it turns 0-d arrays into 1-d ones.
        array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
        try:
            tensor = torch.from_numpy(array)
        except TypeError as exc:
            raise UnsupportedValueError(f"{where}: {exc}") from None
        return TensorSource(tensor, dtype_name(tensor.dtype), tuple(value.shape), "numpy", False, array is value)
    kind = type(value)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        raise UnsupportedValueError(f"{where}: tensor subclass {kind.__qualname__} is not supported yet")
    if value.layout != torch.strided or value.is_quantized or value.is_nested:
        raise UnsupportedValueError(f"{where}: {value.layout} / quantized / nested tensors are not supported")
    if value.is_meta:
        raise UnsupportedValueError(f"{where}: meta tensors have no data to save")
    name = dtype_name(value.dtype)
    requires_grad = value.requires_grad
    # Detached only where autograd tracks it, a view resolved only where lazy: cheap tests first, as a save of
    # many small tensors is mostly per-tensor work like this.
    tensor = value.detach() if requires_grad or kind is not torch.Tensor else value
    resolved = tensor.is_conj() or tensor.is_neg()  # a lazy view: its values need a copy
    if resolved:
        tensor = tensor.resolve_conj().resolve_neg()
    on_cpu = tensor.is_cpu
    if not on_cpu:
        tensor = tensor.cpu()
    contiguous = tensor.is_contiguous()
    if not contiguous:
        tensor = tensor.contiguous()
    return TensorSource(
        tensor, name, tuple(value.shape),
        "parameter" if kind is torch.nn.Parameter else "tensor",
        requires_grad, on_cpu and contiguous and not resolved,
    )


def empty(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Fresh CPU memory for a tensor about to be read."""
    return torch.empty(shape, dtype=dtype_from_name(dtype))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable raw bytes of a contiguous CPU tensor."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy().data)


def finish(tensor: torch.Tensor, kind: str, requires_grad: bool):
    """Give a loaded tensor back the type it was saved as."""
    if kind == "numpy":
        return tensor.numpy()
    if kind == "parameter":
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor
