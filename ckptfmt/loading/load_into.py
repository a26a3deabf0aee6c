"""``load(url, into=state)``: fill a training state in place from a checkpoint, resharding as needed.

Each tensor of ``state`` receives its saved value: a plain tensor the whole
tensor, a DTensor its local shard for its own mesh and placements, read with
``CheckpointReader.read_box`` (only the chunks overlapping it), whatever world
size and layout the checkpoint was saved with. Plain values are replaced by
the saved ones. An object with ``state_dict()`` and ``load_state_dict()`` (a
module, an optimizer, ...) has its state filled so and handed back to it
(loading/live_objects.py). An optimizer's state map the checkpoint holds more
entries of than the target (a fresh optimizer's ``state_dict()``) gets them,
made from the checkpoint. A value saved as ``PerRank`` gives this rank its own; through
``load(into=)`` it stays a ``PerRank`` (the caller's, filled in place), so the
next save keeps every rank's value again. Reading needs no collective: every
rank reads what it needs by itself.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ckptfmt.errors import CheckpointError, CheckpointWarning, StateMismatchError
from ckptfmt.format.per_rank import PerRank, PerRankValues
from ckptfmt.format.values import OpaqueObject, TensorRef, TorchValue, decode_tree, format_key
from ckptfmt.loading.live_objects import LiveObjects
from ckptfmt.loading.threads import read_threads
from ckptfmt.tensors.dtensors import is_dtensor, local_shard
from ckptfmt.tensors.dtypes import dtype_from_name
from ckptfmt.tensors.values import torch_value

#: Names listed per kind of problem in the error, at most.
_LISTED = 20
#: Values a load replaces by the saved ones (what a value tree holds besides tensors and containers).
_REPLACEABLE = (type(None), bool, int, float, complex, str, bytes, set, frozenset, np.generic, torch.dtype,
                torch.device, OpaqueObject, TorchValue)


class _Fill:
    """One walk over the target state: checks it against the saved state, collects the reads to do.

    ``states``: each live object's state to fill in its place (``LiveObjects.states``, or copies of them
    for a dry run); ``made_here``: the optimizer state maps whose entries the checkpoint may lack;
    ``dry``: a check only, whose entries made from the checkpoint take no memory.
    """

    def __init__(self, reader, rank: int, world_size: int | None, keep_per_rank: bool,
                 states: dict[int, Any] | None = None, made_here: Collection[tuple] = (), dry: bool = False):
        self.reader = reader
        self.rank = rank
        self.loading = range(world_size) if world_size else (rank,)  # the ranks a PerRank value must have
        self.keep_per_rank = keep_per_rank
        self.states = states if states is not None else {}
        self.made_here = made_here
        self.dry = dry
        self.root: Any = None
        #: The live objects the checkpoint has a state for.
        self.filled: set[int] = set()
        self._layouts: dict[tuple[int, ...], set] | None = None
        self.reads: list[Callable[[], None]] = []
        self.problems: dict[str, list[str]] = {"missing from the checkpoint": [], "not in the state": [],
                                               "different": []}

    def fill(self, target: Any, saved: Any, path: tuple) -> Any:
        """``target`` with the saved value in place where it can be (tensors, lists, dicts, live objects), else
        the new value."""
        if not path:
            self.root = target
        if id(target) in self.states:  # a live object: its state filled, handed to it once read
            self.filled.add(id(target))
            self.states[id(target)] = self.fill(self.states[id(target)], saved, path)
            return target
        if isinstance(saved, PerRankValues):
            return self._per_rank(target, saved, path)
        if isinstance(target, PerRank):  # the caller's own per-rank value stays one
            target.value = self.fill(target.value, saved, path)
            return target
        if isinstance(target, (torch.Tensor, np.ndarray)):
            if not isinstance(saved, TensorRef):
                self.problems["different"].append(f"{format_key(path)} (a tensor in the state, a "
                                                  f"{type(saved).__name__} in the checkpoint)")
                return target
            self._tensor(target, saved.key)
            return target
        if isinstance(saved, TensorRef):
            self.problems["not in the state" if target is None else "different"].append(saved.key)
            return target
        if isinstance(target, dict) and isinstance(saved, dict):
            if _is_optimizer_state(target) and isinstance(saved.get("state"), dict):
                self._make_missing_state(target, saved["state"], path)
            for key in list(target):
                if key in saved:
                    target[key] = self.fill(target[key], saved[key], (*path, key))
                elif path in self.made_here:  # a moment the optimizer was given here, for a parameter saved without
                    del target[key]
                else:
                    self.problems["missing from the checkpoint"].append(format_key((*path, key)))
            for key in saved:
                if key not in target:
                    self._unexpected(saved[key], (*path, key))
            return target
        if isinstance(target, (list, tuple)) and type(saved) is type(target) and len(saved) == len(target):
            items = [self.fill(t, s, (*path, i)) for i, (t, s) in enumerate(zip(target, saved))]
            if isinstance(target, list):
                target[:] = items
                return target
            return type(target)(items)
        if isinstance(target, (dict, list, tuple)) and _holds_tensors(target):
            self.problems["different"].append(f"{format_key(path)} (a {type(target).__name__} in the state, a "
                                              f"{type(saved).__name__} in the checkpoint)")
            return target
        if not isinstance(target, _REPLACEABLE):
            self.problems["different"].append(
                f"{format_key(path) or 'the state'} (a {type(target).__name__} in the state, which a load cannot "
                f"fill: it fills tensors, containers and objects with state_dict() and load_state_dict())")
            return target
        return saved

    def _make_missing_state(self, target: dict, saved_state: dict, path: tuple) -> None:
        """An optimizer's state dict (a fresh optimizer's has none): the checkpoint's entries for its parameters
        made in ``target["state"]``, to be filled like the others."""
        params = {param for group in target["param_groups"] for param in group["params"]}
        for param, saved in saved_state.items():
            if param not in target["state"] and param in params:
                known = len(self.problems["different"])
                made = self._made(saved, (*path, "state", param))
                if len(self.problems["different"]) == known:  # else left out, and named as not in the state
                    target["state"][param] = made

    def _made(self, saved: Any, path: tuple) -> Any:
        """A new target for a saved value: a tensor of its shape and dtype (laid out as the state's DTensors of
        that shape, where it has some), containers of such, a plain value as saved."""
        if isinstance(saved, TensorRef):
            info = self.reader.tensor_info(saved.key)
            dtype, shape = dtype_from_name(info.dtype), tuple(info.shape)
            if info.kind == "numpy":
                return np.empty(shape, torch.empty(0, dtype=dtype).numpy().dtype)
            layouts = self._dtensor_layouts().get(shape, set())
            if len(layouts) > 1:
                self.problems["different"].append(
                    f"{saved.key} (the state's DTensors of shape {list(shape)} are laid out {len(layouts)} ways: give "
                    "the optimizer itself, not its state_dict(), to have its state made as its parameters)")
                return None
            if self.dry:
                return torch.empty(shape, dtype=dtype, device="meta")
            if layouts:
                import torch.distributed.tensor as dtensor

                mesh, placements = next(iter(layouts))
                return dtensor.empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)
            return torch.empty(shape, dtype=dtype)
        if isinstance(saved, dict):
            return {key: self._made(value, (*path, key)) for key, value in saved.items()}
        if isinstance(saved, (list, tuple)):
            return type(saved)(self._made(value, (*path, i)) for i, value in enumerate(saved))
        return saved

    def _dtensor_layouts(self) -> dict[tuple[int, ...], set]:
        """Global shape -> the (mesh, placements) of the target state's DTensors of that shape."""
        if self._layouts is None:
            self._layouts = {}
            for value in _leaves(self.root, self.states):
                if is_dtensor(value):
                    self._layouts.setdefault(tuple(value.shape), set()).add(
                        (value.device_mesh, tuple(value.placements)))
        return self._layouts

    def _per_rank(self, target: Any, saved: PerRankValues, path: tuple) -> Any:
        """This rank's saved value, a ``PerRank`` with ``keep_per_rank``; every rank's into a ``PerRankValues``.

        A rank loading without a saved value is a problem on every rank (each knows the world size),
        so a strict load fails everywhere alike; a load that is not strict leaves that rank its own.
        """
        if isinstance(target, PerRankValues):  # as a plain load returns it: all ranks', kept for the next save
            target.clear()
            target.update(saved)
            return target
        lacking = [rank for rank in self.loading if rank not in saved]
        if lacking:
            self.problems["missing from the checkpoint"].append(
                f"{format_key(path)} (a PerRank value saved for {_ranks(saved)}: none for {_ranks(lacking)}; "
                "with strict=False such a rank keeps its own value)")
        own = self.fill(target, saved[self.rank], path) if self.rank in saved else target
        if id(own) in self.states:  # a live object stays the caller's; its next save takes its state again
            return own
        return PerRank(own) if self.keep_per_rank and not isinstance(own, PerRank) else own

    def _unexpected(self, saved: Any, path: tuple) -> None:
        refs = _tensor_refs(saved)
        self.problems["not in the state"].extend(refs if refs else [format_key(path)])

    def _tensor(self, target, key: str) -> None:
        info = self.reader.tensor_info(key)
        if is_dtensor(target):
            shard = local_shard(target, format_key((key,)))
            offsets, shape, local, global_shape = (
                shard.offsets,
                tuple(shard.tensor.shape),
                shard.tensor,
                shard.global_shape,
            )
        else:
            offsets, shape, local, global_shape = (0,) * target.ndim, tuple(target.shape), target, tuple(target.shape)
        saved_dtype = dtype_from_name(info.dtype)
        target_dtype = (
            local.dtype if isinstance(local, torch.Tensor) else torch.from_numpy(np.empty(0, local.dtype)).dtype
        )
        if global_shape != tuple(info.shape) or target_dtype != saved_dtype:
            self.problems["different"].append(
                f"{key} (saved {info.dtype} {list(info.shape)}, state {str(target_dtype).removeprefix('torch.')} "
                f"{list(global_shape)})")
            return

        def read() -> None:
            if isinstance(local, torch.Tensor) and local.device.type == "cpu" and local.is_contiguous():
                with torch.no_grad():
                    self.reader.read_box(key, offsets, shape, out=local.detach())  # straight into place
                return
            data = self.reader.read_box(key, offsets, shape)
            if isinstance(local, np.ndarray):
                np.copyto(local, data.numpy())
            else:
                with torch.no_grad():
                    local.copy_(data)
        self.reads.append(read)

    def error(self) -> str | None:
        parts = [f"{len(names)} {kind}: {', '.join(names[:_LISTED])}{', ...' if len(names) > _LISTED else ''}"
                 for kind, names in self.problems.items() if names]
        return "; ".join(parts) or None


