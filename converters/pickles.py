"""A restricted unpickler: reads torch.save pickles without ever running code from them.

``RestrictedUnpickler`` subclasses Python's pure-Python ``pickle._Unpickler`` so that
every opcode that could call something (REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ, BUILD,
APPEND(S), SETITEM(S), ADDITEMS) goes through this module:

- ``find_class`` returns a real object only for an allow-list: torch dtypes (values),
  storage classes (markers for persistent ids), and builders re-implemented here that
  only make plain values or tensors from storages: ``collections.OrderedDict``,
  ``torch.Size``, ``torch.device``, ``torch._utils._rebuild_tensor`` / ``_v2`` / ``_v3``,
  ``_rebuild_parameter``, ``_rebuild_parameter_with_state`` (empty state),
  ``torch._tensor._rebuild_from_type_v2`` (plain tensors and parameters),
  ``builtins.set`` / ``frozenset`` / ``complex`` / ``bytes``, ``_codecs.encode`` (how
  protocol 2 writes bytes; latin-1 only), and two that parse nested data with this same
  restricted machinery: ``pickle.loads`` (how ckptfmt's export writes opaque objects
  back) and ``torch.storage._load_from_bytes`` (how a tensor pickled outside torch.save
  carries its storage: a whole torch file, read by the ``torch_files`` reader the
  unpickler was given, converters/torch_format.py's ``load_object``).
- Any other global becomes a ``Global`` placeholder. Calling one (REDUCE, NEWOBJ, ...)
  calls nothing: it records a ``Node`` (the callable, its arguments, then the BUILD
  state and list/dict items applied to it, in order).
- numpy arrays, numpy scalars and their dtypes are recorded as nodes too, and turned
  into real arrays and scalars afterwards (``to_value_tree``) when they are plain
  numeric data (kinds b, i, u, f, c; not big-endian); otherwise they stay opaque.
- ``argparse.Namespace`` and every other class instance stay opaque: ckptfmt has no
  exact type for them, and rebuilding them means importing their module (running code).

``to_value_tree`` turns the unpickled result into a ckptfmt value tree. Each node (or
placeholder used as a value) becomes an ``ckptfmt.OpaqueObject(module, qualname, pickle)``
whose ``pickle`` is a self-contained protocol-4 pickle: STACK_GLOBAL module qualname,
the arguments, REDUCE or NEWOBJ, then the recorded APPENDS / SETITEMS / BUILD. Unpickled
by a user who has the original classes (``pickle.loads``, or ``torch.load(weights_only=False)``
of a ckptfmt export), it rebuilds the original object. Values nested in the object are
pickled inside those bytes: plain values as usual, tensors with torch's own pickling
(``torch._utils._rebuild_tensor_v2`` over ``torch.storage._load_from_bytes``, i.e. each
tensor carries a copy of its storage's bytes); nested unknown objects as nested nodes.
Identity is kept within one opaque object (pickle memo), not across two of them.

Reading these bytes back with this module (re-importing an export) is safe: the
nested pickle goes through the same restrictions.

Limits: a pickle's input is capped (``MAX_PICKLE_BYTES``); every read goes through a
budget, so huge length fields fail fast. Nesting, cycles and bad arguments to the
builders raise ``ckptfmt.CheckpointError``.
"""

from __future__ import annotations

import _compat_pickle
import io
import math
import pickle
import re
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ckptfmt import OpaqueObject
from ckptfmt.errors import CheckpointError
from ckptfmt.format.values import format_key

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

#: torch.float32 and friends, by name (vars(), not getattr: torch imports submodules lazily on getattr).
_TORCH_DTYPES = {name: value for name, value in vars(torch).items()
                 if isinstance(value, torch.dtype) and not name.startswith("_")}

_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")


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
        size, stride = _int_tuple(size, "size"), _int_tuple(stride, "stride")
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


def _int_tuple(value: Any, what: str) -> tuple:
    if type(value) not in (tuple, list, torch.Size) or not all(type(v) is int for v in value):
        raise PickleError(f"tensor {what} is not a tuple of ints")
    return tuple(value)


# --------------------------------------------------------------------------- allowed builders


