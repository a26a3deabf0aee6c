"""Staging a state for an asynchronous save: a private copy, in host buffers reused across saves.

After staging, the training loop may change its tensors at once: the save
works on the copy. Buffers are kept per tensor key and reused while dtype and
shape stay the same, so a steady training loop allocates them once (and the
fingerprint cache sees the same addresses save after save). CUDA tensors are
copied into pinned buffers on a side stream, and their statistics (spec 6.10)
reduced on the device beside the copy, so that the host never makes a pass of
its own over them; staging returns once the copies and reductions are
complete. Containers are rebuilt and plain values copied, so the state's
structure may change too.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ckptfmt.format.per_rank import PerRank
from ckptfmt.format.values import format_key
from ckptfmt.tensors.dtensors import is_dtensor, local_shard
from ckptfmt.tensors.sharded import LocalShard, Shard, Sharded
from ckptfmt.tensors.stats import PendingStats, collect


def memory_key(tensor: torch.Tensor) -> tuple:
    """What names a staged tensor's memory whatever wraps it (a Parameter, a detached view)."""
    return tensor.data_ptr(), tensor.dtype, tensor.numel()


class StagingArea:
    """Host buffers by tensor key; ``stage(state)`` returns the staged copy of ``state``."""

    def __init__(self, *, tensor_stats: bool = True):
        self.tensors: dict[str, torch.Tensor] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.stream: torch.cuda.Stream | None = None  # the CUDA side stream, made on first use
        #: Whether CUDA tensors' statistics are reduced on their device as they are copied.
        self.tensor_stats = tensor_stats
        #: (host buffer, its statistics being reduced on the device) of the stage in progress.
        self._pending: list[tuple[torch.Tensor, PendingStats]] = []
        #: host buffer (``memory_key``) -> statistics taken on the device, for the last state staged.
        self.device_stats: dict[tuple, dict] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return (sum(t.numel() * t.element_size() for t in self.tensors.values())
                + sum(a.nbytes for a in self.arrays.values()))

    def stage(self, state: Any) -> Any:
        """The staged copy of ``state``; ``device_stats`` then holds the statistics of its CUDA tensors."""
        copies: dict[int, Any] = {}
        self._pending = []
        staged = self._stage(state, (), copies)
        if self.stream is not None:
            self.stream.synchronize()
        buffers = [buffer for buffer, _ in self._pending]
        self.device_stats = {memory_key(buffer): stats
                             for buffer, stats in zip(buffers, collect([p for _, p in self._pending]))}
        self._pending = []
        return staged

    def _stage(self, value: Any, path: tuple, copies: dict[int, Any]) -> Any:
        kind = type(value)
        if kind in (dict, OrderedDict):
            return kind((k, self._stage(v, (*path, k), copies)) for k, v in value.items())
        if kind in (list, tuple):
            return kind(self._stage(v, (*path, i), copies) for i, v in enumerate(value))
        if kind is PerRank:
            return PerRank(self._stage(value.value, path, copies))
        if isinstance(value, torch.Tensor) or kind in (np.ndarray, Sharded):
            if id(value) not in copies:  # a tensor seen twice (tied weights) stays one object
                copies[id(value)] = self._tensor(value, format_key(path))
            return copies[id(value)]
        return copy.deepcopy(value)

    def _tensor(self, value: Any, key: str) -> Any:
        if type(value) is np.ndarray:
            buffer = self.arrays.get(key)
            if buffer is None or buffer.dtype != value.dtype or buffer.shape != value.shape:
                buffer = self.arrays[key] = np.empty_like(value, order="C")
            np.copyto(buffer, value)
            return buffer
        if type(value) is Sharded:
            return Sharded(value.shape, tuple(Shard(s.offsets, self._copy(s.tensor, f"{key}#{i}"), s.rank)
                                              for i, s in enumerate(value.shards)))
        if is_dtensor(value):
            shard = local_shard(value, key)
            return shard.with_tensor(self._copy(shard.tensor, key))
        if type(value) is LocalShard:
            return value.with_tensor(self._copy(value.tensor, key))
        if value.device.type == "meta":
            return value  # no data: the save refuses it with its path
        staged = self._copy(value, key)
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(staged, requires_grad=value.requires_grad)
        return staged.detach().requires_grad_(True) if value.requires_grad else staged

    def _copy(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """``tensor``'s values in this key's host buffer (CUDA: pinned, copied on the side stream)."""
        tensor = tensor.detach()
        buffer = self.tensors.get(key)
        if buffer is None or buffer.dtype != tensor.dtype or buffer.shape != tensor.shape:
            buffer = self.tensors[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        if tensor.is_cuda:
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                buffer.copy_(tensor, non_blocking=True)
                if self.tensor_stats:
                    self._pending.append((buffer, PendingStats(tensor)))
        else:
            buffer.copy_(tensor)
        return buffer
