"""Digests of every random generator's state at a step's start: half of a step's signature (spec 9.4).

Two runs that agree on every generator's state and on the batch at a step's
start, and whose step then computes a different loss, differ by
nondeterminism; if a generator's state differs, the step's randomness does.
A digest is the first 16 bytes of BLAKE3 over the generator's state as bytes:

- ``torch``: ``torch.default_generator.get_state()`` (the CPU generator's 5,056 bytes);
- ``cuda:<i>``: each CUDA device's ``get_rng_state(i)``, once CUDA is initialised;
- ``numpy``: the global legacy generator's MT19937 state, its 624 words and position as numpy
  keeps them (2,500 bytes, read at the bit generator's ``ctypes.state_address``: ``get_state()``
  builds a dict and costs 28 us, more than the whole step budget);
- ``python``: ``random.getstate()``'s 625 words as little-endian uint32 (read from the object where
  CPython keeps them: ``getstate()`` alone costs 6 us);
- generators a loop or an integration tracks by name (a data loader's, a sampler's): a
  ``torch.Generator``'s ``get_state()``, a ``random.Random``'s words, a numpy ``Generator``'s
  or ``RandomState``'s bit generator state.

torch is never imported here: its sources are read only once the loop has loaded it. The cost
(bench/step_signature.py) is a few microseconds per generator, most of it Python's ``getstate``.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np

#: Bytes of one generator's digest.
RNG_DIGEST_BYTES = 16
_PYTHON_WORDS = struct.Struct("<625I")
#: numpy's MT19937 state struct: 624 uint32 words and an int position (numpy/random/src/mt19937).
_MT19937_BYTES = 624 * 4 + 4

Reader = Callable[[], Any]


class RngDigests:
    """The generators a step timer digests at each step's start, in a fixed order of names."""

    def __init__(self, generators: dict[str, Any] | None = None):
        self.readers: dict[str, Reader] = {"numpy": _numpy_global_reader(),
                                           "python": _python_reader(random._inst)}
        self._torch_seen = False
        self._cuda_devices = 0
        for name, generator in (generators or {}).items():
            self.track(name, generator)

    def track(self, name: str, generator: Any) -> None:
        """Digest ``generator`` under ``name`` from the next step on."""
        if not isinstance(name, str) or not name or name in ("torch", "numpy", "python") or name.startswith("cuda:"):
            raise ValueError(f"a tracked generator needs a name of its own, not {name!r}")
        self.readers[name] = reader_of(generator, name)

    def digests(self) -> dict[str, bytes]:
        """Every generator's digest now, by name."""
        self._find_torch()
        return {name: blake3.blake3(read()).digest(RNG_DIGEST_BYTES) for name, read in self.readers.items()}

    def _find_torch(self) -> None:
        """Add torch's generators once the loop has imported torch, and CUDA's once it is in use."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        if not self._torch_seen:
            self._torch_seen = True
            generator = torch.default_generator
            self.readers["torch"] = lambda: generator.get_state().numpy()
        cuda = torch.cuda
        if cuda.is_initialized() and self._cuda_devices < cuda.device_count():
            for index in range(self._cuda_devices, cuda.device_count()):
                self.readers[f"cuda:{index}"] = _cuda_reader(cuda, index)
            self._cuda_devices = cuda.device_count()


def _cuda_reader(cuda: Any, index: int) -> Reader:
    return lambda: cuda.get_rng_state(index).numpy()


def reader_of(generator: Any, name: str) -> Reader:
    """A function that returns ``generator``'s state as bytes (any buffer)."""
    if isinstance(generator, random.SystemRandom):
        raise ValueError(f"cannot digest the generator {name!r}: random.SystemRandom has no state")
    if isinstance(generator, random.Random):
        return _python_reader(generator)
    if isinstance(generator, (np.random.Generator, np.random.RandomState)):
        bit_generator = generator.bit_generator if isinstance(generator, np.random.Generator) \
            else generator._bit_generator
        return _bit_generator_reader(bit_generator)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(generator, torch.Generator):
        return lambda: generator.get_state().numpy()
    raise ValueError(f"cannot digest the generator {name!r}: a {type(generator).__name__}, not a torch.Generator, "
                     "random.Random or numpy Generator/RandomState")


def _python_reader(generator: random.Random) -> Reader:
    """A ``random.Random``'s 625 words (624 of state, then the position) as little-endian uint32.

    ``getstate()`` makes 625 Python ints: 9 us with their packing, half of a step's budget. CPython
    keeps them in the object itself (``_randommodule.c``: the object's header, the position as an
    int, the 624 words), so they are read from there where that reads exactly what ``getstate``
    says (checked here, once per generator); elsewhere (another Python, another layout) through
    ``getstate``."""
    def slow() -> bytes:
        return _PYTHON_WORDS.pack(*generator.getstate()[1])
    if sys.implementation.name != "cpython" or sys.byteorder != "little":
        return slow
    address = id(generator) + object.__basicsize__  # past the reference count and the type
    raw = ctypes.string_at(address, 4 + 624 * 4)
    if raw[4:] + raw[:4] != slow():
        return slow

    def fast() -> bytes:
        raw = ctypes.string_at(address, 4 + 624 * 4)
        return raw[4:] + raw[:4]
    return fast


def _numpy_global_reader() -> Reader:
    return _bit_generator_reader(np.random.mtrand._rand._bit_generator)


def _bit_generator_reader(bit_generator: Any) -> Reader:
    """An MT19937's state read straight from its struct where that reads what ``state`` says (checked
    once), else its ``state`` map as text (other bit generators keep a few words: that is cheap)."""
    if isinstance(bit_generator, np.random.MT19937):
        address = bit_generator.ctypes.state_address
        raw = ctypes.string_at(address, _MT19937_BYTES)
        state = bit_generator.state["state"]
        if raw == np.asarray(state["key"], dtype="<u4").tobytes() + int(state["pos"]).to_bytes(4, "little",
                                                                                              signed=True):
            return lambda: ctypes.string_at(address, _MT19937_BYTES)
    return lambda: repr(_plain(bit_generator.state)).encode()


def _plain(value: Any) -> Any:
    """A bit generator's state with arrays as lists, keys sorted: the same state, the same text."""
    if isinstance(value, dict):
        return sorted((str(k), _plain(v)) for k, v in value.items())
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
