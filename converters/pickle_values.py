"""An unpickled result as a ckptfmt value tree (``to_value_tree``): tensors built over their
storages, numpy arrays and scalars lifted when they are plain numeric data, unknown objects
kept as ``ckptfmt.OpaqueObject`` (see converters/pickles.py's docstring).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ckptfmt import OpaqueObject
from ckptfmt.converters.opaque_pickles import opaque_pickle
from ckptfmt.converters.pickle_builders import Builder, attributed_tensor
from ckptfmt.converters.pickle_records import (
    MAX_DEPTH,
    PARAMETER_TYPE,
    TENSOR_TYPE,
    Global,
    Node,
    PendingTensor,
    PickleError,
    Storage,
    StorageType,
    int_tuple,
)
from ckptfmt.format.values import format_key

_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")

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
            shape = int_tuple(shape, "numpy shape")
            if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
                return None
            return np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C").copy()
        if _numpy_name(func, "_frombuffer") and len(node.args) == 4 and not node.ops:
            raw, dtype_node, shape, order = node.args
            dtype = _lift_dtype(dtype_node)
            if dtype is None or type(raw) not in (bytes, bytearray) or order not in ("C", "F"):
                return None
            shape = int_tuple(shape, "numpy shape")
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
        if kind in (Node, Global, Builder, StorageType) or value is TENSOR_TYPE \
                or value is PARAMETER_TYPE:
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
                module, qualname = ("torch", "Tensor") if value is TENSOR_TYPE \
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

