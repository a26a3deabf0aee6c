"""What the restricted unpickler (converters/pickles.py) makes in place of real objects.

Its limits, its error, the placeholders for globals it will not import (``Global``) and for
calls it will not make (``Node``), the storage records a torch file's persistent ids name
(``StorageType``, ``Storage``) and the tensors to build over them (``PendingTensor``); and
the markers it returns for ``torch.Tensor`` and ``nn.Parameter``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptfmt.errors import CheckpointError

#: The most pickle bytes one parse may read (a state dict of 100k tensors is ~20 MB).
MAX_PICKLE_BYTES = 1 << 30
#: The most elements a storage may declare (2**40 elements: far beyond any real file).
MAX_STORAGE_ELEMENTS = 1 << 40
#: How deep pickle.loads / _load_from_bytes may nest inside each other.
MAX_NESTED_PICKLES = 8
#: Deepest container nesting accepted (ckptfmt's own limit is 256).
MAX_DEPTH = 256

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64, "UntypedStorage": torch.uint8,
}
#: Markers find_class returns for torch.Tensor / nn.Parameter (RestrictedUnpickler.TENSOR_TYPE, ...).
TENSOR_TYPE = object()
PARAMETER_TYPE = object()


class PickleError(CheckpointError, ValueError):
    """A pickle this module refuses (malformed, over a limit, or asking for something not allowed)."""


# --------------------------------------------------------------------------- placeholders


class Global:
    """A global the pickle named but that is not allowed: never imported, never called."""

    __slots__ = ("module", "qualname")

    def __init__(self, module: str, qualname: str):
        self.module = module
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"<global {self.module}.{self.qualname}>"


class Node:
    """A recorded call of a placeholder: func(*args, **kwargs), then ops applied to the result.

    ``kind`` is "reduce" (REDUCE, INST, OBJ) or "newobj" (NEWOBJ, NEWOBJ_EX: cls.__new__(cls, *args));
    ``ops`` are ("build", state), ("extend", items) or ("setitems", [(key, value), ...]).
    """

    __slots__ = ("func", "kind", "args", "kwargs", "ops", "__weakref__")

    def __init__(self, func: Any, kind: str, args: tuple, kwargs: dict | None = None):
        self.func = func
        self.kind = kind
        self.args = args
        self.kwargs = kwargs
        self.ops: list[tuple] = []

    @property
    def name(self) -> tuple[str, str]:
        """(module, qualname) of the callable, for display."""
        func = self.func
        while isinstance(func, Node):
            func = func.func
        if isinstance(func, Global):
            if (func.module, func.qualname) in (("copyreg", "_reconstructor"), ("copyreg", "__newobj__")) \
                    and self.args and isinstance(self.args[0], Global):
                return self.args[0].module, self.args[0].qualname
            return func.module, func.qualname
        return "?", "?"

    def __repr__(self) -> str:
        module, qualname = self.name
        return f"<node {module}.{qualname}>"


class StorageType:
    """A torch storage class named in a persistent id (never the real class)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype


class Storage:
    """A storage record: ``numel`` elements of ``dtype``; its bytes are bound by the file reader."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, location: str):
        if type(numel) is not int or not 0 <= numel <= MAX_STORAGE_ELEMENTS:
            raise PickleError(f"storage {key!r}: absurd element count {numel!r}")
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.location = location
        self.data: memoryview | None = None  # raw bytes, bound once known
        self._flat: dict[torch.dtype, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def bind(self, data: memoryview) -> None:
        if len(data) != self.nbytes:
            raise PickleError(f"storage {self.key!r}: {len(data)} bytes recorded, {self.nbytes} expected "
                              f"({self.numel} x {self.dtype})")
        self.data = data

    def flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The storage as a flat tensor of ``dtype`` over the bound bytes (no copy)."""
        dtype = dtype or self.dtype
        if dtype not in self._flat:
            if self.data is None:
                raise PickleError(f"storage {self.key!r} has no data")
            if len(self.data) % _itemsize(dtype):
                raise PickleError(f"storage {self.key!r}: {len(self.data)} bytes is not a whole number of {dtype}")
            if len(self.data) == 0:
                tensor = torch.empty(0, dtype=dtype)
            else:
                tensor = torch.frombuffer(self.data, dtype=torch.uint8)
                tensor = tensor.view(dtype) if dtype != torch.uint8 else tensor
            self._flat[dtype] = tensor
        return self._flat[dtype]

    def torch_storage(self) -> torch.storage.TypedStorage:
        """A real torch storage over the same bytes (for opaque objects that hold a storage)."""
        flat = self.flat()
        return torch.storage.TypedStorage(wrap_storage=flat.untyped_storage(), dtype=self.dtype, _internal=True)


class PendingTensor:
    """A tensor to build from a storage once every storage's bytes are bound."""

    __slots__ = ("storage", "offset", "size", "stride", "requires_grad", "dtype", "parameter", "_tensor")

    def __init__(self, storage: Storage, offset: int, size: tuple, stride: tuple, requires_grad: bool,
                 dtype: torch.dtype | None = None):
        if not isinstance(storage, Storage):
            raise PickleError(f"tensor rebuilt from a {type(storage).__name__}, not a storage")
        size, stride = int_tuple(size, "size"), int_tuple(stride, "stride")
        if type(offset) is not int or offset < 0 or len(size) != len(stride) or len(size) > 64:
            raise PickleError(f"tensor over storage {storage.key!r}: malformed offset, size or stride")
        if any(s < 0 for s in size) or any(s < 0 for s in stride):
            raise PickleError(f"tensor over storage {storage.key!r}: negative size or stride")
        if type(requires_grad) is not bool:
            raise PickleError("tensor requires_grad is not a bool")
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.requires_grad = requires_grad
        self.dtype = dtype
        self.parameter = False
        self._tensor: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        if self._tensor is None:
            flat = self.storage.flat(self.dtype)
            if math.prod(self.size) > 0:
                extent = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1
                if extent > flat.numel():
                    raise PickleError(f"tensor of shape {list(self.size)} reaches element {extent} of storage "
                                      f"{self.storage.key!r}, which holds {flat.numel()}")
            tensor = flat.as_strided(self.size, self.stride, self.offset)
            if self.parameter:
                tensor = torch.nn.Parameter(tensor, requires_grad=self.requires_grad)
            elif self.requires_grad:
                tensor.requires_grad_(True)
            self._tensor = tensor
        return self._tensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def int_tuple(value: Any, what: str) -> tuple:
    if type(value) not in (tuple, list, torch.Size) or not all(type(v) is int for v in value):
        raise PickleError(f"tensor {what} is not a tuple of ints")
    return tuple(value)

