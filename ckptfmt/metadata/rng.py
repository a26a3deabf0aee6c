"""Random number generator states: captured at save, restored by ``restore_rng``.

Per rank: torch's CPU generator, every CUDA device's generator (when CUDA is in
use), numpy's global generator and Python's ``random``. Byte states are stored
verbatim; numpy's and Python's as plain lists and numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DecodedStates:
    """An RNG entry's states (spec 9.1), each checked and in the form its generator's setter takes: numpy's
    and Python's None where the entry has none."""

    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]
    numpy: tuple | None
    python: tuple | None


def decode_states(entry: dict) -> DecodedStates:
    """Every state of ``entry`` checked and decoded, before any generator is set; TypeError, ValueError or
    KeyError for a malformed one."""
    # Byte states must be bytes: bytearray(n) of a hostile integer would allocate n bytes.
    if type(entry["torch_cpu"]) is not bytes or not all(type(s) is bytes for s in entry.get("cuda") or []):
        raise TypeError("generator states must be bytes")
    numpy_state, python_state = entry.get("numpy"), entry.get("python")
    return DecodedStates(
        torch_cpu=torch.frombuffer(bytearray(entry["torch_cpu"]), dtype=torch.uint8),
        cuda=[torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in entry.get("cuda") or []],
        numpy=numpy_state_tuple(numpy_state) if numpy_state else None,
        python=python_state_tuple(python_state) if python_state else None)


def _set_states(entry: dict, where: str) -> None:
    """Every state decoded before any generator is set; CUDA's last (a process that has not started CUDA
    only queues them, and nothing can take a queued state back)."""
    states = decode_states(entry)
    torch.set_rng_state(states.torch_cpu)
    if states.numpy is not None:
        np.random.set_state(states.numpy)
    if states.python is not None:
        random.setstate(states.python)
    if states.cuda and torch.cuda.is_available():
        if len(states.cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"{where}: {len(states.cuda)} CUDA generator states saved, {torch.cuda.device_count()} devices here"
            )
        torch.cuda.set_rng_state_all(states.cuda)


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
