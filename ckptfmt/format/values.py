"""The value tree: a training state's structure and plain values, type-exact, in msgpack.

msgpack's own types carry None, bool, int (64-bit), float (always float64, so
nan and inf survive), str, bytes, list and dict (with keys of any type below).
Extension types carry the rest, each payload itself a msgpack document:

    1 tensor reference   int: index into the manifest's tensor table
    2 tuple              array
    3 big integer        ASCII decimal, for ints outside [-2**63, 2**64)
    4 OrderedDict        map
    5 set / 6 frozenset  array
    7 complex            [real, imag]
    8 torch.dtype        str: the format's dtype name
    9 torch.Size         array of ints
   10 torch.device       str
   11 numpy scalar       [numpy dtype string such as '<f4', raw bytes]; only the
                         portable dtype strings of NUMPY_SCALAR_TYPESTRS
   12 opaque object      map {"module", "qualname", "pickle": bytes}: an object a
                         converter could not rebuild safely; its pickle is kept
                         verbatim and never unpickled by ckptfmt
   13 per-rank value     map {rank (int): value}: a ``PerRank`` value, one per
                         saving rank (format 1.1)

Anything else is refused at save time with the path of the offending value.

This module knows no torch: a torch tensor, dtype, Size or device is recognised by its type only
when torch is loaded (a value cannot be one otherwise), and extensions 8-10 decode to
``TorchValue`` placeholders unless the caller passes ``torch_value`` (the torch side's
``tensors/values.py``), so that inspecting a checkpoint never loads torch.
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ckptfmt.errors import ManifestError, UnsupportedValueError, quoted
from ckptfmt.format.dtypes import ITEMSIZES, itemsize
from ckptfmt.format.limits import MAX_NESTING
from ckptfmt.format.maps import first_repeat, unique_map
from ckptfmt.format.per_rank import PerRank, PerRankValues

EXT_TENSOR, EXT_TUPLE, EXT_BIGINT, EXT_ODICT, EXT_SET, EXT_FROZENSET = 1, 2, 3, 4, 5, 6
EXT_COMPLEX, EXT_DTYPE, EXT_SIZE, EXT_DEVICE, EXT_NUMPY_SCALAR, EXT_OPAQUE = 7, 8, 9, 10, 11, 12
EXT_PER_RANK = 13

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_BIGINT_DIGITS = 4300  # the most digits a writer may store (spec 7.2)


def _scalar_typestrs() -> frozenset[str]:
    """The numpy scalar dtype strings extension 11 may hold (spec 7.2): fixed-size types only.

    numpy's long double (``<f16``, ``<c32``) means x87 80-bit extended precision, padded to 16
    bytes, on x86-64, but IEEE binary128 under the same string on 64-bit ARM Linux: it is storable
    and readable only where it means the former, so that no two readers decode one scalar differently.
    """
    import numpy as np

    sizes = {"i": (2, 4, 8), "u": (2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
    typestrs = {"|b1", "|i1", "|u1"} | {f"{order}{kind}{n}" for order in "<>" for kind in sizes for n in sizes[kind]}
    long_double = np.finfo(np.longdouble)
    if long_double.dtype.itemsize == 16 and long_double.nmant == 63 and long_double.dtype.str == "<f16":
        typestrs |= {"<f16", "<c32"}
    return frozenset(typestrs)


def _typestrs() -> frozenset[str]:
    """``NUMPY_SCALAR_TYPESTRS``, computed on first use (it asks numpy, which is imported then)."""
    if "NUMPY_SCALAR_TYPESTRS" not in globals():
        globals()["NUMPY_SCALAR_TYPESTRS"] = _scalar_typestrs()
    return globals()["NUMPY_SCALAR_TYPESTRS"]


def __getattr__(name: str) -> Any:
    if name == "NUMPY_SCALAR_TYPESTRS":  # the portable numpy scalar dtype strings, computed on first use
        return _typestrs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _numpy() -> Any:
    """numpy where it is loaded, else None: a value cannot be a numpy array or scalar unless it is."""
    return sys.modules.get("numpy")

#: Called for each tensor leaf with its key path and the leaf (a TensorLike, a DTensor's LocalShard, or a
#: TensorRef in trees rebuilt from encoded ones); returns its tensor-table index.
OnTensor = Callable[[tuple, Any], int]


@dataclass(frozen=True)
class TensorRef:
    """A tensor known by its key only: what a collective save's coordinator encodes in place of
    tensors that live on other ranks (``on_tensor`` maps it to its tensor-table index)."""

    key: str


@dataclass(frozen=True)
class TorchValue:
    """A torch.dtype, torch.Size or torch.device of a value tree (extensions 8-10), read without torch:
    equal to another of the same kind and value, printed as torch prints it, and written back as it came."""

    kind: str  # "dtype", "size" or "device"
    value: str | tuple[int, ...]

    def __repr__(self) -> str:
        if self.kind == "dtype":
            return f"torch.{self.value}"
        if self.kind == "size":
            return f"torch.Size({list(self.value)})"
        return f"device(type={self.value!r})" if ":" not in str(self.value) else \
            "device(type={!r}, index={})".format(*str(self.value).split(":"))


#: Builds the value of extension 8, 9 or 10 from its kind and payload (``TorchValue`` by default).
MakeTorchValue = Callable[[str, Any], Any]


def is_tensor_leaf(value: Any) -> bool:
    """Whether ``value`` goes to the tensor table: a torch tensor (when torch is loaded: a value cannot be
    one otherwise), a numpy array, a TensorRef, or a leaf type of the torch side marked ``TENSOR_LEAF``
    (``Sharded``, a DTensor's ``LocalShard``)."""
    kind = type(value)
    np = _numpy()
    if (np is not None and kind is np.ndarray) or kind is TensorRef or getattr(kind, "TENSOR_LEAF", False):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_kind(value: Any) -> str | None:
    """'dtype', 'size' or 'device' for a torch.dtype, torch.Size or torch.device (torch loaded), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    kind = type(value)
    return {torch.dtype: "dtype", torch.Size: "size", torch.device: "device"}.get(kind)


@dataclass(frozen=True)
class OpaqueObject:
    """An object kept as its verbatim pickle because rebuilding it could run code.

    ckptfmt never unpickles it; export to torch format can write it back as it came.
    """

    module: str
    qualname: str
    pickle: bytes

    def __repr__(self) -> str:
        return f"<opaque {self.module}.{self.qualname}, {len(self.pickle)} pickle bytes>"


def format_key(path: tuple) -> str:
    """A tensor's key: its path segments joined by '/' ('%' and '/' in strings escaped)."""
    parts = []
    for segment in path:
        text = segment if type(segment) is str else (str(segment) if type(segment) is int else repr(segment))
        parts.append(text.replace("%", "%25").replace("/", "%2F"))
    return "/".join(parts)


def state_path(path: tuple) -> str:
    """Where a value is in the state, as errors name it: ``state['model'][0]``."""
    return "state" + "".join(f"[{segment!r}]" for segment in path)


class _Encoder:
    def __init__(self, on_tensor: OnTensor | None, rank: int):
        self.on_tensor = on_tensor
        self.rank = rank  # whose value a PerRank leaf is
        self.in_key = 0  # > 0 while packing a dict key or set item
        self.in_per_rank = 0  # per-rank maps around the value being packed: each is a level (spec 7.4)
        self.packer = msgpack.Packer(use_bin_type=True, strict_types=True)  # one for every extension's body
        #: The usual tensor leaves' types, found by one set lookup (``is_tensor_leaf`` does the rest).
        self.tensor_types = _tensor_types()

    def pack(self, value: Any, path: tuple) -> Any:
        """Turn ``value`` into msgpack-native data plus ExtTypes."""
        if len(path) + self.in_per_rank > MAX_NESTING:
            raise UnsupportedValueError(f"{state_path(path[:8])}...: nested deeper than {MAX_NESTING} levels")
        kind = type(value)
        if value is None or kind in (bool, float, str, bytes):
            return value
        if kind is int:
            if _INT_MIN <= value <= _INT_MAX:
                return value
            try:
                text = str(value)
            except ValueError:  # over sys.get_int_max_str_digits()
                text = None
            if text is None or len(text.lstrip("-")) > _BIGINT_DIGITS:
                raise UnsupportedValueError(f"{state_path(path)}: integer of more than {_BIGINT_DIGITS} digits")
            return msgpack.ExtType(EXT_BIGINT, text.encode("ascii"))
        if kind is list:
            return [self.pack(item, (*path, i)) for i, item in enumerate(value)]
        if kind is dict:
            return {self.key(k, path): self.pack(v, (*path, k)) for k, v in value.items()}
        if kind is OrderedDict:
            body = {self.key(k, path): self.pack(v, (*path, k)) for k, v in value.items()}
            return self.ext(EXT_ODICT, body)
        if kind is tuple:
            return self.ext(EXT_TUPLE, [self.pack(item, (*path, i)) for i, item in enumerate(value)])
        if kind in self.tensor_types or is_tensor_leaf(value):
            if self.in_key:
                raise UnsupportedValueError(
                    f"{state_path(path)}: tensors cannot be dict keys or set items (nor part of one)"
                )
            if self.in_per_rank:
                raise UnsupportedValueError(f"{state_path(path)}: tensors inside ckptfmt.PerRank are not supported; "
                                            "save a per-rank tensor as a DTensor or under a key naming its rank")
            if self.on_tensor is None:
                raise UnsupportedValueError(f"{state_path(path)}: tensors are not allowed here")
            return self.ext(EXT_TENSOR, self.on_tensor(path, value))
        if kind is PerRank:
            return self.per_rank(PerRankValues({self.rank: value.value}), path)
        if kind is PerRankValues:
            return self.per_rank(value, path)
        if kind is TorchValue or _torch_kind(value) is not None:
            return self.torch_value(value, path)
        if kind in (set, frozenset):
            items = [self.key(item, path) for item in value]
            return self.ext(EXT_SET if kind is set else EXT_FROZENSET, items)
        if kind is complex:
            return self.ext(EXT_COMPLEX, [value.real, value.imag])
        np = _numpy()
        if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biufc":
            if value.dtype.str not in _typestrs():
                raise UnsupportedValueError(f"{state_path(path)}: a numpy {value.dtype} scalar means different "
                                            "things on different platforms; convert it to float64 or complex128")
            return self.ext(EXT_NUMPY_SCALAR, [value.dtype.str, value.tobytes()])
        if kind is OpaqueObject:
            return self.ext(EXT_OPAQUE, {"module": value.module, "qualname": value.qualname, "pickle": value.pickle})
        raise UnsupportedValueError(
            f"{state_path(path)}: cannot store a {kind.__module__}.{kind.__qualname__} exactly; "
            "convert it to plain values (dict, list, tuple, int, float, str, bytes, tensors)"
        )

    def key(self, key: Any, path: tuple) -> Any:
        """Pack a dict key or set item: any plain hashable value, never a tensor."""
        self.in_key += 1
        try:
            return self.pack(key, (*path, "<key>"))
        finally:
            self.in_key -= 1

    def per_rank(self, values: PerRankValues, path: tuple) -> msgpack.ExtType:
        if self.in_key:
            raise UnsupportedValueError(f"{state_path(path)}: a PerRank value cannot be a dict key or set item")
        self.in_per_rank += 1
        try:
            body = {int(rank): self.pack(value, path) for rank, value in sorted(values.items())}
        finally:
            self.in_per_rank -= 1
        return self.ext(EXT_PER_RANK, body)

    def torch_value(self, value: Any, path: tuple) -> msgpack.ExtType:
        """Extension 8, 9 or 10 of a torch.dtype, torch.Size or torch.device, or of its ``TorchValue``."""
        kind, payload = (value.kind, value.value) if type(value) is TorchValue else (_torch_kind(value), value)
        if kind == "size":
            return self.ext(EXT_SIZE, [int(d) for d in payload])
        if kind == "device":
            return self.ext(EXT_DEVICE, str(payload))
        name = str(payload).rpartition(".")[2]
        if name not in ITEMSIZES:
            raise UnsupportedValueError(f"{state_path(path)}: dtype {payload} cannot be stored (quantized and sub-byte "
                                        "integer dtypes are not in format 1.0)")
        return self.ext(EXT_DTYPE, name)

    def ext(self, code: int, body: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, _packb(body, self.packer))


def _packb(obj: Any, packer: msgpack.Packer | None = None) -> bytes:
    try:
        return (packer or msgpack.Packer(use_bin_type=True, strict_types=True)).pack(obj)
    except UnicodeEncodeError as exc:  # lone surrogates in a str
        raise UnsupportedValueError(f"state holds a string that is not valid Unicode text: {exc}") from None


def _tensor_types() -> frozenset[type]:
    """torch.Tensor, torch.nn.Parameter and numpy.ndarray, those of them whose module is loaded."""
    torch, np = sys.modules.get("torch"), _numpy()
    return frozenset(([torch.Tensor, torch.nn.Parameter] if torch is not None else [])
                     + ([np.ndarray] if np is not None else []))


#: Where extension 13 may start in msgpack bytes: a fixext or an ext8/16/32 header, then the type code.
_EXT13 = re.compile(rb"[\xd4-\xd8]\x0d|\xc7.\x0d|\xc8..\x0d|\xc9....\x0d", re.S)


def uses_per_rank(data: bytes) -> bool:
    """Whether an encoded value tree holds a per-rank value (extension 13: required feature
    ``per-rank-values``, spec 13.2). A scan of the bytes rules most trees out; a tree where the header
    might appear (inside a string, say) is decoded to be sure."""
    if _EXT13.search(data) is None:
        return False
    return _holds_per_rank(decode_tree(data, lambda index: None))


def _holds_per_rank(value: Any) -> bool:
    if isinstance(value, PerRankValues):
        return True
    if isinstance(value, dict):
        return any(_holds_per_rank(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_per_rank(v) for v in value)
    return False


def encode_tree(value: Any, on_tensor: OnTensor | None = None, rank: int = 0) -> bytes:
    """The msgpack document of ``value``; tensors go to ``on_tensor`` (None forbids them).

    ``PerRank`` leaves are stored as ``rank``'s value.
    """
    return _packb(_Encoder(on_tensor, rank).pack(value, ()))


#: What a decoded map key or set item may be (spec 7.1), besides numpy scalars and the sequences below.
_KEY_TYPES = frozenset({type(None), bool, int, float, str, bytes, complex, OpaqueObject, TorchValue})
#: Keys that hold items, each of which must be a key in turn.
_KEY_SEQUENCES = frozenset({tuple, frozenset})


def _is_key(value: Any) -> bool:
    """Whether a decoded value may be a map key or set item: a plain value, never a tensor nor one holding one."""
    kind = type(value)
    np = _numpy()
    if kind in _KEY_TYPES or (np is not None and isinstance(value, np.generic)) or \
            _torch_kind(value) in ("dtype", "device"):
        return True
    return (kind in _KEY_SEQUENCES or _torch_kind(value) == "size") and all(map(_is_key, value))


def _tree_map(pairs: list[tuple]) -> dict:
    """A value tree's map: unique keys (``unique_map``), each a valid key."""
    value = unique_map(pairs)
    if not _KEY_TYPES.issuperset(map(type, value)):
        _check_keys(value, "map key")
    return value


def _check_keys(items, what: str) -> None:
    for item in items:
        if not _is_key(item):
            raise ManifestError(f"value tree: invalid {what} (a {type(item).__name__}): keys and set items hold "
                                "plain values only, never a tensor, list or map")


def _set_items(body: Any) -> list:
    """The items of a set or frozenset payload: valid keys, none twice (the same sameness as map keys)."""
    items = _expect(body, list)
    _check_keys(items, "set item")
    if len(set(items)) != len(items):
        raise ManifestError(f"value tree: a set holds the item {quoted(first_repeat(items))} twice")
    return items


class _Decoder:
    def __init__(self, resolve_tensor: Callable[[int], Any] | None, torch_value: MakeTorchValue):
        self.resolve_tensor = resolve_tensor
        self.torch_value = torch_value
        self.depth = 0

    def unpack(self, data: bytes) -> Any:
        self.depth += 1
        try:
            # The top document, then at most MAX_NESTING containers (the writer's path limit),
            # then a leaf's own payload (e.g. a tensor reference) may each be one parse deeper.
            if self.depth > MAX_NESTING + 2:
                raise ManifestError(f"value tree nested deeper than {MAX_NESTING} extension levels")
            # Not msgpack.unpackb: it keeps ~45 KB of parser state on the C stack, and extension
            # payloads nest one parse inside another, so ~170 levels overflowed an 8 MiB stack
            # (a segfault). An Unpacker keeps that state on the heap. Its length limits default
            # to the buffer size, as unpackb's do to the input's length.
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=self.ext_hook, use_list=True,
                                        object_pairs_hook=_tree_map, max_buffer_size=max(len(data), 1))
            unpacker.feed(data)
            value = unpacker.unpack()
            if unpacker.tell() != len(data):
                raise ManifestError("value tree: extra bytes after the document")
            return value
        except ManifestError:
            raise
        except TypeError as exc:  # unhashable map key
            raise ManifestError(f"value tree: invalid map key ({exc})") from None
        except Exception as exc:
            raise ManifestError(f"value tree: malformed msgpack ({exc})") from None
        finally:
            self.depth -= 1

    def ext_hook(self, code: int, data: bytes) -> Any:
        index = _plain_uint(data) if code == EXT_TENSOR else None  # a tensor reference's int: no Unpacker
        body = index if index is not None else self.unpack(data) if code != EXT_BIGINT else data
        try:
            return self._build(code, body)
        except ManifestError:
            raise
        except Exception as exc:
            raise ManifestError(f"value tree: bad extension {code} payload ({exc})") from None

    def _build(self, code: int, body: Any) -> Any:
        if code == EXT_TENSOR:
            if type(body) is not int:
                raise ManifestError("value tree: tensor reference is not an integer")
            if self.resolve_tensor is None:
                raise ManifestError("value tree: tensor reference where none is allowed")
            return self.resolve_tensor(body)
        if code == EXT_TUPLE:
            return tuple(_expect(body, list))
        if code == EXT_BIGINT:
            if len(body) > 10_000 or not body.lstrip(b"-").isdigit():
                raise ManifestError("value tree: malformed big integer")
            return int(body.decode("ascii"))
        if code == EXT_ODICT:
            return OrderedDict(_expect(body, dict))
        if code == EXT_SET:
            return set(_set_items(body))
        if code == EXT_FROZENSET:
            return frozenset(_set_items(body))
        if code == EXT_COMPLEX:
            real, imag = _expect(body, list)
            return complex(_expect(real, float), _expect(imag, float))
        if code == EXT_DTYPE:
            itemsize(body)  # a dtype name of the table
            return self.torch_value("dtype", body)
        if code == EXT_SIZE:
            return self.torch_value("size", tuple(int(_expect(d, int)) for d in _expect(body, list)))
        if code == EXT_DEVICE:
            return self.torch_value("device", _device(_expect(body, str)))
        if code == EXT_NUMPY_SCALAR:
            typestr, raw = _expect(body, list)
            if _expect(typestr, str) not in _typestrs():
                raise ManifestError(f"value tree: numpy scalar of unsupported dtype {quoted(typestr)}")
            import numpy as np

            dtype = np.dtype(typestr)
            if len(_expect(raw, bytes)) != dtype.itemsize or (dtype.kind == "b" and raw not in (b"\0", b"\1")):
                raise ManifestError("value tree: malformed numpy scalar")
            return np.frombuffer(raw, dtype=dtype)[0]
        if code == EXT_PER_RANK:
            body = _expect(body, dict)
            if not all(type(rank) is int and rank >= 0 for rank in body):
                raise ManifestError("value tree: per-rank value keyed by something other than a rank")
            return PerRankValues(body)
        if code == EXT_OPAQUE:
            body = _expect(body, dict)
            return OpaqueObject(
                _expect(body["module"], str), _expect(body["qualname"], str), _expect(body["pickle"], bytes)
            )
        raise ManifestError(f"value tree: unknown extension type {code}")


#: torch's device types (c10's DeviceType), the first part of an extension 10 string: ``"cuda:0"``.
DEVICE_TYPES = frozenset({"cpu", "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip", "fpga", "maia", "xla", "vulkan",
                          "metal", "xpu", "mps", "meta", "hpu", "ve", "lazy", "ipu", "mtia", "privateuseone"})


def _device(text: str) -> str:
    """A device string as torch writes it (``str(device)``: a type, and ``:index``), checked without torch."""
    kind, colon, index = text.partition(":")
    if kind not in DEVICE_TYPES or (colon and not (index.isdigit() and index.isascii())):
        raise ManifestError(f"value tree: {quoted(text)} is not a torch device")
    return text


#: msgpack's unsigned int forms (uint 8 to uint 64) by their first byte: the bytes that follow it.
_UINT_BYTES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _plain_uint(data: bytes) -> int | None:
    """``data`` as a msgpack document that is one unsigned int (a positive fixint or a uint form), or None
    for any other document (left to the Unpacker, which reads or refuses it)."""
    if len(data) == 1 and data[0] < 0x80:
        return data[0]
    if data and len(data) == 1 + _UINT_BYTES.get(data[0], -1):
        return int.from_bytes(data[1:], "big")
    return None


def _expect(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise ManifestError(f"value tree: expected {kind.__name__}, found {type(value).__name__}")
    return value


def decode_tree(data: bytes, resolve_tensor: Callable[[int], Any] | None = None, *,
                torch_value: MakeTorchValue = TorchValue) -> Any:
    """Rebuild a value tree; tensor references are passed to ``resolve_tensor``, torch dtypes, Sizes and
    devices to ``torch_value`` (the torch side's gives torch objects; the default, ``TorchValue``s)."""
    if type(data) is not bytes:
        raise ManifestError("value tree: expected an embedded msgpack document (bin)")
    return _Decoder(resolve_tensor, torch_value).unpack(data)
