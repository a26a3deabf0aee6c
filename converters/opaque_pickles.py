"""Unknown objects written back as pickles: the nodes and placeholders the restricted unpickler
(converters/pickles.py) recorded, as the globals, calls and states they came from.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ckptfmt.converters.pickle_builders import Builder
from ckptfmt.converters.pickle_records import (
    PARAMETER_TYPE,
    TENSOR_TYPE,
    Global,
    Node,
    PendingTensor,
    PickleError,
    Storage,
    StorageType,
)
from ckptfmt.errors import CheckpointError


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
        elif obj is TENSOR_TYPE:
            self._save_global("torch", "Tensor", obj)
        elif obj is PARAMETER_TYPE:
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
