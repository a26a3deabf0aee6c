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
from ckptfmt.format.rng_states import numpy_state_tuple, pack_python_words, python_state_tuple


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


def _set_states(entry: dict, where: str) -> None:
    """Every state checked and decoded before any generator is set; CUDA's last (a process that has not
    started CUDA only queues them, and nothing can take a queued state back)."""
    # Byte states must be bytes: bytearray(n) of a hostile integer would allocate n bytes.
    if type(entry["torch_cpu"]) is not bytes or not all(type(s) is bytes for s in entry.get("cuda") or []):
        raise TypeError("generator states must be bytes")
    numpy_state, python_state = entry.get("numpy"), entry.get("python")
    numpy_tuple = numpy_state_tuple(numpy_state) if numpy_state else None
    python_tuple = python_state_tuple(python_state) if python_state else None
    torch.set_rng_state(torch.frombuffer(bytearray(entry["torch_cpu"]), dtype=torch.uint8))
    if numpy_tuple is not None:
        np.random.set_state(numpy_tuple)
    if python_tuple is not None:
        random.setstate(python_tuple)
    cuda_states = entry.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            raise CheckpointError(
                f"{where}: {len(cuda_states)} CUDA generator states saved, {torch.cuda.device_count()} devices here"
            )
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in cuda_states])


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
