"""Fingerprints of what this process has just loaded, for a resume's check (``loading.resume_check``).

A load (``ckptfmt.load``, the integrations') has verified every chunk; right then
each large tensor it gives is fingerprinted (a sample of its bytes; a view of a map
the load did not hash: from its chunk file, when first asked), and the
checkpoint's manifest is kept, for the last few checkpoints loaded. A resume's
check compares the live tensors with these fingerprints instead of hashing
them whole: microseconds per tensor whatever its size.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import blake3
import numpy as np
import torch

from ckptfmt._collector import collector_paused
from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.values import format_key

#: Sampled fingerprints of the tensors of the last checkpoints loaded in this process, by manifest hash:
#: what a resume's live tensors are compared with, at a cost that does not grow with their size.
_LOADED: dict[str, tuple[Manifest, dict[str, Fingerprint]]] = {}
_LOCK = threading.Lock()
#: Checkpoints whose loads are remembered (a resume compares with the one it has just loaded).
LOADS_REMEMBERED = 4
#: A tensor's fingerprint: its bytes whole up to this size, else SAMPLE_WINDOWS windows of SAMPLE_BYTES
#: spread evenly over them, first and last included.
WHOLE_BYTES, SAMPLE_WINDOWS, SAMPLE_BYTES = 4096, 16, 64
#: Tensors up to this size are compared exactly, by hashing (no fingerprint is kept when they load: a
#: load of 100,000 small tensors pays nothing for the check).
EXACT_BYTES = 64 * 2**10


class FileFingerprint:
    """The fingerprint of a view of an unhashed chunk map, read from the chunk's file when a resume's
    check first asks for it: the file is content-addressed and never rewritten with other bytes, so its
    windows then are the ones the view showed when loaded, and a load that no check follows (inference,
    evaluation) reads nothing (38 files' windows were a third of MiniLM's unverified load). A file gone
    by then gives None: the check compares that tensor exactly instead."""

    __slots__ = ("_read", "_offset", "_length", "_dtype", "_shape", "_value")

    def __init__(self, read: Callable[[Sequence[int], int], bytes | memoryview | None], offset: int, length: int,
                 dtype: torch.dtype, shape: Sequence[int]):
        """``read(starts, size)``: the file's ``size`` bytes at each of ``starts``, joined; the tensor's
        bytes are ``length`` at ``offset`` of it."""
        self._read, self._offset, self._length = read, offset, length
        self._dtype, self._shape = dtype, tuple(shape)
        self._value: bytes | None = None

    def value(self) -> bytes | None:
        if self._value is None:
            try:
                windows = self._read([self._offset + at for at in window_starts(self._length)], SAMPLE_BYTES)
            except CheckpointError:
                windows = None
            if windows is None:
                return None
            self._value = sampled_fingerprint(self._dtype, self._shape, windows)
        return self._value


#: A loaded tensor's fingerprint: taken, or to be read from its chunk file.
Fingerprint = bytes | FileFingerprint


def fingerprint_value(kept: Fingerprint | None) -> bytes | None:
    """The bytes of a kept fingerprint (None: none kept, or its file no longer readable)."""
    return kept.value() if isinstance(kept, FileFingerprint) else kept


def remember_load(manifest_hash: str, manifest: Manifest, state: Any) -> None:
    """Fingerprint the large tensors of ``state``, live objects just loaded into from the checkpoint of
    ``manifest``, and keep them with the manifest, for ``record_resume``."""
    with collector_paused():  # a path per leaf: 100,000 small tensors' walk took twice as long with it on
        fingerprints: dict[str, Fingerprint] = {
            format_key(path): fingerprint(leaf) for path, leaf in leaves((), state)
            if isinstance(leaf, torch.Tensor) and leaf.nbytes > EXACT_BYTES}
    remember_fingerprints(manifest_hash, manifest, fingerprints)


def remember_fingerprints(manifest_hash: str, manifest: Manifest, fingerprints: Mapping[str, Fingerprint]) -> None:
    """Keep ``fingerprints`` (by key: of the large tensors a load of the checkpoint of ``manifest`` gave,
    ``CheckpointReader.fingerprints`` for a whole load) and the manifest, for ``record_resume``."""
    fingerprints = dict(fingerprints)
    with _LOCK:  # loads in several threads
        _LOADED.pop(manifest_hash, None)
        _LOADED[manifest_hash] = (manifest, fingerprints)
        while len(_LOADED) > LOADS_REMEMBERED:
            del _LOADED[next(iter(_LOADED))]


def remembered(manifest_hash: str) -> tuple[Manifest, dict[str, Fingerprint]] | None:
    """The manifest and fingerprints of a checkpoint this process has just loaded, if it has."""
    return _LOADED.get(manifest_hash)


def fingerprint(tensor: torch.Tensor) -> bytes:
    """16 bytes of BLAKE3 over a tensor's dtype, shape and bytes (a DTensor: this rank's shard's), whole
    up to 4 KiB, else 16 windows of 64 bytes spread over them: a few microseconds whatever its size."""
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if callable(to_local) else tensor
    if _in_place(local):
        return sampled_fingerprint(tensor.dtype, tensor.shape, _sampled(local))  # its bytes read in place
    hasher = _header(tensor.dtype, tensor.shape)
    flat = local.detach().resolve_conj().resolve_neg().reshape(-1)  # a view's values, not its raw bytes
    if not flat.numel():
        return hasher.digest(16)
    data = (flat if flat.is_contiguous() else flat.contiguous()).view(torch.uint8)
    size = data.numel()
    if size > WHOLE_BYTES:
        offsets = (np.array(window_starts(size))[:, None] + _WINDOW).reshape(-1)
        if data.device.type != "cpu":  # one gather on the device, one small copy
            data = data[torch.from_numpy(offsets).to(data.device)]
        else:
            hasher.update(_buffer(data.numpy()[offsets]))
            return hasher.digest(16)
    hasher.update(_buffer(data.cpu().numpy()))
    return hasher.digest(16)


def sampled_fingerprint(dtype: torch.dtype, shape: Sequence[int], sampled: bytes | memoryview) -> bytes:
    """``fingerprint`` of a tensor of ``dtype`` and ``shape`` whose sampled bytes (whole up to
    ``WHOLE_BYTES``, else its windows at ``window_starts``, joined) are ``sampled``."""
    hasher = _header(dtype, shape)
    hasher.update(sampled)
    return hasher.digest(16)


def window_starts(size: int) -> list[int]:
    """Where ``fingerprint`` samples a tensor of ``size`` bytes (over ``WHOLE_BYTES``): 16 windows of
    ``SAMPLE_BYTES``, evenly spread, the first at its start and the last at its end."""
    step, last = size - SAMPLE_BYTES, SAMPLE_WINDOWS - 1
    return [i * step // last for i in range(SAMPLE_WINDOWS)]


def _in_place(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes can be read at its address: a plain CPU tensor (or Parameter), dense,
    contiguous, no conjugate or negative bit, whose storage holds them. Not a subclass (a wrapper, a
    FakeTensor), a ZeroTensor or a storage freed in place: their address is 0 or not theirs."""
    if type(tensor) not in _PLAIN or not tensor.is_cpu or tensor.layout is not torch.strided \
            or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg() or tensor.is_quantized:
        return False
    if not tensor.nbytes:
        return True
    storage = tensor.untyped_storage()
    return tensor.data_ptr() != 0 and storage.data_ptr() != 0 and \
        storage.nbytes() >= tensor.storage_offset() * tensor.element_size() + tensor.nbytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _header(dtype: torch.dtype, shape: Sequence[int]):
    return blake3.blake3(f"{dtype_name(dtype)}{tuple(shape)}".encode())


def _sampled(tensor: torch.Tensor) -> bytes | memoryview:
    """The bytes ``fingerprint`` hashes of a contiguous CPU tensor, read at its address (which the tensor,
    alive for the call, keeps valid): half the time of numpy views of it."""
    size = tensor.nbytes
    if not size:
        return b""
    whole = memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")
    if size <= WHOLE_BYTES:
        return whole
    return b"".join([whole[at : at + SAMPLE_BYTES] for at in window_starts(size)])


def _buffer(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()  # at most 4 KiB


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_WINDOW = np.arange(SAMPLE_BYTES)


def leaves(path: tuple, value: Any) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of a live state as a save would key it: tensors, and plain values (a list or tuple of
    scalars is one value, as ``tools.diff.plain_leaves`` takes the stored ones)."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield where, item
        elif isinstance(item, Mapping) and item:
            stack.extend((where + (key,), child) for key, child in reversed(list(item.items())))
        elif isinstance(item, (list, tuple)) and item and not all(_is_scalar(child) for child in item):
            stack.extend((where + (index,), child) for index, child in reversed(list(enumerate(item))))
        else:
            yield where, item


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple, torch.Tensor)) and not isinstance(value, Mapping)
