"""Classes that test pickles refer to by name (importable as ``pickle_fixtures`` from tests/)."""

from __future__ import annotations

import os

import numpy as np
import torch


class Config:
    """A plain user class, as training scripts put in checkpoints (hyper-parameters, tokenizers)."""

    def __init__(self, name: str, weights: torch.Tensor, extra: dict):
        self.name = name
        self.weights = weights
        self.extra = extra

    def __eq__(self, other) -> bool:
        return (type(other) is Config and self.name == other.name and self.extra == other.extra
                and self.weights.dtype == other.weights.dtype and torch.equal(self.weights, other.weights))


class Registry(dict):
    """A dict subclass with an attribute (pickled with SETITEMS and BUILD)."""

    def __eq__(self, other) -> bool:
        return type(other) is Registry and dict.__eq__(self, other) and self.__dict__ == other.__dict__


class WithSlots:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other) -> bool:
        return type(other) is WithSlots and (self.a, self.b) == (other.a, other.b)

    def __reduce_ex__(self, protocol):
        return WithSlots, (self.a, self.b)


class Hostile:
    """Runs a shell command when unpickled by a normal unpickler."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class HostileEval:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').close()",)


class Tagged(np.ndarray):
    """An ndarray subclass (pickled through numpy's _reconstruct with this class)."""
