"""Random number generator states: captured at save, restored by ``restore_rng``.

Per rank: torch's CPU generator, every CUDA device's generator (when CUDA is in
use), numpy's global generator and Python's ``random``. Byte states are stored
verbatim; numpy's and Python's as plain lists and numbers.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ckptfmt.errors import CheckpointError
from ckptfmt.format.rng_states import pack_python_words, python_words


def capture_rng(rank: int) -> dict:
    """This process's generator states, as one manifest ``rng`` entry."""
    return {"rank": rank, **capture_states()}


def capture_states() -> dict:
    """This process's generator states (an ``rng`` entry without its rank)."""
    entry = {
        "torch_cpu": torch.get_rng_state().numpy().tobytes(),
        "torch_initial_seed": torch.initial_seed(),
        "cuda": [],
        "numpy": _numpy_state(),
        "python": _python_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entry["cuda"] = [state.numpy().tobytes() for state in torch.cuda.get_rng_state_all()]
    return entry


def rng_entry(rank: int, captured: dict | None = None) -> dict:
    """Rank ``rank``'s ``rng`` entry: the states ``captured`` earlier (``capture_states``; an
    asynchronous save takes them when it is called, not when its background thread gets there),
    else the states now."""
    return {"rank": rank, **(capture_states() if captured is None else captured)}


def _numpy_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "bit_generator": name,
        "keys": np.asarray(keys, dtype="<u4").tobytes(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _python_state() -> dict:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "state": pack_python_words(internal), "gauss_next": gauss_next}


def apply_rng(entry: dict, where: str) -> None:
    """Set this process's generators to a captured entry, all of them or none.

    A malformed entry raises CheckpointError and leaves every generator as it was.
    """
    saved = _current_states()
    try:
        _set_states(entry, where)
    except BaseException as exc:
        _restore(saved)
        if isinstance(exc, CheckpointError):
            raise
        if isinstance(exc, KeyError):
            raise CheckpointError(f"{where}: malformed RNG state (missing field {exc})") from None
        if isinstance(exc, (TypeError, ValueError, RuntimeError, OverflowError, AttributeError)):
            raise CheckpointError(f"{where}: malformed RNG state ({exc})") from None
        raise


#: The words of a Mersenne Twister's key: numpy's legacy global state holds exactly this many (spec 9.1).
_MT19937_WORDS = 624


def _described(value: object) -> str:
    """A short account of a stored value, for a message: a bin's length, an int itself, else its type."""
    if type(value) is bytes:
        return f"{len(value)} bytes"
    return str(value) if type(value) is int else f"a {type(value).__name__}"


def _set_states(entry: dict, where: str) -> None:
    # Byte states must be bytes: bytearray(n) of a hostile integer would allocate n bytes.
    if type(entry["torch_cpu"]) is not bytes or not all(type(s) is bytes for s in entry.get("cuda") or []):
        raise TypeError("generator states must be bytes")
    torch.set_rng_state(torch.frombuffer(bytearray(entry["torch_cpu"]), dtype=torch.uint8))
    cuda_states = entry.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            raise CheckpointError(
                f"{where}: {len(cuda_states)} CUDA generator states saved, {torch.cuda.device_count()} devices here"
            )
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in cuda_states])
    numpy_state = entry.get("numpy")
    if numpy_state:
        keys_bin, pos, has_gauss = numpy_state["keys"], numpy_state["pos"], numpy_state["has_gauss"]
        # numpy checks neither: no key words made its set_state raise IndexError, and it reads the key word
        # at ``pos`` unchecked on the next draw (a position of 10**6 crashed the process).
        if type(keys_bin) is not bytes or len(keys_bin) != 4 * _MT19937_WORDS:
            raise TypeError(f"numpy's keys must be a bin of {4 * _MT19937_WORDS} bytes "
                            f"({_MT19937_WORDS} uint32), not {_described(keys_bin)}")
        if type(pos) is not int or not 0 <= pos <= _MT19937_WORDS:
            raise TypeError(f"numpy's pos must be an int in [0, {_MT19937_WORDS}], not {_described(pos)}")
        if type(has_gauss) is not int or has_gauss not in (0, 1):
            raise TypeError(f"numpy's has_gauss must be 0 or 1, not {_described(has_gauss)}")
        keys = np.frombuffer(keys_bin, dtype="<u4").astype(np.uint32)
        np.random.set_state((numpy_state["bit_generator"], keys, pos, has_gauss, numpy_state["cached_gaussian"]))
    python_state = entry.get("python")
    if python_state:
        random.setstate((python_state["version"], python_words(python_state["state"]), python_state["gauss_next"]))


def _current_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _restore(saved: tuple) -> None:
    torch_cpu, cuda, numpy_state, python_state = saved
    torch.set_rng_state(torch_cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
