"""The value tree's tensor hook for a save: ``TensorCollector`` turns each leaf of the state into a
tensor source (``tensors/sources.py``) and a ``PlannedTensor`` entry, numbering each tensor once (the
same object, the same entry): plain tensors whole, DTensors as their local shard, ``Sharded`` values
as their shards, each refused before anything is written if readers would refuse it. (The DCP storage
writer gets its tensors from DCP's planner instead.)
"""

from __future__ import annotations

import math
import operator

import torch

from ckptfmt.errors import ManifestError, UnsupportedValueError
from ckptfmt.format.limits import MAX_DIMS, MAX_KEY_BYTES
from ckptfmt.format.manifest import MAX_RANK, ShardEntry
from ckptfmt.format.tiling import check_tiling
from ckptfmt.format.values import format_key, state_path
from ckptfmt.saving.plan import PlannedTensor, SourceBox
from ckptfmt.saving.staging import memory_key
from ckptfmt.tensors.dtensors import is_dtensor, local_shard
from ckptfmt.tensors.sharded import LocalShard, Shard, Sharded
from ckptfmt.tensors.sources import TensorSource, prepare
from ckptfmt.tensors.stats import PendingStats

#: The offsets of a whole tensor's box, by its number of dimensions.
_ORIGINS = [(0,) * ndim for ndim in range(MAX_DIMS + 1)]


