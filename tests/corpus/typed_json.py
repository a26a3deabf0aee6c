"""The corpus's typed JSON: a value tree as JSON that keeps every type and bit, so that a writer of the past
and today's reader can be compared, and a reader in another language can check itself against the corpus.

Every value is an object with a ``type`` (tests/corpus/README.md lists them). Ints are decimal strings
(JSON numbers lose bits past 2**53), floats their ``float.hex()`` (so nan, inf and -0.0 survive), bytes
hex. A tensor or numpy array is a reference to its key (spec 7.3), described apart: kind, dtype, shape,
and the sha256 of its bytes (C order, little-endian). Set items are sorted by their JSON text: a set's
order is not stored. The corpus writer runs this under old trees, so it imports no ckptfmt: per-rank
values and opaque objects are known by their class's name.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import numpy as np
import torch


def key_of(path: tuple) -> str:
    """A tensor's key (spec 7.3): path segments joined by '/', '%' and '/' escaped, non-strings printed."""
    parts = [s if type(s) is str else str(s) if type(s) is int else repr(s) for s in path]
    return "/".join(p.replace("%", "%25").replace("/", "%2F") for p in parts)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's elements as bytes, C order (every dtype: bf16, float8 and bits dtypes too)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def describe_tensor(tensor: torch.Tensor | np.ndarray) -> dict:
    """A tensor's kind (tensor, parameter or numpy array), dtype (the format's name), shape and sha256."""
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        return {"kind": "ndarray", "dtype": array.dtype.name, "shape": list(array.shape),
                "sha256": hashlib.sha256(array.tobytes()).hexdigest()}
    return {"kind": "parameter" if isinstance(tensor, torch.nn.Parameter) else "tensor",
            "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "requires_grad": tensor.requires_grad, "sha256": hashlib.sha256(tensor_bytes(tensor)).hexdigest()}


def encode(value: Any, tensors: dict | None = None, path: tuple = ()) -> dict:
    """``value`` (a decoded value tree) as typed JSON; each tensor met is put in ``tensors`` by key."""
    kind = type(value)
    if value is None:
        return {"type": "none"}
    if kind is bool:
        return {"type": "bool", "value": value}
    if kind is int:
        return {"type": "int", "value": str(value)}
    if kind is float:
        return {"type": "float", "value": value.hex()}
    if kind is complex:
        return {"type": "complex", "real": value.real.hex(), "imag": value.imag.hex()}
    if kind is str:
        return {"type": "str", "value": value}
    if kind is bytes:
        return {"type": "bytes", "hex": value.hex()}
    if kind in (list, tuple):
        return {"type": kind.__name__, "items": [encode(item, tensors, (*path, i)) for i, item in enumerate(value)]}
    if kind in (set, frozenset):
        return {"type": kind.__name__, "items": sorted((encode(item) for item in value), key=_text)}
    if kind.__name__ == "PerRankValues":  # ckptfmt's dict of rank -> value (format 1.1)
        return {"type": "per_rank", "items": [[rank, encode(item)] for rank, item in sorted(value.items())]}
    if kind in (dict, OrderedDict):
        return {"type": "ordered_dict" if kind is OrderedDict else "dict",
                "items": [[encode(key), encode(item, tensors, (*path, key))] for key, item in value.items()]}
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if tensors is not None:
            tensors[key_of(path)] = value
        return {"type": "tensor", "key": key_of(path)}
    if kind is torch.Size:
        return {"type": "torch.Size", "dims": list(value)}
    if kind is torch.dtype:
        return {"type": "torch.dtype", "name": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"type": "torch.device", "value": str(value)}
    if isinstance(value, np.generic):
        return {"type": "numpy_scalar", "dtype": value.dtype.str, "hex": value.tobytes().hex()}
    if kind.__name__ == "OpaqueObject":  # a pickle ckptfmt keeps and never runs
        return {"type": "opaque", "module": value.module, "qualname": value.qualname, "pickle": value.pickle.hex()}
    raise TypeError(f"no typed JSON for {kind.__module__}.{kind.__qualname__}")


def _text(item: dict) -> str:
    return json.dumps(item, sort_keys=True)
