"""The objects a ``load(into=...)`` fills: modules, optimizers, schedulers, anything stateful.

Each stateful object in the target state (tensors/stateful.py) gives its ``state_dict()``; the load
fills that state in place, then hands it back with ``load_state_dict``, as DCP does for its
``Stateful`` values. An optimizer that has no state yet (a fresh one, as every resume starts) is first
given one the way ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` does it, with
torch's own helper (a step on zero gradients at a learning rate of zero): every moment then exists,
shaped and sharded as its parameter (a DTensor for an FSDP2 parameter), for the checkpoint's to go in.
Moments of parameters the checkpoint holds none for (never trained before the save) are dropped
again: the optimizer then holds exactly what was saved.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ckptfmt.errors import CheckpointError
from ckptfmt.format.per_rank import PerRank
from ckptfmt.format.values import format_key
from ckptfmt.tensors.stateful import holds_stateful, is_stateful


class LiveObjects:
    """The stateful objects of a target state, each with its state to fill (taken at construction)."""

    def __init__(self, into: Any):
        #: id of each object -> its ``state_dict()``, which the load fills in place.
        self.states: dict[int, Any] = {}
        #: Paths of the optimizers' ``state`` maps made here: an entry the checkpoint lacks is left out.
        self.made_here: set[tuple] = set()
        self._objects: list[tuple[tuple, Any]] = []
        #: id of each object -> the optimizer given its state here (a fresh one, or one it wraps).
        self._initialised: dict[int, torch.optim.Optimizer] = {}
        try:
            if holds_stateful(into):
                self._find(into, ())
        except BaseException:
            self.undo()
            raise

    def _find(self, value: Any, path: tuple) -> None:
        if is_stateful(value):
            if id(value) not in self.states:
                optimizer = _optimizer_of(value)
                if optimizer is not None and _initialise(optimizer):
                    self._initialised[id(value)] = optimizer
                    self.made_here.add((*path, "state"))
                self.states[id(value)] = value.state_dict()
                self._objects.append((path, value))
        elif isinstance(value, dict):
            for key, item in value.items():
                self._find(item, (*path, key))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self._find(item, (*path, index))
        elif isinstance(value, PerRank):
            self._find(value.value, path)

    def load(self, url: str, filled: Collection[int]) -> None:
        """Hand each object of ``filled`` (ids) its filled state (``load_state_dict``); an object that refuses
        it is named. One the checkpoint had nothing for is left as it was (a state given here taken back)."""
        for path, obj in self._objects:
            if id(obj) not in filled:
                self._take_back(id(obj))
                continue
            try:
                obj.load_state_dict(self.states[id(obj)])
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                raise CheckpointError(f"{url}: {format_key(path) or 'the state'} (a {type(obj).__name__}) refused "
                                      f"the checkpoint's state: {exc}") from exc

    def undo(self) -> None:
        """Take back the state given to fresh optimizers: a load that fails leaves them as they were."""
        for key in list(self._initialised):
            self._take_back(key)

    def _take_back(self, key: int) -> None:
        optimizer = self._initialised.pop(key, None)
        if optimizer is not None:
            optimizer.state.clear()


def _optimizer_of(value: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer ``value`` is or wraps (Lightning's, Accelerate's wrappers hold it as ``optimizer``)."""
    while isinstance(value, torch.optim.Optimizer):
        inner = getattr(value, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return value
        value = inner
    return None


def _initialise(optimizer: torch.optim.Optimizer) -> bool:
    """Give a stateless ``optimizer`` its state with torch's own helper (what ``set_optimizer_state_dict``
    does first); True if it now has state it did not have. Gradients the parameters hold meanwhile are
    put back: the helper would otherwise skip an optimizer whose parameters have them."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if optimizer.state:
        return False
    params = [param for group in optimizer.param_groups for param in group["params"]]
    grads = [param.grad for param in params]
    for param in params:
        param.grad = None
    try:
        _init_optim_state(optimizer)
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad
    return bool(optimizer.state)