class TensorCollector:
    """The value tree's tensor hook: prepares each leaf and numbers it (same object, same entry).

    In a collective save (``collective``), a DTensor becomes its local shard, at its offsets in
    the global tensor; the meshes met are kept in ``meshes``. ``frozen``: the state is staged
    memory (an asynchronous save's) that stays unchanged until the save ends. ``tensor_stats``: tensors
    on a device other than the CPU get their statistics (spec 6.10) reduced there before their
    bytes are copied to the host; ``device_stats`` gives those of staged tensors, taken on their
    device when they were staged (by ``staging.memory_key``).
    """

    def __init__(self, sources: list[TensorSource], entries: list[PlannedTensor], *, collective: bool = False,
                 frozen: bool = False, tensor_stats: bool = True, device_stats: dict[tuple, dict] | None = None):
        self.sources = sources
        self.entries = entries
        self.collective = collective
        self.frozen = frozen
        self.tensor_stats = tensor_stats
        self.device_stats = device_stats or {}
        self.meshes: list[dict] = []
        self.seen: dict[int, int] = {}
        self.keys: set[str] = set()

    def __call__(self, path: tuple, value) -> int:
        key = format_key(path)
        if not path:
            raise UnsupportedValueError("a tensor at the root of the state has no key: save {'tensor': t} instead")
        if len(key) > MAX_KEY_BYTES // 4 and len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise UnsupportedValueError(f"tensor key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
        if key in self.keys:
            raise UnsupportedValueError(f"two tensors map to the key {key!r}; rename one of the dict keys")
        self.keys.add(key)
        index = len(self.entries)
        first = self.seen.get(id(value))
        if first is not None:
            self.entries.append(self.entries[first].alias(key, first))
            return index
        self.seen[id(value)] = index
        where = _Where(path)
        kind = type(value)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:  # a plain tensor is neither below
            if kind is Sharded:
                self.entries.append(self._sharded(key, value, where))
                return index
            if is_dtensor(value) or kind is LocalShard:
                self.entries.append(self._dtensor(key, value, where))
                return index
        source = self._source(value, where)
        self.entries.append(PlannedTensor(key, source.dtype, source.shape, source.kind, source.requires_grad,
                                          (SourceBox(len(self.sources) - 1, _ORIGINS[len(source.shape)]),)))
        return index

    def forget(self) -> None:
        """Let go of what only the encoding needs (the keys and objects met), once the tree is encoded."""
        self.seen.clear()
        self.keys.clear()

    def _dtensor(self, key: str, value, where: _Where) -> PlannedTensor:
        """An entry for this rank's shard of a DTensor, or of a staged one (the other ranks add theirs).

        A process saving alone holds every shard only where the mesh is this one process (a job of
        one rank, as torchtitan or FSDP2 run on one GPU): such a DTensor is saved, any other refused."""
        shard = value if type(value) is LocalShard else local_shard(value, str(where))
        if not self.collective and math.prod(shard.mesh["shape"]) != 1:
            raise UnsupportedValueError(
                f"{where}: a DTensor is saved by a collective save: call ckptfmt.save on every rank of its "
                "process group (a save with coordinated=False stores plain tensors only)"
            )
        if shard.mesh not in self.meshes:
            self.meshes.append(shard.mesh)
        source = self._source(shard.tensor, where)
        return PlannedTensor(key, source.dtype, tuple(shard.global_shape), shard.kind, shard.requires_grad,
                             (SourceBox(len(self.sources) - 1, tuple(shard.offsets)),))

    def _source(self, value, where: _Where) -> TensorSource:
        """A new source for ``value`` (frozen: staged memory that nothing changes during the save),
        with its statistics when they are taken before its bytes reach the host."""
        on_device = (self.tensor_stats and isinstance(value, torch.Tensor) and not value.is_cpu
                     and not value.is_meta)
        pending = PendingStats(value) if on_device else None
        source = prepare(value, where)
        source.frozen = self.frozen and source.borrowed
        if pending is not None:
            source.stats = pending.result()
        elif self.tensor_stats and self.device_stats and isinstance(value, torch.Tensor):
            source.stats = self.device_stats.get(memory_key(value))
        self.sources.append(source)
        return source

    def _sharded(self, key: str, value: Sharded, where: _Where) -> PlannedTensor:
        """An entry whose shards are separate sources; refuses layouts readers would refuse."""
        if not value.shards:
            raise UnsupportedValueError(f"{where}: a sharded tensor needs at least one shard")
        shards, dtypes = [], set()
        for shard in value.shards:
            if not isinstance(shard, Shard) or not isinstance(shard.tensor, torch.Tensor):
                raise UnsupportedValueError(f"{where}: shards must be ckptfmt.Shard(offsets, tensor, rank)")
            source = self._source(shard.tensor, where)
            dtypes.add(source.dtype)
            shards.append(SourceBox(len(self.sources) - 1, tuple(int(o) for o in shard.offsets),
                                    _shard_rank(shard, where)))
        if len(dtypes) != 1:
            raise UnsupportedValueError(f"{where}: shards have different dtypes {sorted(dtypes)}")
        boxes = tuple(ShardEntry(b.offsets, self.sources[b.source].shape, b.owner or 0, ()) for b in shards)
        try:
            if any(len(b.offsets) != len(value.shape) or len(b.shape) != len(value.shape) or
                   any(o + n > d for o, n, d in zip(b.offsets, b.shape, value.shape)) for b in boxes):
                raise ManifestError(f"{where}: a shard lies outside the global shape {list(value.shape)}")
            check_tiling(str(where), value.shape, boxes)
        except ManifestError as exc:
            raise UnsupportedValueError(str(exc)) from None
        return PlannedTensor(key, dtypes.pop(), tuple(value.shape), "tensor", False, tuple(shards))


class _Where:
    """Where a leaf is in the state, as errors name it (``state['a'][0]``): spelled out only for an error,
    as most leaves never need it."""

    __slots__ = ("path",)

    def __init__(self, path: tuple):
        self.path = path

    def __str__(self) -> str:
        return state_path(self.path)


def _shard_rank(shard: Shard, where: _Where) -> int:
    """A shard's owning rank (spec 6.5): an integer in [0, MAX_RANK], refused before anything is written."""
    rank = shard.rank
    if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 0 <= operator.index(rank) <= MAX_RANK:
        raise UnsupportedValueError(f"{where}: a shard's rank must be an integer in [0, {MAX_RANK}], not {rank!r}")
    return operator.index(rank)