def _ranks(ranks: Collection[int]) -> str:
    """``rank 2``, ``ranks 0, 1``, ``ranks 512-1023``."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    listed = ", ".join(map(str, ranks[:_LISTED])) + (", ..." if len(ranks) > _LISTED else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + listed


def _is_optimizer_state(value: dict) -> bool:
    """Whether ``value`` has the form of a torch optimizer's ``state_dict()``."""
    groups = value.get("param_groups")
    return isinstance(value.get("state"), dict) and isinstance(groups, list) and all(
        isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups)


def _leaves(value: Any, states: dict[int, Any]) -> Iterator[Any]:
    """The leaves of a target state, a live object's as those of its state."""
    if id(value) in states:
        value = states[id(value)]
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item, states)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item, states)
    elif isinstance(value, PerRank):
        yield from _leaves(value.value, states)
    else:
        yield value


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def _tensor_refs(value: Any) -> list[str]:
    if isinstance(value, TensorRef):
        return [value.key]
    if isinstance(value, dict):
        return [key for v in value.values() for key in _tensor_refs(v)]
    if isinstance(value, (list, tuple)):
        return [key for v in value for key in _tensor_refs(v)]
    return []


def load_into(reader, into: Any, *, strict: bool, rank: int, workers: int | None = None,
              within: Collection[str] | None = None, world_size: int | None = None,
              keep_per_rank: bool = False) -> Any:
    """Fill ``into`` from ``reader``'s checkpoint; returns it (a new object only where ``into`` is a tuple).

    With ``strict``, any missing or unexpected tensor or value, or a tensor of another shape or dtype,
    raises a CheckpointError listing them before anything is changed; without it, what matches is loaded.
    ``within``: only these top-level entries of a saved map are compared and loaded (the rest of the
    checkpoint is neither loaded nor reported), for a caller that reads the other entries itself.
    ``world_size``: the ranks loading, each of which a saved ``PerRank`` value must have (None: ``rank``).
    ``keep_per_rank``: a saved ``PerRank`` value becomes a ``PerRank`` of this rank's, for a state that is
    saved again; without it, the bare value, for a caller that hands it to a ``load_state_dict``.
    ``workers``: threads reading (None: ``read_threads`` of the checkpoint's bytes).
    """
    keys = reader.keys()
    saved = decode_tree(reader.manifest.state, lambda index: TensorRef(keys[index]), torch_value=torch_value)
    if within is not None:
        if not isinstance(saved, dict):
            raise CheckpointError(f"{reader.url}: the saved state is a {type(saved).__name__}, not a map of entries")
        saved = {key: value for key, value in saved.items() if key in set(within)}
    live = LiveObjects(into)
    try:
        if strict:  # a dry run first: nothing changes on error
            dry = _Fill(reader, rank, world_size, keep_per_rank, {key: _shadow(state) for key, state in
                                                                  live.states.items()}, live.made_here, dry=True)
            dry.fill(_shadow(into), saved, ())
            if dry.error():
                raise StateMismatchError(f"{reader.url}: the state does not match the checkpoint: {dry.error()}")
        walk = _Fill(reader, rank, world_size, keep_per_rank, live.states, live.made_here)
        result = walk.fill(into, saved, ())
        if workers is None:
            workers = read_threads(sum(chunk.stored_size for chunk in reader.manifest.chunks))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-load") as pool:
            for future in [pool.submit(read) for read in walk.reads]:
                future.result()
    except BaseException:
        live.undo()
        raise
    live.load(reader.url, walk.filled)
    if walk.error():  # strict=False: what matched is loaded, the rest named
        warnings.warn(f"{reader.url}: loaded what matches the state, not: {walk.error()}", CheckpointWarning,
                      stacklevel=3)
    return result


def _shadow(value: Any) -> Any:
    """A copy of the containers of ``value`` (tensors shared) for a dry run that must not change it."""
    if isinstance(value, dict):
        shadow = copy.copy(value)
        for key, item in value.items():
            shadow[key] = _shadow(item)
        return shadow
    if isinstance(value, list):
        return [_shadow(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_shadow(v) for v in value)
    if isinstance(value, PerRank):
        return PerRank(_shadow(value.value))
    return value
