"""Export to safetensors: one file, or Hugging Face's shards with their index."""

from __future__ import annotations

import os

import ckptfmt
from ckptfmt.converters.export_files import DEFAULT_SHARD_SIZE, ExportResult, safetensors_shards, write_atomically
from ckptfmt.converters.safetensors_format import TORCH_TO_SAFETENSORS, OutTensor, write_file
from ckptfmt.errors import CheckpointError
from ckptfmt.format.dtypes import dtype_from_name


def to_safetensors(reader: ckptfmt.CheckpointReader, dest: str, *, max_shard_size: int | None = None,
                    prefix: str | None = None) -> ExportResult:
    """Flat tensors keyed by their ckptfmt keys (less ``prefix``), one file or HF-style shards.

    Tensors are read lazily and written one at a time, so memory holds at most one
    tensor; plain values do not fit safetensors and are noted.
    """
    notes: list[str] = []
    if prefix is not None:
        if not prefix or prefix == "/":
            raise CheckpointError("prefix must name a part of the state, e.g. 'model/'")
        if not prefix.endswith("/"):
            prefix += "/"  # keys are '/'-joined path segments: strip whole segments
    tensors: list[OutTensor] = []
    skipped = 0
    for key in reader.keys():
        if prefix is not None and not key.startswith(prefix):
            skipped += 1
            continue
        name = key[len(prefix):] if prefix is not None else key
        entry = reader.tensor_info(key)
        if entry.same_as is not None:
            notes.append(f"{key} is the same tensor as {reader.manifest.tensors[entry.same_as].key}; stored again")
        dtype = dtype_from_name(entry.dtype)
        if dtype not in TORCH_TO_SAFETENSORS:
            raise CheckpointError(
                f"{reader.url}: tensor {key!r} has dtype {entry.dtype}, which safetensors cannot hold"
            )
        tensors.append(OutTensor(name, dtype, tuple(entry.shape), lambda key=key: reader.get_tensor(key)))
    if prefix is not None:
        if not tensors:
            raise CheckpointError(f"{reader.url}: no tensor key starts with {prefix!r}")
        if skipped:
            notes.append(f"{skipped} tensor(s) outside {prefix!r} are not exported")
    metadata = {"format": "pt", "ckptfmt.source": reader.url, "ckptfmt.id": reader.id}
    if reader.manifest.step is not None:
        metadata["ckptfmt.step"] = str(reader.manifest.step)
    if prefix is not None:
        metadata["ckptfmt.prefix"] = prefix
    notes.append(
        "safetensors holds tensors only: the state's plain values (counters, hyper-parameters) are not exported"
    )

    if max_shard_size is None and not (os.path.isdir(dest) or dest.endswith(("/", os.sep))):
        write_atomically(dest, lambda tmp: write_file(tmp, tensors, metadata))
        return ExportResult(dest, len(tensors), os.path.getsize(dest), notes, [dest])
    return safetensors_shards(dest, tensors, metadata, max_shard_size or DEFAULT_SHARD_SIZE, notes)
