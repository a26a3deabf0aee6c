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

The code is in five modules: this one (the unpickler), ``pickle_records`` (its limits, error,
placeholders and storage records), ``pickle_builders`` (the allowed callables),
``opaque_pickles`` (nodes written back as pickles) and ``pickle_values`` (``to_value_tree``);
their public names are importable from here.
"""

from __future__ import annotations

import _compat_pickle
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ckptfmt.converters.opaque_pickles import opaque_pickle
from ckptfmt.converters.pickle_builders import BUILDERS, Builder, attributed_tensor
from ckptfmt.converters.pickle_records import (
    MAX_NESTED_PICKLES,
    MAX_PICKLE_BYTES,
    PARAMETER_TYPE,
    STORAGE_DTYPES,
    TENSOR_TYPE,
    Global,
    Node,
    PendingTensor,
    PickleError,
    Storage,
    StorageType,
)
from ckptfmt.converters.pickle_values import to_value_tree
from ckptfmt.errors import CheckpointError

#: torch.float32 and friends, by name (vars(), not getattr: torch imports submodules lazily on getattr).
_TORCH_DTYPES = {name: value for name, value in vars(torch).items()
                 if isinstance(value, torch.dtype) and not name.startswith("_")}


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

    TENSOR_TYPE = TENSOR_TYPE  # markers find_class returns for torch.Tensor / nn.Parameter
    PARAMETER_TYPE = PARAMETER_TYPE

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
        if key in BUILDERS:
            fn, newobj = BUILDERS[key]
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
