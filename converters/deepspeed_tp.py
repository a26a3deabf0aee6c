"""DeepSpeed tensor-parallel ranks merged into one state, per parameter name.

Each model-parallel rank's state (its ZeRO partitions already joined by ``deepspeed_zero``)
holds its part of every split parameter. How a name merges comes from the user's
``tp_dims``, else Megatron-DeepSpeed's ``universal_checkpoint_info``, else it is inferred
(see ``TpMerge``); ``metadata["deepspeed"]["tp_merge"]`` records each.
"""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from ckptfmt.errors import CheckpointError
from ckptfmt.tensors.sharded import Shard, Sharded

#: universal_checkpoint_info keys (deepspeed/checkpoint/constants.py) and how ds_to_universal merges them
#: (vocabulary parameters: on dim 0, their padding rows kept rather than cut to original_vocab_size)
_UCI_RULES = (("tp_replicated_parameter_patterns", None), ("parameter_to_average_patterns", "average"),
              ("parameter_with_row_parallelism_patterns", 1), ("vocabulary_parameter_patterns", 0))
#: universal_checkpoint_info layouts this reader does not rebuild (a tp_dims rule for the name overrides)
_UCI_UNSUPPORTED = ("parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "affine_map")


class TpMerge:
    """The model-parallel ranks' states as one, per parameter name: replicated, or shards of a concatenation.

    Rank 0's state is the skeleton. Each later rank's tensors (module, fp32, optimizer moments)
    are compared with rank 0's as they come: an identical one is dropped and rank 0's kept in its
    place, so a replicated tensor is held once. How a name merges comes from the user's
    ``tp_dims``, else the checkpoint's ``universal_checkpoint_info`` (as ds_to_universal reads
    it), else it is inferred: replicated when every tensor of the name is identical on every
    rank, otherwise concatenated on dim 0 (ds_to_universal's default). A concatenation is kept
    as a ``ckptfmt.Sharded`` of each rank's part (or of its data-parallel shards), so the ranks'
    partitions stay as they were.
    """

    def __init__(self, folder: str, size: int, tp_dims: dict | None, model: dict):
        self.folder, self.size = folder, size
        self.user = compile_tp_dims(tp_dims)
        info = model.get("universal_checkpoint_info")
        self.info = info if isinstance(info, dict) else {}
        self.shared: dict[str, str] = {}
        self.parts: dict[tuple, list] = {}   # path -> each rank's value (rank 0's where identical)
        self.names: dict[tuple, str] = {}
        self.differs: set[str] = set()
        self.rules: dict[str, tuple] = {}
        self.how: dict[str, int | str] = {}
        self.skeleton: dict = {}
        self.optimizers: list = []           # stage 0: the torch optimizer's state dicts, keyed by index
        self.client_states: list = []

    def add(self, rank: int, state: dict, model: dict, stage: int, where: str) -> None:
        """Take model-parallel rank ``rank``'s state (ranks in order, from 0; ``where``: its model file)."""
        self.shared.update({str(k): str(v) for k, v in (model.get("shared_params") or {}).items()})
        tensors = dict(self._tensors(state, model, stage))
        self.client_states.append(state["client_state"])
        if stage == 0:
            self.optimizers.append(state["optimizer"])
        if rank == 0:
            self.skeleton, self.stage, self.names = state, stage, tensors
            self.parts = {path: [_at(state, path)] for path in tensors}
            return
        if stage != self.stage:
            raise CheckpointError(f"{where}: ZeRO stage {stage}, model-parallel rank 0's is {self.stage}")
        if set(tensors) != set(self.names):
            odd = min(set(tensors) ^ set(self.names))
            raise CheckpointError(f"{where}: {'/'.join(map(str, odd))} is on model-parallel rank 0 or rank {rank} "
                                  "only")
        for path, name in tensors.items():
            self._compare(path, name, _at(state, path), rank, where)

    def _tensors(self, state: dict, model: dict, stage: int):
        """(path, parameter name) of every tensor merged across ranks."""
        buffers = set(model.get("buffer_names") or [])
        for name, value in state["module"].items():
            if isinstance(value, torch.Tensor) and (stage != 3 or name in buffers):  # stage 3: empty placeholders
                yield ("module", name), name
        aliases = model.get("shared_params") or {}
        for name in state.get("fp32", {}):
            if not (name in aliases and aliases[name] in state["fp32"]):
                yield ("fp32", name), name
        if stage != 0:
            for name, moments in state["optimizer"]["state"].items():
                for key, value in moments.items():
                    if isinstance(value, (torch.Tensor, Sharded)):
                        yield ("optimizer", "state", name, key), name

    def _compare(self, path: tuple, name: str, value: Any, rank: int, where: str) -> None:
        parts = self.parts[path]
        if _same_bits(parts[0], value):
            parts.append(parts[0])
            return
        how, source = self._rule(name)
        if len(value.shape) == 0:
            raise CheckpointError(f"{where}: {'/'.join(map(str, path))}: a scalar that differs from "
                                  "model-parallel rank 0's")
        if how is None and source is not None:
            raise CheckpointError(f"{where}: {name!r} is replicated ({source}) but its "
                                  f"{'/'.join(map(str, path))} differs from model-parallel rank 0's")
        self.differs.add(self.shared.get(name, name))
        parts.append(value)

    def _rule(self, name: str) -> tuple:
        """(how, source): how = dim, None (replicated) or "average"; source None when left to inference."""
        if name not in self.rules:
            target = self.shared.get(name, name)
            self.rules[name] = self._user_rule(name, target) or self._info_rule(target) or (None, None)
        return self.rules[name]

    def _user_rule(self, name: str, target: str) -> tuple | None:
        for regex, dim in self.user:
            if regex.search(name) or regex.search(target):
                return dim, f"tp_dims {regex.pattern!r}"
        return None

    def _info_rule(self, name: str) -> tuple | None:
        for key in _UCI_UNSUPPORTED:
            if any(re.match(p, name) for p in _patterns(self.info.get(key))):
                raise CheckpointError(f"{self.folder}: {name!r} has a {key} layout in universal_checkpoint_info, "
                                      "which this reader does not rebuild: give its split with tp_dims (--tp-dim)")
        for key, how in _UCI_RULES:
            if any(re.match(p, name) for p in _patterns(self.info.get(key))):
                return how, f"universal_checkpoint_info {key}"
        return None

    def finish(self, notes: list[str]) -> dict:
        """The merged state; records how each name merged in ``how`` and notes the inferred ones."""
        inferred: dict[str, list] = {}
        averaged = []
        for path, name in self.names.items():
            how, source = self._rule(name)
            if source is None:
                how = 0 if self.shared.get(name, name) in self.differs else None
                inferred.setdefault("replicated" if how is None else f"concatenated on dim {how}", []).append(name)
            parts = self.parts[path]
            if how is None or len(parts[0].shape) == 0:  # a scalar (Adam's step) is the same on every rank
                merged = parts[0]
            elif how == "average":
                merged = self._average(path, name, parts)
                if any(p is not parts[0] for p in parts):
                    averaged.append(name)
            else:
                merged = self._concat(path, name, parts, how)
            _put(self.skeleton, path, merged)
            self.how[name] = "replicated" if how is None else how
        fp32 = self.skeleton.get("fp32")
        for alias, target in self.shared.items():
            if fp32 is not None and target in fp32:
                fp32[alias] = fp32[target]
        if self.stage == 0:
            self.skeleton["optimizer"] = self.optimizers
            notes.append("stage 0: the torch optimizer's state is keyed by parameter index, not name: "
                         "'optimizer' holds one state dict per model-parallel rank")
        if not all(same_tree(c, self.client_states[0]) for c in self.client_states):
            self.skeleton["client_state_by_mp_rank"] = self.client_states
            notes.append("the client state differs between model-parallel ranks: each rank's is in "
                         "'client_state_by_mp_rank'")
        for kind, names in inferred.items():
            names = list(dict.fromkeys(names))
            notes.append(f"{self.size} model-parallel ranks: no tp_dims or universal_checkpoint_info rule, "
                         f"inferred {kind}: {', '.join(names)}")
        if averaged:
            notes.append(f"averaged over the model-parallel ranks (universal_checkpoint_info): "
                         f"{', '.join(dict.fromkeys(averaged))}")
        return self.skeleton

    def _average(self, path: tuple, name: str, parts: list) -> torch.Tensor:
        if all(p is parts[0] for p in parts):
            return parts[0]
        parts = [_whole(p) for p in parts]  # one parameter's copy: averaging makes a new tensor anyway
        if not all(isinstance(p, torch.Tensor) and p.is_floating_point() and p.shape == parts[0].shape
                   and p.dtype == parts[0].dtype for p in parts):
            raise CheckpointError(f"{self.folder}: {name!r} ({'/'.join(map(str, path))}): cannot average "
                                  "tensors of different shapes or dtypes over model-parallel ranks")
        return sum(parts) / len(parts)  # as ds_to_universal does

    def _concat(self, path: tuple, name: str, parts: list, dim: int):
        """The ranks' parts as shards of their concatenation; a part that is itself sharded (over
        data-parallel ranks) gives its shards, moved to the part's place."""
        shape = list(parts[0].shape)
        dtype = _dtype(parts[0])
        if dim >= len(shape) or any(_dtype(p) != dtype or len(p.shape) != len(shape) or
                                    [n for i, n in enumerate(p.shape) if i != dim] !=
                                    [n for i, n in enumerate(shape) if i != dim] for p in parts):
            raise CheckpointError(f"{self.folder}: {name!r} ({'/'.join(map(str, path))}): cannot concatenate "
                                  f"on dim {dim} the model-parallel ranks' {[tuple(p.shape) for p in parts]} "
                                  f"({', '.join(sorted({str(_dtype(p)) for p in parts}))})")
        shards, offset = [], 0
        for rank, part in enumerate(parts):
            pieces = part.shards if isinstance(part, Sharded) else [Shard((0,) * len(shape), part, rank)]
            for piece in pieces:
                offsets = list(piece.offsets)
                offsets[dim] += offset
                shards.append(Shard(tuple(offsets), piece.tensor.contiguous(), rank=piece.rank))
            offset += part.shape[dim]
        shape[dim] = offset
        return Sharded(tuple(shape), shards)


def _patterns(entry: Any) -> list[str]:
    """The regexes a universal_checkpoint_info entry names: a list, sub-parameter dicts, or an affine map."""
    if isinstance(entry, dict):  # affine_map: {"version": ..., "params": {pattern: map}}
        entry = list(entry.get("params") or {})
    patterns = []
    for item in entry if isinstance(entry, list) else []:
        if isinstance(item, dict):  # parameter_with_sub_params: [{"patterns": [...], "shape": ..., ...}]
            patterns.extend(p for p in item.get("patterns") or [] if isinstance(p, str))
        elif isinstance(item, str):
            patterns.append(item)
    return patterns


def compile_tp_dims(tp_dims: dict | None) -> list[tuple]:
    """tp_dims as (compiled regex, dim or None), checked."""
    rules = []
    for pattern, dim in (tp_dims or {}).items():
        if not isinstance(pattern, str) or not (dim is None or (type(dim) is int and dim >= 0)):
            raise CheckpointError(f"tp_dims: {pattern!r}: {dim!r}: expected a regex and a dimension >= 0 or None "
                                  "(replicated)")
        try:
            rules.append((re.compile(pattern), dim))
        except re.error as exc:
            raise CheckpointError(f"tp_dims: {pattern!r} is not a regular expression: {exc}") from None
    return rules


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: Any, path: tuple, value: Any) -> None:
    _at(tree, path[:-1])[path[-1]] = value


