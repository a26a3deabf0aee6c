"""The callables the restricted unpickler (converters/pickles.py) allows: re-implementations that
only make plain values or tensors from storages, each checking its arguments.

``BUILDERS`` maps a pickle's (module, qualname) to one; ``attributed_tensor`` finds the plain
tensor under one pickled with Python attributes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ckptfmt.converters.pickle_records import PARAMETER_TYPE, TENSOR_TYPE, Node, PendingTensor, PickleError, int_tuple


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
    return torch.Size(int_tuple(dims, "torch.Size"))


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
                and new_type in (TENSOR_TYPE, PARAMETER_TYPE)
                and type(args) is tuple and len(args) >= 4):
            return None
        tensor = PendingTensor(*args[:4], False)
        if new_type is PARAMETER_TYPE:
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


BUILDERS = {
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
