"""DTensors as boxes: where each rank's local shard lies in the global tensor.

A collective save stores each rank's box (LocalShard), a load into DTensors
reads each rank's box back, and the DCP layer records the device meshes.

``torch.distributed.tensor`` is imported only when a state holds a DTensor, so
single-process saves never pay for it. A box is where the local shard lies in
the global tensor (offsets and shape, from torch's own placement arithmetic);
ranks that replicate a shard (``Replicate`` on some mesh dimension) hold the
same box, and the collective save stores it once.
"""

from __future__ import annotations

import sys

import torch

from ckptfmt.errors import UnsupportedValueError
from ckptfmt.tensors.sharded import LocalShard


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor when unused)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_shard(value, where: str) -> LocalShard:
    """This rank's shard of DTensor ``value`` and its box; Partial placements are refused."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in value.placements):
        raise UnsupportedValueError(
            f"{where}: a DTensor with a Partial placement holds unreduced values; redistribute it to "
            "Shard or Replicate placements before saving"
        )
    mesh = value.device_mesh
    local = value.to_local()
    shape, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedValueError(
            f"{where}: the DTensor's local tensor has shape {list(local.shape)}, its placements say {list(shape)}"
        )
    return LocalShard(local, tuple(int(o) for o in offsets), tuple(int(d) for d in value.shape), mesh_record(mesh),
                      "parameter" if isinstance(value, torch.nn.Parameter) else "tensor", bool(value.requires_grad))


def mesh_record(mesh) -> dict:
    """A device mesh as ``topology.meshes`` records it (spec 9.3): its shape and dimension names."""
    names = mesh.mesh_dim_names
    return {"shape": list(mesh.shape), "dim_names": list(names) if names else None}


def meshes_of(values) -> list[dict]:
    """The distinct device meshes of the DTensors among ``values``, in order of appearance."""
    meshes: list[dict] = []
    for value in values:
        if is_dtensor(value):
            mesh = mesh_record(value.device_mesh)
            if mesh not in meshes:
                meshes.append(mesh)
    return meshes
