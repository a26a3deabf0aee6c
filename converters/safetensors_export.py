"""Export to safetensors: one file, or Hugging Face's shards with their index."""

from __future__ import annotations

import os
import re

import ckptfmt
from ckptfmt.converters.export_files import DEFAULT_SHARD_SIZE, ExportResult, safetensors_shards, write_atomically
from ckptfmt.converters.safetensors_format import TORCH_TO_SAFETENSORS, OutTensor, write_file
from ckptfmt.errors import CheckpointError
from ckptfmt.tensors.dtypes import dtype_from_name
from ckptfmt.tools.diff import plain_values


def to_safetensors(reader: ckptfmt.CheckpointReader, dest: str, *, max_shard_size: int | None = None,
                    prefix: str | None = None, provenance: bool = False) -> ExportResult:
    """Flat tensors named by their state paths (less ``prefix``), one file or HF-style shards.

    Tensors are read lazily and written one at a time, so memory holds at most one
    tensor; plain values do not fit safetensors and are noted. A checkpoint imported
    from a safetensors file comes back as that file, byte for byte (``_file_metadata``);
    ``provenance`` adds the checkpoint's URL and id to the metadata.
    """
    notes: list[str] = []
    prefix = _whole_segments(prefix)
    tensors, skipped = _tensors(reader, prefix, notes)
    if prefix is not None:
        if not tensors:
            raise CheckpointError(f"{reader.url}: no tensor key starts with {prefix!r}")
        if skipped:
            notes.append(f"{skipped} tensor(s) outside {prefix!r} are not exported")
    notes += _plain_values_note(reader, prefix)
    metadata = _file_metadata(reader, prefix, provenance)

    if max_shard_size is None and not (os.path.isdir(dest) or dest.endswith(("/", os.sep))):
        write_atomically(dest, lambda tmp: write_file(tmp, tensors, metadata))
        return ExportResult(dest, len(tensors), os.path.getsize(dest), notes, [dest])
    return safetensors_shards(dest, tensors, metadata, max_shard_size or DEFAULT_SHARD_SIZE, notes)


def _whole_segments(prefix: str | None) -> str | None:
    """``prefix`` ending with '/': keys are '/'-joined path segments, and whole segments are stripped."""
    if prefix is None:
        return None
    if not prefix or prefix == "/":
        raise CheckpointError("prefix must name a part of the state, e.g. 'model/'")
    return prefix if prefix.endswith("/") else prefix + "/"


def _tensors(reader: ckptfmt.CheckpointReader, prefix: str | None, notes: list[str]) -> tuple[list[OutTensor], int]:
    """The tensors to write, read lazily, and how many keys lie outside ``prefix``."""
    tensors: list[OutTensor] = []
    keys_of: dict[str, str] = {}  # name -> key
    skipped = 0
    for key in reader.keys():
        if prefix is not None and not key.startswith(prefix):
            skipped += 1
            continue
        entry = reader.tensor_info(key)
        if entry.same_as is not None:
            notes.append(f"{key} is the same tensor as {reader.manifest.tensors[entry.same_as].key}; stored again")
        dtype = dtype_from_name(entry.dtype)
        if dtype not in TORCH_TO_SAFETENSORS:
            raise CheckpointError(
                f"{reader.url}: tensor {key!r} has dtype {entry.dtype}, which safetensors cannot hold"
            )
        name = _unescaped(key[len(prefix):] if prefix is not None else key)
        if name in keys_of:
            raise CheckpointError(f"{reader.url}: tensors {keys_of[name]!r} and {key!r} would both be named {name!r}")
        keys_of[name] = key
        tensors.append(OutTensor(name, dtype, tuple(entry.shape), lambda key=key: reader.get_tensor(key)))
    return tensors, skipped


def _unescaped(key: str) -> str:
    """A key's segments joined by plain '/' and '%' (keys escape them), so a safetensors name
    such as 'model/w', imported as one segment, is written back as it was."""
    return re.sub("%2F|%25", lambda m: "/" if m.group() == "%2F" else "%", key)


def _plain_values_note(reader: ckptfmt.CheckpointReader, prefix: str | None) -> list[str]:
    """A note naming the plain values under ``prefix`` that safetensors cannot hold; none when there are none."""
    keys = [key for key, value in plain_values(reader.manifest).items()
            if (prefix is None or key.startswith(prefix)) and not _empty_container(value)]
    if not keys:
        return []
    shown = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
    return [f"safetensors holds tensors only: the state's plain values are not exported ({len(keys)}: {shown})"]


def _empty_container(value) -> bool:
    return isinstance(value, (dict, list, tuple)) and not value


def _file_metadata(reader: ckptfmt.CheckpointReader, prefix: str | None, provenance: bool) -> dict[str, str] | None:
    """The ``__metadata__`` to write (None: none at all).

    A checkpoint imported from safetensors gets its source's, unchanged (None where the
    source had none), so an import then an export gives back the file; any other gets
    ``format`` and its step. ``prefix`` and ``provenance`` add what they change.
    """
    user = reader.metadata["user"]
    source_kind = (reader.manifest.provenance or {}).get("source_kind")
    if source_kind == "safetensors" and isinstance(user, dict) and "safetensors_metadata" in user:
        metadata = user["safetensors_metadata"]
    else:
        metadata = {"format": "pt"}
        if reader.manifest.step is not None:
            metadata["ckptfmt.step"] = str(reader.manifest.step)
    added = {}
    if prefix is not None:
        added["ckptfmt.prefix"] = prefix
    if provenance:
        added |= {"ckptfmt.source": reader.url, "ckptfmt.id": reader.id}
    return {**(metadata or {}), **added} if added else metadata