class Builder:
    """An allowed callable: ``fn(unpickler, *args)``; ``newobj`` allows it under NEWOBJ too."""

    __slots__ = ("module", "qualname", "fn", "newobj")

    def __init__(self, module: str, qualname: str, fn: Callable, newobj: bool = False):
        self.module, self.qualname, self.fn, self.newobj = module, qualname, fn, newobj


def _ordered_dict(u, *args):
    if len(args) > 1:
        raise PickleError("OrderedDict() with more than one argument")
    result = OrderedDict()
    for item in (args[0] if args else ()):
        if type(item) not in (tuple, list) or len(item) != 2:
            raise PickleError("OrderedDict() items are not pairs")
        result[item[0]] = item[1]
    return result


def _size(u, dims=()):
    return torch.Size(_int_tuple(dims, "torch.Size"))


def _device(u, *args):
    if (
        not 1 <= len(args) <= 2
        or type(args[0]) is not str
        or (len(args) == 2 and type(args[1]) not in (int, type(None)))
    ):
        raise PickleError("malformed torch.device arguments")
    return torch.device(*args)


def _plain_items(values):
    if type(values) not in (list, tuple, set, frozenset):
        raise PickleError("set() / frozenset() of something other than a list or tuple")
    return values


def _set(u, values=()):
    return set(_plain_items(values))


def _frozenset(u, values=()):
    return frozenset(_plain_items(values))


def _complex(u, real=0.0, imag=0.0):
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise PickleError("complex() of something other than numbers")
    return complex(real, imag)


def _bytes(u, *args):
    if not args:
        return b""
    if (
        len(args) == 1
        and type(args[0]) in (bytes, list)
        and all(type(b) is int for b in (args[0] if type(args[0]) is list else []))
    ):
        return bytes(args[0])
    raise PickleError("malformed bytes() arguments")


def _codecs_encode(u, text, encoding="utf-8", *rest):
    if type(text) is not str or encoding != "latin1" or rest:
        raise PickleError("_codecs.encode is allowed only as protocol 2 writes bytes (str, 'latin1')")
    return text.encode("latin1")


def _rebuild_tensor(u, storage, offset, size, stride, *_ignored):
    return PendingTensor(storage, offset, size, stride, False)


