"""Export a ckptfmt checkpoint to torch.save or safetensors files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError

FORMATS = ("torch", "safetensors")


@dataclass
class ExportResult:
    """What an export wrote, and what it could not carry over."""

    path: str
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)


def export_checkpoint(url: str | os.PathLike, dest: str | os.PathLike, *, format: str,
                      storage_options: dict | None = None) -> ExportResult:
    """Write checkpoint ``url`` to the local file ``dest`` as ``format`` ('torch' or 'safetensors')."""
    if format not in FORMATS:
        raise CheckpointError(f"unknown export format {format!r}: choose from {', '.join(FORMATS)}")
    dest = os.fspath(dest)
    with ckptfmt.open(url, storage_options=storage_options) as reader:
        if format == "torch":
            return _to_torch(reader, dest)
        return _to_safetensors(reader, dest)


def _to_torch(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
    """torch.save of the state, so torch.load(weights_only=True) gives back the same structure."""
    state = reader.load_state()
    _atomic(dest, lambda tmp: torch.save(state, tmp))
    stats = reader.manifest.stats
    return ExportResult(dest, stats.get("tensor_count", 0), os.path.getsize(dest))


def _to_safetensors(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
    """Flat tensors keyed by their ckptfmt keys; plain values do not fit safetensors and are noted."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    notes = []
    for key in reader.keys():
        entry = reader.tensor_info(key)
        if entry.same_as is not None:
            notes.append(f"{key} is the same tensor as {reader.manifest.tensors[entry.same_as].key}; stored again")
        value = reader.get_tensor(key)
        tensors[key] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.detach()
    metadata = {"format": "pt", "ckptfmt.source": reader.url, "ckptfmt.id": reader.id}
    if reader.manifest.step is not None:
        metadata["ckptfmt.step"] = str(reader.manifest.step)
    notes.append("safetensors holds tensors only: the state's plain values (counters, hyper-parameters) are not exported")
    _atomic(dest, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return ExportResult(dest, len(tensors), os.path.getsize(dest), notes)


def _atomic(dest: str, write) -> None:
    """Write through a temp file and rename, so a failed export never leaves a half file."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