def _dtype(value: torch.Tensor | Sharded) -> torch.dtype:
    return value.shards[0].tensor.dtype if isinstance(value, Sharded) else value.dtype


def _whole(value: torch.Tensor | Sharded) -> torch.Tensor:
    """A tensor, or a Sharded assembled into a new one."""
    if isinstance(value, torch.Tensor):
        return value
    out = torch.empty(value.shape, dtype=_dtype(value))
    for shard in value.shards:
        out[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
    return out


def _rows(value: torch.Tensor | Sharded) -> list[tuple[int, torch.Tensor]]:
    """(first row, tensor) of a tensor whole, or of each shard of a Sharded cut in row ranges (``_join``'s)."""
    if isinstance(value, torch.Tensor):
        return [(0, value)]
    return sorted(((shard.offsets[0], shard.tensor) for shard in value.shards), key=lambda r: r[0])


def _same_rows(a: torch.Tensor | Sharded, b: torch.Tensor | Sharded) -> bool:
    """Identical tensors, either given as row shards: compared range by range, neither assembled."""
    if _dtype(a) != _dtype(b) or tuple(a.shape) != tuple(b.shape):
        return False
    rows_a, rows_b = _rows(a), _rows(b)
    cuts = sorted({r for r, _ in rows_a} | {r for r, _ in rows_b} | {a.shape[0]})
    for lo, hi in pairwise(cuts):
        part_a, part_b = [next(t.narrow(0, lo - r, hi - lo) for r, t in reversed(rows) if r <= lo)
                          for rows in (rows_a, rows_b)]
        if not _same_bits(part_a, part_b):
            return False
    return True


def _same_bits(a: Any, b: Any) -> bool:
    """Identical tensors, bit for bit (NaNs included), or equal plain values."""
    if isinstance(a, Sharded) or isinstance(b, Sharded):
        return isinstance(a, (torch.Tensor, Sharded)) and isinstance(b, (torch.Tensor, Sharded)) \
            and _same_rows(a, b)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return same_tree(a, b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_tree(a: Any, b: Any) -> bool:
    """Equal values, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b