def _rebuild_tensor_v2(u, storage, offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if metadata:
        u.notes.add("tensor metadata (torch._utils.set_tensor_metadata) ignored")
    return PendingTensor(storage, offset, size, stride, requires_grad)


def _rebuild_tensor_v3(u, storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if type(dtype) is not torch.dtype:
        raise PickleError("_rebuild_tensor_v3 without a dtype")
    if metadata:
        u.notes.add("tensor metadata (torch._utils.set_tensor_metadata) ignored")
    return PendingTensor(storage, offset, size, stride, requires_grad, dtype)


def _as_parameter(data, requires_grad):
    if not isinstance(data, PendingTensor) or type(requires_grad) is not bool:
        raise PickleError("nn.Parameter rebuilt from something other than a tensor")
    data.parameter = True
    data.requires_grad = requires_grad
    return data


def _rebuild_parameter(u, data, requires_grad, backward_hooks=None):
    return _as_parameter(data, requires_grad)


def _rebuild_parameter_with_state(u, data, requires_grad, backward_hooks, state):
    if state:  # attributes on the parameter: keep the whole parameter opaque
        return Node(u.placeholder("torch._utils", "_rebuild_parameter_with_state"), "reduce",
                    (data, requires_grad, backward_hooks, state))
    return _as_parameter(data, requires_grad)


def _rebuild_from_type_v2(u, func, new_type, args, state):
    plain = new_type in (u.TENSOR_TYPE, u.PARAMETER_TYPE)
    if isinstance(func, Builder) and plain and not state and type(args) is tuple:
        result = u.call(func, args, "reduce")
        if new_type is u.PARAMETER_TYPE:
            result = _as_parameter(result, result.requires_grad)
        return result
    return Node(u.placeholder("torch._tensor", "_rebuild_from_type_v2"), "reduce", (func, new_type, args, state))


def attributed_tensor(node: Node) -> tuple[PendingTensor, list[str]] | None:
    """The plain tensor under one pickled with Python attributes, and their names; None for other nodes.

    ``torch.save`` keeps a tensor's ``__dict__`` (DeepSpeed sets ``ds_id``, ``ds_shape``, ...)
    through ``_rebuild_from_type_v2`` or ``_rebuild_parameter_with_state`` with a state, which
    the reader keeps opaque (a copy of the bytes). A reader that has no use for the
    attributes takes the tensor itself, over the mapped storage.
    """
    if not isinstance(node, Node) or node.kind != "reduce" or node.ops or len(node.args) != 4:
        return None
    if node.name == ("torch._tensor", "_rebuild_from_type_v2"):
        func, new_type, args, state = node.args
        if not (isinstance(func, Builder) and (func.module, func.qualname) == ("torch._utils", "_rebuild_tensor_v2")
                and new_type in (RestrictedUnpickler.TENSOR_TYPE, RestrictedUnpickler.PARAMETER_TYPE)
                and type(args) is tuple and len(args) >= 4):
            return None
        tensor = PendingTensor(*args[:4], False)
        if new_type is RestrictedUnpickler.PARAMETER_TYPE:
            tensor = _as_parameter(tensor, bool(len(args) > 4 and args[4] is True))
    elif node.name == ("torch._utils", "_rebuild_parameter_with_state"):
        data, requires_grad, _hooks, state = node.args
        tensor = _as_parameter(data, requires_grad)
    else:
        return None
    return tensor, _state_names(state)


def _state_names(state: Any) -> list[str]:
    """Attribute names in a pickled object state: a dict, or (dict, slots dict)."""
    parts = state if type(state) is tuple else (state,)
    return sorted(str(k) for part in parts if isinstance(part, dict) for k in part)


def _pickle_loads(u, data, *rest):
    if type(data) not in (bytes, bytearray) or rest:
        raise PickleError("pickle.loads of something other than bytes")
    return u.nested(bytes(data))


def _load_from_bytes(u, data):
    if type(data) is not bytes:
        raise PickleError("torch.storage._load_from_bytes of something other than bytes")
    return u.nested_torch_file(data)


_BUILDERS = {
    ("collections", "OrderedDict"): (_ordered_dict, True),
    ("torch", "Size"): (_size, True),
    ("torch", "device"): (_device, True),
    ("builtins", "set"): (_set, True),
    ("builtins", "frozenset"): (_frozenset, True),
    ("builtins", "complex"): (_complex, True),
    ("builtins", "bytes"): (_bytes, True),
    ("_codecs", "encode"): (_codecs_encode, False),
    ("torch._utils", "_rebuild_tensor"): (_rebuild_tensor, False),
    ("torch._utils", "_rebuild_tensor_v2"): (_rebuild_tensor_v2, False),
    ("torch._utils", "_rebuild_tensor_v3"): (_rebuild_tensor_v3, False),
    ("torch._utils", "_rebuild_parameter"): (_rebuild_parameter, False),
    ("torch._utils", "_rebuild_parameter_with_state"): (_rebuild_parameter_with_state, False),
    ("torch._tensor", "_rebuild_from_type_v2"): (_rebuild_from_type_v2, False),
    ("pickle", "loads"): (_pickle_loads, False),
    ("_pickle", "loads"): (_pickle_loads, False),
    ("torch.storage", "_load_from_bytes"): (_load_from_bytes, False),
}


# --------------------------------------------------------------------------- the unpickler


class TorchFileReader(Protocol):
    """Reads a whole torch file held in memory with this module's restrictions (torch_format.load_object)."""

    def __call__(self, data: bytes, where: str, *, depth: int, notes: set) -> Any: ...


class BudgetReader:
    """A read-only file over a buffer (bytes, mmap) that refuses to read past ``limit``."""

    def __init__(self, buffer, start: int = 0, limit: int = MAX_PICKLE_BYTES):
        self.view = memoryview(buffer).cast("B")
        source = buffer.obj if isinstance(buffer, memoryview) else buffer
        if not hasattr(source, "find") or len(source) != len(self.view):
            source = bytes(self.view)
        self._find = source.find  # bytes, bytearray and mmap: find(sub, start, end) without copying
        self.pos = start
        self.end = min(len(self.view), start + limit)
        self.limit = limit

    def _take(self, n: int) -> memoryview:
        if n < 0:
            n = self.end - self.pos
        if self.pos + n > self.end:
            if self.end < len(self.view):
                raise PickleError(f"pickle reads past its {self.limit}-byte budget")
            n = self.end - self.pos  # short read: the unpickler reports truncation
        chunk = self.view[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def read(self, n: int = -1) -> bytes:
        return bytes(self._take(n))

    def readinto(self, b) -> int:
        chunk = self._take(len(b))
        memoryview(b).cast("B")[:len(chunk)] = chunk
        return len(chunk)

    def readline(self, size: int = -1) -> bytes:
        stop = min(self.end, self.pos + 65536)  # no opcode argument line is longer
        index = self._find(b"\n", self.pos, stop)
        return self.read((index + 1 - self.pos) if index >= 0 else stop - self.pos)

    def tell(self) -> int:
        return self.pos


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles without importing or calling anything outside the allow-list (module docstring)."""

    TENSOR_TYPE = object()     # markers find_class returns for torch.Tensor / nn.Parameter
    PARAMETER_TYPE = object()

    def __init__(self, file, *, persistent_load: Callable[[Any], Any] | None = None,
                 depth: int = 0, notes: set | None = None, torch_files: TorchFileReader | None = None):
        """``torch_files`` reads the torch files a pickle embeds (``torch.storage._load_from_bytes``);
        without one, such a pickle is refused."""
        super().__init__(file)
        self._persistent = persistent_load
        self.torch_files = torch_files
        self.depth = depth
        self.notes: set[str] = notes if notes is not None else set()
        self._globals: dict[tuple[str, str], Any] = {}

    # --- names

    def placeholder(self, module: str, qualname: str) -> Global:
        key = (module, qualname)
        if key not in self._globals or not isinstance(self._globals[key], Global):
            self._globals[key] = Global(module, qualname)
        return self._globals[key]

    def find_class(self, module: str, name: str) -> Any:
        if type(module) is not str or type(name) is not str:
            raise PickleError("global names must be strings")
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as pickle.Unpickler maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        if key in self._globals:
            return self._globals[key]
        if key in _BUILDERS:
            fn, newobj = _BUILDERS[key]
            value: Any = Builder(module, name, fn, newobj)
        elif module in ("torch", "torch.storage") and name in STORAGE_DTYPES:
            value = StorageType(name, STORAGE_DTYPES[name])
        elif module == "torch" and name in _TORCH_DTYPES:
            value = _TORCH_DTYPES[name]
        elif key == ("torch", "Tensor"):
            value = self.TENSOR_TYPE
        elif key in (("torch.nn.parameter", "Parameter"), ("torch.nn", "Parameter")):
            value = self.PARAMETER_TYPE
        else:
            value = Global(module, name)
        self._globals[key] = value
        return value

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise PickleError("unexpected persistent id in a plain pickle")
        return self._persistent(pid)

    # --- calls

    def call(self, func: Any, args: Any, kind: str, kwargs: dict | None = None) -> Any:
        if type(args) is not tuple:
            raise PickleError(f"call arguments are a {type(args).__name__}, not a tuple")
        if isinstance(func, (Global, Node)):
            return Node(func, kind, args, kwargs)
        if isinstance(func, Builder):
            if kwargs or (kind == "newobj" and not func.newobj):
                raise PickleError(f"{func.module}.{func.qualname} used in an unsupported way")
            try:
                return func.fn(self, *args)
            except CheckpointError:
                raise
            except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
                raise PickleError(f"{func.module}.{func.qualname}: bad arguments ({exc})") from None
        if func is self.TENSOR_TYPE or func is self.PARAMETER_TYPE:
            name = "Tensor" if func is self.TENSOR_TYPE else "Parameter"
            return Node(
                self.placeholder("torch" if name == "Tensor" else "torch.nn.parameter", name), kind, args, kwargs
            )
        raise PickleError(f"pickle calls a {type(func).__name__}, which is not allowed")

    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self.call(self.stack[-1], args, "reduce")

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self.call(cls, args, "newobj"))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if type(kwargs) is not dict:
            raise PickleError("NEWOBJ_EX keyword arguments are not a dict")
        self.append(self.call(cls, args, "newobj", kwargs or None))

    def _instantiate(self, klass, args):
        self.append(self.call(klass, tuple(args), "reduce" if args else "newobj"))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, Node):
            inst.ops.append(("build", state))
        elif type(inst) in (dict, OrderedDict):
            # e.g. a module state_dict's `_metadata` attribute: ckptfmt keeps the items only.
            self.notes.add("attributes set on dicts (such as state_dict()._metadata) were not imported")
        else:
            raise PickleError(f"pickle sets the state of a {type(inst).__name__}, which is not allowed")

    def load_append(self):
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def load_appends(self):
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target, items):
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, Node):
            target.ops.append(("extend", list(items)))
        else:
            raise PickleError(f"pickle appends to a {type(target).__name__}, which is not allowed")

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._setitems(self.stack[-1], [(key, value)])

    def load_setitems(self):
        items = self.pop_mark()
        self._setitems(self.stack[-1], list(zip(items[::2], items[1::2])))

    def _setitems(self, target, pairs):
        if type(target) in (dict, OrderedDict):
            try:
                for key, value in pairs:
                    target[key] = value
            except TypeError as exc:
                raise PickleError(f"unhashable dict key ({exc})") from None
        elif isinstance(target, Node):
            target.ops.append(("setitems", pairs))
        else:
            raise PickleError(f"pickle sets items of a {type(target).__name__}, which is not allowed")

    def load_additems(self):
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            raise PickleError(f"pickle adds items to a {type(target).__name__}, which is not allowed")
        try:
            target.update(items)
        except TypeError as exc:
            raise PickleError(f"unhashable set item ({exc})") from None

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems

    # --- nested data

    def nested(self, data: bytes) -> Any:
        if self.depth >= MAX_NESTED_PICKLES:
            raise PickleError("pickles nested too deep")
        return RestrictedUnpickler(BudgetReader(data), depth=self.depth + 1, notes=self.notes,
                                   torch_files=self.torch_files).load_checked()

    def nested_torch_file(self, data: bytes) -> Any:
        if self.depth >= MAX_NESTED_PICKLES:
            raise PickleError("pickles nested too deep")
        if self.torch_files is None:
            raise PickleError("the pickle embeds a torch file (torch.storage._load_from_bytes), "
                              "which this reader does not read")
        return self.torch_files(data, "<embedded storage>", depth=self.depth + 1, notes=self.notes)

    def load_checked(self) -> Any:
        """load(), with every failure as a PickleError (a CheckpointError)."""
        try:
            return self.load()
        except CheckpointError:
            raise
        except RecursionError:
            raise PickleError("pickle nested too deep") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                AttributeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise PickleError(f"malformed pickle ({type(exc).__name__}: {exc})") from None


def restricted_loads(data: bytes, *, persistent_load: Callable[[Any], Any] | None = None,
                     torch_files: TorchFileReader | None = None) -> Any:
    """Unpickle ``data`` under the restrictions above (the raw result: may hold nodes)."""
    return RestrictedUnpickler(BudgetReader(data), persistent_load=persistent_load,
                               torch_files=torch_files).load_checked()


# --------------------------------------------------------------------------- opaque pickles


class _OpaquePickler(pickle._Pickler):
    """Writes nodes and placeholders back as the globals, calls and states they came from."""

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, (Global, Builder)):
            self._save_global(obj.module, obj.qualname, obj)
        elif isinstance(obj, Node):
            self._save_node(obj)
        elif isinstance(obj, PendingTensor):
            super().save(obj.materialize(), save_persistent_id)
        elif isinstance(obj, Storage):
            super().save(obj.torch_storage(), save_persistent_id)
        elif isinstance(obj, StorageType):
            self._save_global("torch", obj.name, obj)
        elif obj is RestrictedUnpickler.TENSOR_TYPE:
            self._save_global("torch", "Tensor", obj)
        elif obj is RestrictedUnpickler.PARAMETER_TYPE:
            self._save_global("torch.nn.parameter", "Parameter", obj)
        else:
            super().save(obj, save_persistent_id)

    def _save_global(self, module: str, qualname: str, obj: Any) -> None:
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_node(self, node: Node) -> None:
        memo = self.memo.get(id(node))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.save(node.func)
        self.save(tuple(node.args))
        if node.kind == "newobj" and node.kwargs:
            self.save(dict(node.kwargs))
            self.write(pickle.NEWOBJ_EX)
        else:
            self.write(pickle.NEWOBJ if node.kind == "newobj" else pickle.REDUCE)
        if id(node) in self.memo:  # it referenced itself through its arguments
            raise PickleError(f"{node!r} contains itself in its own arguments")
        self.memoize(node)
        for op in node.ops:
            if op[0] == "build":
                self.save(op[1])
                self.write(pickle.BUILD)
            elif op[0] == "extend":
                self.write(pickle.MARK)
                for item in op[1]:
                    self.save(item)
                self.write(pickle.APPENDS)
            else:
                self.write(pickle.MARK)
                for key, value in op[1]:
                    self.save(key)
                    self.save(value)
                self.write(pickle.SETITEMS)


def opaque_pickle(obj: Node | Global) -> bytes:
    """A self-contained pickle that rebuilds ``obj`` where its classes are importable."""
    buffer = io.BytesIO()
    try:
        _OpaquePickler(buffer, protocol=4).dump(obj)
    except CheckpointError:
        raise
    except RecursionError:
        raise PickleError(f"{obj!r} is nested too deep to keep") from None
    except (pickle.PicklingError, TypeError, ValueError, AttributeError) as exc:
        raise PickleError(f"cannot keep {obj!r} as an opaque object ({type(exc).__name__}: {exc})") from None
    return buffer.getvalue()


# --------------------------------------------------------------------------- numpy


def _numpy_name(value: Any, *names: str) -> bool:
    return isinstance(value, Global) and value.module in (*_NUMPY_MODULES, "numpy") and value.qualname in names


_SIMPLE_DTYPE = re.compile(r"[biufc]\d{1,2}")


def _lift_dtype(value: Any) -> np.dtype | None:
    """np.dtype(...) + BUILD state, for plain numeric dtypes only."""
    if not (isinstance(value, Node) and isinstance(value.func, Global)
            and (value.func.module, value.func.qualname) == ("numpy", "dtype") and not value.kwargs):
        return None
    if not value.args or type(value.args[0]) is not str or not _SIMPLE_DTYPE.fullmatch(value.args[0]):
        return None
    try:
        dtype = np.dtype(value.args[0])
    except TypeError:
        return None
    if dtype.kind not in "biufc":
        return None
    for op in value.ops:
        state = op[1]
        if (
            op[0] != "build"
            or type(state) is not tuple
            or len(state) < 5
            or state[3] is not None
            or state[4] is not None
        ):
            return None
        order = state[1]
        if order == b">" or order == ">":
            return None  # big-endian: ckptfmt stores little-endian numeric data only
        if order not in ("<", "|", "=", b"<", b"|", b"="):
            return None
    return dtype


def _lift_numpy(node: Node) -> Any:
    """A real numpy array or scalar for recognised numpy reconstruction nodes; None otherwise."""
    func = node.func
    try:
        if _numpy_name(func, "scalar") and len(node.args) == 2 and not node.ops:
            dtype, raw = _lift_dtype(node.args[0]), node.args[1]
            if dtype is not None and type(raw) is bytes and len(raw) == dtype.itemsize:
                return np.frombuffer(raw, dtype=dtype)[0].copy()
            return None
        if _numpy_name(func, "_reconstruct") and len(node.ops) == 1 and node.ops[0][0] == "build" \
                and node.args and isinstance(node.args[0], Global) \
                and (node.args[0].module, node.args[0].qualname) == ("numpy", "ndarray"):  # not a subclass
            state = node.ops[0][1]
            if type(state) is not tuple or len(state) != 5:
                return None
            _, shape, dtype_node, fortran, raw = state
            dtype = _lift_dtype(dtype_node)
            if dtype is None or type(raw) is not bytes or type(fortran) is not bool:
                return None
            shape = _int_tuple(shape, "numpy shape")
            if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
                return None
            return np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C").copy()
        if _numpy_name(func, "_frombuffer") and len(node.args) == 4 and not node.ops:
            raw, dtype_node, shape, order = node.args
            dtype = _lift_dtype(dtype_node)
            if dtype is None or type(raw) not in (bytes, bytearray) or order not in ("C", "F"):
                return None
            shape = _int_tuple(shape, "numpy shape")
            if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
                return None
            return np.frombuffer(bytes(raw), dtype=dtype).reshape(shape, order=order).copy()
    except PickleError:
        return None
    return None


# --------------------------------------------------------------------------- value tree


class Converted:
    """The value tree of an unpickled object, and what was kept opaque."""

    def __init__(self, value: Any, opaque: list[str], notes: list[str]):
        self.value = value
        self.opaque = opaque
        self.notes = notes


def to_value_tree(obj: Any, where: str = "pickle", notes: set | None = None, *,
                  drop_tensor_attributes: bool = False) -> Converted:
    """Turn an unpickled result into ckptfmt values: tensors built, unknown objects opaque.

    ``drop_tensor_attributes``: a tensor pickled with Python attributes becomes the plain
    tensor (a note names the attributes dropped) instead of an opaque object.
    """
    notes = notes if notes is not None else set()
    opaque: list[str] = []
    active: set[int] = set()
    tensors: dict[int, torch.Tensor] = {}
    plain: dict[int, tuple] = {}  # id(node) -> (node, attributed_tensor(node))

    def convert(value: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH:
            raise PickleError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if value is None or kind in (bool, int, float, str, bytes, complex, torch.Size, torch.dtype, torch.device):
            return value
        if kind is PendingTensor:
            if id(value) not in tensors:
                tensors[id(value)] = value.materialize()
            return tensors[id(value)]
        if kind is np.ndarray or isinstance(value, np.generic):
            return value
        if kind in (Node, Global, Builder, StorageType) or value is RestrictedUnpickler.TENSOR_TYPE \
                or value is RestrictedUnpickler.PARAMETER_TYPE:
            if kind is Node and drop_tensor_attributes:
                if id(value) not in plain:
                    plain[id(value)] = (value, attributed_tensor(value))  # the node kept alive: ids stay unique
                found = plain[id(value)][1]
                if found is not None:
                    notes.add(f"tensor attributes dropped ({', '.join(found[1]) or 'none'})")
                    return convert(found[0], path)
            if kind is Node:
                lifted = _lift_numpy(value)
                if lifted is not None:
                    return lifted
                module, qualname = value.name
            elif kind is StorageType:
                module, qualname = "torch", value.name
            elif kind in (Global, Builder):
                module, qualname = value.module, value.qualname
            else:
                module, qualname = ("torch", "Tensor") if value is RestrictedUnpickler.TENSOR_TYPE \
                    else ("torch.nn.parameter", "Parameter")
            opaque.append(format_key(path) if path else "<root>")
            return OpaqueObject(module, qualname, opaque_pickle(value))
        if kind is Storage:
            raise PickleError(f"{where}: a bare storage at {format_key(path) or '<root>'} (not a tensor) "
                              "cannot be imported")
        if kind in (list, tuple, dict, OrderedDict, set, frozenset):
            if id(value) in active:
                raise PickleError(f"{where}: {format_key(path) or '<root>'} contains itself")
            active.add(id(value))
            try:
                if kind in (dict, OrderedDict):
                    items = [(convert(k, (*path, "<key>")), convert(v, (*path, k))) for k, v in value.items()]
                    return kind(items)
                items = [convert(item, (*path, i)) for i, item in enumerate(value)]
                return kind(items)
            finally:
                active.discard(id(value))
        raise PickleError(f"{where}: unexpected {kind.__name__} at {format_key(path) or '<root>'}")

    try:
        value = convert(obj, ())
    except RecursionError:
        raise PickleError(f"{where}: nested too deep") from None
    except TypeError as exc:  # unhashable key after conversion
        raise PickleError(f"{where}: {exc}") from None
    return Converted(value, opaque, sorted(notes))


__all__ = [
    "Global",
    "MAX_PICKLE_BYTES",
    "Node",
    "PendingTensor",
    "PickleError",
    "RestrictedUnpickler",
    "BudgetReader",
    "Storage",
    "StorageType",
    "TorchFileReader",
    "attributed_tensor",
    "opaque_pickle",
    "restricted_loads",
    "to_value_tree",
]
